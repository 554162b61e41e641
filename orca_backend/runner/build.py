"""Building a runner from its spec: the weights, the attention backend and the K/V pool."""
from __future__ import annotations

from pathlib import Path

import torch

from .model_runner import ModelRunner
from .models import load_model
from .models.attention import TorchPagedAttention
from .models.kernel_attention import KernelPagedAttention
from .spec import RunnerSpec


def build_runner(spec: RunnerSpec, model=None) -> ModelRunner:
    """Load the weights (unless `model` is already loaded) and allocate the K/V pool."""
    if spec.engine == "tensorrt":
        from .tensorrt_runner import build_tensorrt_runner  # imports trt_plugins' builder

        return build_tensorrt_runner(spec)
    dtype, device = getattr(torch, spec.dtype), torch.device(spec.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # kernels launch on the current device
    if model is None:
        layers = range(*spec.layer_range) if spec.layer_range else None
        model = load_model(Path(spec.model_path), dtype, device, layers)
    backend = KernelPagedAttention if spec.attention == "triton" else TorchPagedAttention
    runner = ModelRunner(model, spec.num_blocks, spec.block_size, device, dtype, spec.seed,
                         spec.keep_logits, backend(spec.block_size, device))
    if spec.cuda_graphs and spec.attention == "triton" and not spec.layer_range:
        runner.enable_decode_graphs(spec.max_batch_size, -(-spec.max_model_len // spec.block_size),
                                    capture=device.type == "cuda")
    return runner
