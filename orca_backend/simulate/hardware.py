"""What the simulator knows of a machine: one device's peak and memory, the links between
devices, and how much of the peaks our engine reaches (the efficiency factors).

The GPU presets are vendor figures (dense bf16 tensor-core FLOP/s, HBM bandwidth, NVLink and
InfiniBand per GPU, from NVIDIA's A100, H100 and H200 datasheets; each preset's comment says
which) with efficiency factors that no run of ours has fitted yet: they are uncalibrated
until a profile on that GPU replaces them.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ConfigError

GIB = 2 ** 30


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str
    peak_flops: float  # per device, the model's dtype, dense
    memory_bandwidth: float  # bytes/s per device
    memory_bytes: float  # per device
    devices_per_node: int
    intra_node_bandwidth: float  # bytes/s per device and direction (NVLink)
    intra_node_latency: float  # seconds per collective step or hop
    inter_node_bandwidth: float  # bytes/s per device and direction (the network)
    inter_node_latency: float
    compute_efficiency: float = 0.6  # of peak_flops that a large GEMM reaches
    bandwidth_efficiency: float = 0.8  # of memory_bandwidth that a weight-bound GEMM reaches
    iteration_overhead_seconds: float = 0.0  # the host's share of an iteration
    row_overhead_seconds: float = 0.0  # and of each request in it (inputs, sampling, outputs)
    memory_utilization: float = 0.9  # of memory_bytes the engine may use
    calibrated: bool = False  # efficiency factors fitted from a profile of our engine

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory_bandwidth", "memory_bytes", "intra_node_bandwidth",
                     "inter_node_bandwidth"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"hardware {self.name!r}: {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("compute_efficiency", "bandwidth_efficiency", "memory_utilization"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"hardware {self.name!r}: {name} must be in (0, 1], "
                                  f"got {getattr(self, name)!r}")
        for name in ("iteration_overhead_seconds", "row_overhead_seconds"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"hardware {self.name!r}: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.devices_per_node < 1:
            raise ConfigError(f"hardware {self.name!r}: devices_per_node must be >= 1")

    def with_factors(self, **factors) -> Hardware:
        return dataclasses.replace(self, **factors)


PRESETS = {
    # A100 SXM4 40GB: 312 TFLOP/s bf16, 1555 GB/s HBM2, NVLink 3 600 GB/s both ways; a node of
    # 8 with one 200 Gb/s HDR InfiniBand port per GPU (ORCA's cluster).
    "a100-40gb": Hardware("a100-40gb", 312e12, 1555e9, 40 * GIB, 8, 300e9, 5e-6, 25e9, 10e-6),
    # H100 SXM5 80GB: 989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 4 900 GB/s both ways, 400 Gb/s NDR.
    "h100": Hardware("h100", 989e12, 3350e9, 80 * GIB, 8, 450e9, 5e-6, 50e9, 10e-6),
    # H200 SXM 141GB: the H100's compute, 4.8 TB/s HBM3e.
    "h200": Hardware("h200", 989e12, 4800e9, 141e9, 8, 450e9, 5e-6, 50e9, 10e-6),
}


def load_hardware(preset: str, calibration: Path | None = None) -> Hardware:
    """A preset by name, or `cpu` from the calibration file its profile step wrote; refuses an
    unknown name, listing the known ones."""
    if preset == "cpu":
        if calibration is None:
            raise ConfigError("hardware 'cpu' needs its calibration file (--calibration FILE; "
                              "python -m benchmarks.bench_simulate --profile writes it)")
        if not Path(calibration).exists():
            raise ConfigError(f"hardware 'cpu': no calibration file {calibration}; python -m "
                              "benchmarks.bench_simulate --profile writes it")
        try:
            raw = json.loads(Path(calibration).read_text())
        except ValueError as e:
            raise ConfigError(f"{calibration} is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{calibration}: expected an object of hardware fields")
        fields = {f.name for f in dataclasses.fields(Hardware)}
        unknown = set(raw) - fields
        if unknown:
            raise ConfigError(f"{calibration}: unknown hardware fields {sorted(unknown)}")
        try:
            return Hardware(**raw)
        except TypeError as e:
            raise ConfigError(f"{calibration}: {e}") from None
    if preset not in PRESETS:
        raise ConfigError(f"unknown hardware preset {preset!r}; known: {', '.join([*PRESETS, 'cpu'])}")
    return PRESETS[preset]
