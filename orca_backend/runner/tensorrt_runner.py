"""`engine: tensorrt`: the model runs as one TensorRT engine per iteration, its attention our
plugin over the runner's paged K/V pool, behind the same runner contract as the PyTorch path
(`ModelRunner`: the same messages in, the same sampled tokens out).

The runner keeps everything but the forward pass: per-request state, block tables, the K/V
pool (allocated here, in the kernel's layout, and handed to the engine as device addresses)
and sampling. The engine is built once per checkpoint and set of options and cached on disk
(`trt_plugins.builder`).

`tensorrt_runtime: torch` evaluates the same graph with torch instead (our plugin by its own
entry, interpreted on the CPU): it checks the graph and this runner where TensorRT cannot run.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from trt_plugins.paged_attention import kv_cache_table

from ..checkpoint.config import ModelConfig
from ..core.errors import ConfigError
from .devices import make_current
from .model_runner import ModelRunner
from .models.attention import BatchLayout, TorchPagedAttention
from .models.kernel_attention import kernel_metadata

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineModel:
    """What `ModelRunner` reads of a model, for one whose forward pass is an engine."""

    config: ModelConfig

    @property
    def layer_range(self) -> range:
        return range(self.config.num_layers)


class GraphEngine:
    """The engine's graph evaluated with torch (`trt_plugins.network.TorchGraph`)."""

    def __init__(self, graph, shapes) -> None:
        self.graph, self.shapes = graph, shapes

    def run(self, feeds: dict[str, torch.Tensor], num_rows: int, vocab_size: int) -> torch.Tensor:
        self.shapes.check(feeds)
        return self.graph.evaluate(feeds)["logits"]


class TensorRTEngine:
    """A deserialized TensorRT engine and one execution context, run on torch's current stream."""

    def __init__(self, trt, plan: bytes, shapes, device: torch.device) -> None:
        self.trt, self.shapes, self.device = trt, shapes, device
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise RuntimeError("TensorRT could not deserialize the engine (built by another version?)")
        self.context = self.engine.create_execution_context()

    def run(self, feeds: dict[str, torch.Tensor], num_rows: int, vocab_size: int) -> torch.Tensor:
        self.shapes.check(feeds)
        context = self.context
        for name, tensor in feeds.items():
            if not context.set_input_shape(name, tuple(tensor.shape)):
                raise RuntimeError(f"TensorRT refused shape {tuple(tensor.shape)} for input {name!r}")
            context.set_tensor_address(name, tensor.data_ptr())
        shape = tuple(context.get_tensor_shape("logits"))
        if shape != (num_rows, vocab_size):
            raise RuntimeError(f"the engine's logits are {shape}, expected {(num_rows, vocab_size)}")
        logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        context.set_tensor_address("logits", logits.data_ptr())
        stream = torch.cuda.current_stream(self.device)
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT failed to run the iteration (its log says why)")
        return logits


class TensorRTRunner(ModelRunner):
    """`ModelRunner` whose forward pass (embeddings to logits of the sampled rows) is an engine."""

    def __init__(self, config: ModelConfig, engine, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, seed: int, keep_logits: bool = False) -> None:
        super().__init__(EngineModel(config), num_blocks, block_size, device, dtype, seed, keep_logits,
                         TorchPagedAttention(block_size, device))  # the kernel's cache layout
        self.engine = engine
        # The plugin's address table [1 + L, 2]: the guard row, then each layer's caches.
        self.kv_cache_ptrs = kv_cache_table([self.kv_caches[i] for i in range(config.num_layers)], device)

    def _compute(self, layout: BatchLayout, token_ids: list[int], hidden, last_rows: list[int], lora=None,
                 pooled_rows=()):
        if pooled_rows:  # EngineConfig refuses pooling_type with this engine
            raise RuntimeError("engine 'tensorrt' returns no hidden states")
        if lora is not None:  # EngineConfig refuses enable_lora with this engine
            raise RuntimeError("engine 'tensorrt' has no LoRA path")
        if hidden is not None:
            raise RuntimeError("engine 'tensorrt' runs whole models, not pipeline stages")
        positions, cu_seqlens_q, seq_lens, block_tables = kernel_metadata(layout)
        rows = last_rows or [0]  # the engine computes at least one row of logits

        def dev(a, dtype=torch.int32):
            return torch.as_tensor(a, dtype=dtype).to(self.device, non_blocking=True)

        feeds = dict(input_ids=dev(token_ids), positions=dev(positions), cu_seqlens_q=dev(cu_seqlens_q),
                     seq_lens=dev(seq_lens), block_tables=dev(block_tables),
                     kv_cache_ptrs=self.kv_cache_ptrs, logit_rows=dev(rows))
        logits = self.engine.run(feeds, len(rows), self.model.config.vocab_size)
        return logits[:len(last_rows)], None


def build_tensorrt_runner(spec) -> TensorRTRunner:
    """Load the checkpoint, build (or load the cached) engine and allocate the K/V pool."""
    from trt_plugins.builder import EngineShapes, build_engine, cached_engine, define_llama, engine_key
    from trt_plugins.network import TorchGraph

    from .models import load_model

    dtype, device = getattr(torch, spec.runner.dtype), torch.device(spec.runner.device)
    config = ModelConfig.from_folder(Path(spec.model_path))
    shapes = EngineShapes.from_limits(config.num_layers, spec.scheduler.max_num_batched_tokens,
                                      spec.scheduler.max_batch_size, spec.max_model_len, spec.cache.block_size)
    if spec.runner.tensorrt_runtime == "torch":
        model = load_model(Path(spec.model_path), dtype, device)
        graph = TorchGraph()
        define_llama(graph, model, shapes, spec.cache.block_size)
        engine = GraphEngine(graph, shapes)
    else:
        if device.type != "cuda":
            raise ConfigError(f"engine 'tensorrt' runs on a GPU; device is {spec.runner.device!r}")
        from trt_plugins.plugin import gpu_arch, import_tensorrt, register_plugin

        make_current(device)
        trt = import_tensorrt()
        register_plugin()
        key = engine_key(Path(spec.model_path), spec.runner.dtype, shapes, spec.cache.block_size,
                         trt.__version__, gpu_arch())

        def build() -> bytes:
            log.info("building the TensorRT engine for %s (cached for later starts)", spec.model_path)
            return build_engine(load_model(Path(spec.model_path), dtype, torch.device("cpu")),
                                shapes, spec.cache.block_size)

        plan = cached_engine(Path(spec.engine_cache_dir), key, build)
        engine = TensorRTEngine(trt, plan, shapes, device)
    return TensorRTRunner(config, engine, spec.num_blocks, spec.cache.block_size, device, dtype,
                          spec.runner.seed, spec.runner.keep_logits)
