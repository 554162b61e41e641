"""What a runner is built from, as plain values: it crosses to child processes and to the
Triton stage models (`dataclasses.asdict` there, `RunnerSpec(**values)` back)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from ..core.config import EngineConfig


@dataclass(slots=True)
class RunnerSpec:
    model_path: str
    dtype: str
    device: str
    num_blocks: int
    block_size: int
    seed: int
    keep_logits: bool = False
    attention: str = "torch"  # "torch" (SDPA) or "triton" (our kernel)
    cuda_graphs: bool = False  # decode iterations from CUDA graphs (padded eagerly on the CPU)
    max_batch_size: int = 32  # the largest decode graph
    max_model_len: int = 2048  # sets the graphs' block-table width
    layer_range: tuple[int, int] | None = None  # a pipeline stage's layers [start, stop); None: all
    engine: str = "torch"  # "torch" (PyTorch layers) or "tensorrt" (one TensorRT engine per iteration)
    tensorrt_runtime: str = "tensorrt"  # "torch": the engine's graph evaluated with torch (checks)
    max_num_batched_tokens: int = 512  # with the batch size and model length, the engine's profile
    engine_cache_dir: str = ""  # where built TensorRT engines are kept
    tensor_parallel_size: int = 1  # ranks, each with 1/T of every layer (this process is rank 0)
    collective_timeout_seconds: float = 300.0  # a collective waiting longer fails the group
    linear: str = "auto"  # the projections' GEMM (models/linear.py)
    quantization: str = "none"  # "int8": int8 projections (CPU)
    null_step_seconds: float = 0.0  # engine "null": the sleep standing for each forward
    enable_lora: bool = False  # requests may carry LoRA adapters (the runner's tiers, lora/slots.py)
    max_loras: int = 1  # device slots: distinct adapters in one iteration
    max_cpu_loras: int = 1  # adapters kept in host memory beyond those in use
    max_lora_rank: int = 16
    draft_model_path: str = ""  # speculative decoding's draft model, run by the rank that samples
    pooling_type: str = "none"  # embedding requests: "last" or "mean" over the final hidden states

    def __post_init__(self) -> None:
        if self.layer_range is not None:  # a list, after a trip through msgpack or JSON
            self.layer_range = tuple(self.layer_range)

    @classmethod
    def from_config(cls, config: EngineConfig, *, model_path: Path | str, num_blocks: int,
                    max_model_len: int, engine_cache_dir: str = "") -> RunnerSpec:
        """The runner of a whole model, as `config` asks for it: each field named as an option
        takes its value; the rest is what the engine worked out (the checkpoint's folder, the
        K/V pool's size, the context limit, where built engines are kept) or derived here."""
        options = config.options()
        values = {f.name: options[f.name] for f in fields(cls) if f.name in options}
        return cls(**values | dict(
            model_path=str(model_path), num_blocks=num_blocks, max_model_len=max_model_len,
            engine_cache_dir=engine_cache_dir, attention=config.runner.attention_backend,
            draft_model_path=config.draft_model_path,
            # under the engine's deadline, so a hung rank is named before the runner is
            collective_timeout_seconds=max(1.0, config.parallel.iteration_timeout_seconds / 2)))
