"""Building a runner from its spec: the weights, the attention backend and the K/V pool; with
`tensor_parallel_size` T > 1, this rank's shard of them (rank 0 also starts the other ranks)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoint.config import ModelConfig
from ..checkpoint.store import model_folder
from ..core.errors import ConfigError
from ..core.load_watch import stage as load_stage
from ..core.speculative import SpeculativeConfig
from ..grammar import GrammarCompiler, compiler_for
from ..lora import LoRASlots
from .devices import make_current
from .drafter import DraftModel
from .model_runner import ModelRunner
from .null_runner import NullRunner
from .proposers import NgramProposer, Proposer
from .models import is_quantized_checkpoint, load_model
from .models.attention import TorchPagedAttention
from .models.kernel_attention import KernelPagedAttention
from .models.linear import batch_invariant, linear_backend, pack_linears
from .models.moe import prepare_experts
from .models.parallel import Shard
from .spec import RunnerSpec



def build_runner(spec: RunnerSpec, model=None, rank: int = 0) -> ModelRunner | NullRunner:
    """Load the weights (unless `model` is already loaded) and allocate the K/V pool."""
    if spec.runner.engine == "null":
        return NullRunner(spec.model_path, spec.runner.null_step_seconds, grammar_compiler(spec))
    if spec.runner.engine == "tensorrt":
        if is_quantized_checkpoint(Path(spec.model_path)):
            raise ConfigError(f"engine 'tensorrt' builds full-precision engines; {spec.model_path} is a quantized "
                              "checkpoint: use engine 'torch'")
        if spec.parallel.num_ranks > 1:
            raise ConfigError("engine 'tensorrt' builds single-rank engines; tensor_parallel_size "
                              f"{spec.parallel.tensor_parallel_size} and expert_parallel_size "
                              f"{spec.parallel.expert_parallel_size} need engine 'torch'")
        from .tensorrt_runner import build_tensorrt_runner  # imports trt_plugins' builder

        runner = build_tensorrt_runner(spec)
        runner.grammars = grammar_compiler(spec)
        return runner
    if spec.parallel.num_ranks > 1:
        return _build_rank(spec, rank)
    dtype, device = getattr(torch, spec.runner.dtype), torch.device(spec.runner.device)
    make_current(device)  # kernels launch on the current device
    backend = linear_backend(device, dtype, spec.runner.quantization, spec.runner.linear)  # refused before loading
    if model is None:
        layers = range(*spec.layer_range) if spec.layer_range else None
        load_stage("loading the weights")
        model = load_model(Path(spec.model_path), dtype, device, layers)
    load_stage("preparing the projections' kernels")
    _prepare(model, spec, backend)  # a stage's model, loaded before, keeps the backend it has
    attention = _attention(spec, device, model)
    load_stage("allocating the K/V pool and the runner's parts")
    runner = ModelRunner(model, spec.num_blocks, spec.cache.block_size, device, dtype, spec.runner.seed,
                         spec.runner.keep_logits, attention, grammars=grammar_compiler(spec),
                         loras=_lora_slots(spec, model, dtype, device),
                         proposer=_proposer(spec, model, attention, backend, device), pooling_type=spec.runner.pooling_type)
    # Decode graphs need every op free of host reads: our kernels are; torch's grouped GEMM is not.
    graphable = model.config.moe is None or spec.runner.moe_kernel_backend == "triton"
    if spec.runner.cuda_graphs and isinstance(attention, KernelPagedAttention) and graphable and not spec.layer_range:
        runner.enable_decode_graphs(spec.scheduler.max_batch_size, -(-spec.max_model_len // spec.cache.block_size),
                                    capture=device.type == "cuda")
    return runner


def _prepare(model, spec: RunnerSpec, backend: str) -> None:
    """The kernels a loaded model runs on: its projections' GEMM, its experts'."""
    prepare_experts(model, spec.runner.moe_kernel_backend, backend)
    pack_linears(model, backend)
    if spec.runner.deterministic:
        _refuse_variant_kernels(model)
        batch_invariant(model, getattr(torch, spec.runner.dtype))


def _refuse_variant_kernels(model) -> None:
    """Deterministic mode's refusals of kernels that give a row other bits in another batch:
    torch's grouped GEMM (the experts of a mixture), a quantized checkpoint's kernels."""
    name = model.config.architecture
    if model.config.moe is not None:
        raise ConfigError(f"deterministic true is not supported with a mixture of experts ({name}) yet: "
                          "the experts' grouped GEMM gives a row other bits in another batch")
    packed = {linear.backend for linear in model.linears()} - {"onednn"}
    if packed:
        raise ConfigError(f"deterministic true is not supported with a quantized checkpoint ({name}, "
                          f"{'/'.join(sorted(packed))} projections) yet")


def grammar_compiler(spec: RunnerSpec) -> GrammarCompiler:
    """This process's compiler for the model's tokenizer (the engine's too, in-process)."""
    config = ModelConfig.from_folder(Path(spec.model_path))
    return compiler_for(spec.model_path, config.vocab_size, config.eos_token_ids)


def _lora_slots(spec: RunnerSpec, model, dtype: torch.dtype, device: torch.device) -> LoRASlots | None:
    if not spec.scheduler.enable_lora:
        return None
    return LoRASlots(model, spec.scheduler.max_loras, spec.runner.max_cpu_loras, spec.runner.max_lora_rank, dtype, device)


def _proposer(spec: RunnerSpec, model, attention, backend, device: torch.device) -> Proposer | None:
    """Speculative decoding's proposer, if any. A draft model runs whole, on the runner's
    device, its K/V beside the target's; the model's own checkpoint drafting for it (a test
    of the machinery: every proposal holds) shares its weights when the runner has the whole
    model."""
    config = SpeculativeConfig.parse(spec.scheduler.speculative_config)
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    dtype = getattr(torch, spec.runner.dtype)
    whole = spec.parallel.num_ranks == 1 and not spec.layer_range
    draft = model_folder(config.model)  # a GGUF draft: its folder in the cache
    if not (whole and draft.resolve() == Path(spec.model_path).resolve()):
        model = load_model(draft, dtype, device)
        _prepare(model, spec, backend)
    if model.config.kernel_gap:  # a draft with latent attention runs on SDPA's backend, whatever the target's
        attention = TorchPagedAttention(spec.cache.block_size, device)
    return DraftModel(model, spec.num_blocks, device, dtype, attention, spec.scheduler.max_num_batched_tokens)


def _attention(spec: RunnerSpec, device: torch.device, model):
    """The attention backend: SDPA's for models whose attention our kernel does not compute
    (`ModelConfig.kernel_gap`, refused when asked for by name)."""
    kernel = spec.runner.attention_backend == "triton" and not model.config.kernel_gap
    if spec.runner.deterministic:
        if model.config.mla is not None:
            raise ConfigError("deterministic true is not supported with latent attention (MLA) yet")
        return TorchPagedAttention(spec.cache.block_size, device, invariant=True)
    return (KernelPagedAttention if kernel else TorchPagedAttention)(spec.cache.block_size, device)


def _build_rank(spec: RunnerSpec, rank: int) -> ModelRunner:
    """Rank `rank` of a tensor-parallel runner. Rank 0 starts the others first, so that all
    load their shards at once, and forms the group once every rank is ready. Decode CUDA
    graphs are not used with more than one rank."""
    from .tensor_parallel import GroupCollectives, TensorParallelGroup

    parallel = spec.parallel
    size = parallel.num_ranks
    ModelConfig.from_folder(Path(spec.model_path)).check_parallel(parallel.tensor_parallel_size,
                                                                   parallel.expert_parallel_size)
    shard = Shard(rank, size, replicated=parallel.tensor_parallel_size == 1,
                  experts=parallel.expert_parallel_size > 1)
    device = _rank_device(spec.runner.device, rank, size)
    load_stage(f"starting {size - 1} more ranks" if rank == 0 else f"rank {rank} starting")
    group = TensorParallelGroup(spec) if rank == 0 else None
    if device.type == "cuda":
        make_current(device)
    else:  # the cores shared between the ranks: a rank per core rather than T fighting over all
        threads = max(1, len(os.sched_getaffinity(0)) // size)
        if group is not None:
            group.take_threads(threads)  # given back when the group shuts down
        else:
            torch.set_num_threads(threads)
    collectives = GroupCollectives(rank, size, device)
    try:
        backend = linear_backend(device, getattr(torch, spec.runner.dtype), spec.runner.quantization, spec.runner.linear)
        layers = range(*spec.layer_range) if spec.layer_range else None
        load_stage(f"rank {rank} loading its shard of the weights")
        model = load_model(Path(spec.model_path), getattr(torch, spec.runner.dtype), device, layers,
                           shard, collectives)
        load_stage(f"rank {rank} preparing the projections' kernels")
        _prepare(model, spec, backend)
        attention = _attention(spec, device, model)
        load_stage(f"rank {rank} allocating its K/V pool and the runner's parts")
        runner = ModelRunner(model, spec.num_blocks, spec.cache.block_size, device, getattr(torch, spec.runner.dtype),
                             spec.runner.seed, spec.runner.keep_logits, attention, group,
                             grammars=grammar_compiler(spec) if rank == 0 else None,
                             loras=_lora_slots(spec, model, getattr(torch, spec.runner.dtype), device),
                             proposer=_proposer(spec, model, attention, backend, device) if rank == 0 else None,
                             pooling_type=spec.runner.pooling_type)
        if group is not None:
            load_stage("waiting for every rank to load, then forming the group")
            group.connect(collectives, spec.child_start_timeout_seconds)
    except BaseException:
        if group is not None:
            group.shutdown()
        raise
    return runner


def _rank_device(device: str, rank: int, size: int) -> torch.device:
    """Rank k on the k-th GPU from the instance's first (`cuda:N` or `cuda`); the CPU for all."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    first = base.index or 0
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if first + size > available:
        raise ConfigError(f"{size} ranks (tensor_parallel_size, expert_parallel_size) need GPUs "
                          f"cuda:{first}..cuda:{first + size - 1}, but this instance sees {available} GPU(s)")
    return torch.device("cuda", first + rank)
