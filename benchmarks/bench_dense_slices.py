"""What a long call to a quantized projection holds in memory: the default model's LM head
shape (49152 x 576) packed as int4, called on 300 rows (past the dense crossover), with the
weight dequantized whole and in slices of output channels (the engine's way). Each mode runs
in a fresh interpreter; the figure is the rise of the process's peak resident memory over the
call (Linux's VmHWM, reset just before it), beside the call's CPU time (best of 5).

    python -m benchmarks.bench_dense_slices
"""
from __future__ import annotations

import subprocess
import sys

ROWS, OUT, IN, GROUP = 300, 49152, 576, 64


def _peak_mb() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) // 1024


def measure(mode: str) -> None:
    """In this process: print `mode peak_mb output_mb cpu_ms`."""
    import ctypes
    import time

    import torch

    from orca_backend.runner.models import quantized

    if mode == "whole":
        quantized.DENSE_SLICE_BYTES = 1 << 62
    g = torch.Generator().manual_seed(0)
    weight = quantized.Int4Groups(torch.randint(0, 16, (OUT, IN), generator=g, dtype=torch.uint8),
                                  torch.rand(OUT, IN // GROUP, generator=g) / 100, GROUP,
                                  zero=torch.zeros(OUT, IN // GROUP))
    kernel = quantized.Int4Kernel(weight, None, torch.float32)
    del weight
    x = torch.randn(ROWS, IN, generator=g)
    times = []
    for _ in range(5):
        start = time.process_time()
        kernel(x)
        times.append(time.process_time() - start)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak back to the current resident size
    before = _peak_mb()
    y = kernel(x)
    print(mode, _peak_mb() - before, y.numel() * y.element_size() >> 20, round(min(times) * 1e3, 1))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--mode":
        measure(sys.argv[2])
        return
    print(f"int4 [{OUT}, {IN}] in groups of {GROUP}, {ROWS} rows: the call's peak memory rise, its output, CPU time")
    for mode in ("whole", "sliced"):
        line = subprocess.run([sys.executable, "-m", "benchmarks.bench_dense_slices", "--mode", mode],
                              check=True, capture_output=True, text=True).stdout.split()
        print(f"  {mode:>6}: {line[1]} MB (output {line[2]} MB), {line[3]} ms CPU")


if __name__ == "__main__":
    main()
