"""Which GPU a thread launches on."""
from __future__ import annotations

import torch


def make_current(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (the current device is per
    thread; kernels and graphs launch on it). `cuda` without an index means the thread's
    current one, which torch's set_device no longer takes; nothing to do off CUDA."""
    if device.type == "cuda":
        torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
