"""The GEMM paths a CPU engine could run its projections on, side by side in one run.

The 30 layers' projections of SmolLM2-135M (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576,
down 576 x 1536; 398 MB in fp32, distinct tensors, so nothing stays in cache), at a few batch
sizes M, through each path; and the K/V gather of a decode batch. Prints a markdown table
(and with --markdown-append adds it to a report).

    python benchmarks/bench_gemm.py --markdown-append docs/benchmarks/cpu.md
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import log, table  # noqa: E402
from orca_backend.runner.models.linear import Linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def _int8_weight_only(w: torch.Tensor):
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scales)


def _packed(w: torch.Tensor, backend: str):
    linear = Linear(w.clone())
    linear.pack(backend)
    return linear


def _openblas(w: torch.Tensor):
    """numpy's bundled OpenBLAS over the plain [out, in] weight: the fastest single-row GEMM
    here, but a plain layout is oneDNN's worst from two rows on, so it is not offered (the
    engine would need both copies of every weight)."""
    wt = w.numpy().T
    return lambda x: torch.from_numpy(x.numpy() @ wt)


def _compiled():
    return torch.compile(lambda x, w: F.linear(x, w), dynamic=False)


def paths(bf16_native: bool) -> dict:
    compiled = _compiled()
    out = {
        "F.linear fp32 (MKL; linear torch)": lambda w: (lambda x: F.linear(x, w)),
        "oneDNN fp32, prepacked (linear onednn, the default)": lambda w: _packed(w, "onednn"),
        "numpy fp32, x @ W.T (OpenBLAS; not an engine path)": _openblas,
        "torch.compile F.linear fp32 (Inductor, static shapes)": lambda w: (lambda x: compiled(x, w)),
        "fbgemm int8, per-token activations (quantization int8)": lambda w: _packed(w, "int8"),
        "aten._weight_int8pack_mm (int8 weights only)": _int8_weight_only,
    }
    if not bf16_native:  # without a bfloat16 GEMM oneDNN refuses to pack bf16; F.linear converts
        out["F.linear bf16 (no native bf16 GEMM here)"] = lambda w: (lambda x, wb=w.bfloat16(): F.linear(x.bfloat16(), wb))
    else:
        out["oneDNN bf16, prepacked"] = lambda w: (lambda x, lin=_packed(w.bfloat16(), "onednn"): lin(x.bfloat16()))
    return out


def run_path(make, weights, m: int, repeats: int = 3) -> float:
    fns = [(make(w), w.shape[1]) for w in weights]
    xs = {k: torch.randn(m, k) for k in (576, 1536)}

    def once():
        for fn, k in fns:
            fn(xs[k])
    once()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    return best


def gather_rows() -> list[list[str]]:
    num_blocks, block, heads, dim = 2048, 16, 3, 64
    cache = torch.randn(num_blocks, block, heads, dim)
    rows = []
    for batch, context in ((1, 64), (32, 64), (32, 256)):
        blocks = torch.randint(0, num_blocks, (batch, context // block))

        def index():
            return cache[blocks].flatten(1, 2)

        def select():
            return cache.view(num_blocks, -1).index_select(0, blocks.reshape(-1)).view(batch, context, heads, dim)
        times = []
        for fn in (index, select):
            fn()
            start = time.perf_counter()
            for _ in range(50):
                fn()
            times.append((time.perf_counter() - start) / 50)
        rows.append([f"batch {batch}, context {context}", f"{times[0] * 1e3:.3f} ms",
                     f"{times[1] * 1e3:.3f} ms", f"{times[0] / times[1]:.1f}x"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--markdown-append", type=Path)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    weights = [torch.randn(n, k) / 24 for _ in range(LAYERS) for n, k in SHAPES]
    nbytes = sum(w.numel() * 4 for w in weights)
    batches = [int(b) for b in args.batches.split(",")]
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    rows = []
    with torch.inference_mode():
        for name, make in paths(bf16).items():
            cells = [name]
            for m in batches:
                if "_weight_int8pack_mm" in name and m > 8:
                    cells.append("not run (seconds per pass)")
                    continue
                seconds = run_path(make, weights, m)
                cells.append(f"{seconds * 1e3:.1f} ms ({nbytes / seconds / 1e9:.1f} GB/s, "
                             f"{2 * m * nbytes / 4 / seconds / 1e9:.0f} GFLOP/s)")
            log(" | ".join(cells))
            rows.append(cells)
        gathers = gather_rows()
    md = ["## GEMM paths, the layers' projections alone", "",
          f"`python benchmarks/bench_gemm.py`: the 30 layers' 120 projections ({nbytes / 1e6:.0f} MB "
          "fp32) at M rows, best of 3; in brackets the fp32 bytes over the time and the FLOP rate.", "",
          *table(["path", *(f"M = {m}" for m in batches)], rows), "",
          "The K/V gather of a decode batch (one layer's K, blocks of 16, 3 K/V heads of 64):", "",
          *table(["", "cache[blocks]", "index_select (ours)", "ratio"], gathers), ""]
    print("\n".join(md))
    if args.markdown_append:
        with open(args.markdown_append, "a") as f:
            f.write("\n" + "\n".join(md))


if __name__ == "__main__":
    main()
