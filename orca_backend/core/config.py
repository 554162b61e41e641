"""Engine options, with defaults, validated on construction; and the choices each option has.

`EngineConfig` is made of parts, each checking its own options: `SchedulerConfig` (how
iterations are formed; the scheduler and the simulator take it as it is), `CacheConfig` (the
K/V pool), `ParallelConfig` (where the runner lives and how it is split) and `RunnerConfig`
(the model and how it runs). The config names the modules it configures only by these
strings: it imports none of them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from .errors import ConfigError
from .load_watch import LOAD_TIMEOUT_SECONDS
from .option_checks import need as _need, need_counts as _need_counts
from .option_checks import need_flags as _need_flags, need_one_of as _need_one_of
from .speculative import SpeculativeConfig

POLICIES = ("paged", "reserve")  # K/V: blocks as tokens arrive, or ORCA's reservation of max_tokens
# Whom a request short of K/V room preempts: the running request whose recompute wastes the least
# (its computed tokens not in the prefix cache, the worst priority first), or the newest admitted.
PREEMPTION_VICTIMS = ("least_waste", "newest")
# The order of the waiting queue: by priority with aging (FCFS within one), FCFS whatever the
# priorities (vLLM's "fcfs"), or by priority with aging and then by earliest first-token deadline.
SCHEDULING_POLICIES = ("priority", "fcfs", "deadline")
BATCHING_MODES = ("iteration", "request")
# Where the model runner lives: this process, a child process, stages in this process, or
# stages as Triton models (only inside tritonserver).
EXECUTORS = ("inline", "process", "pipeline", "stages")
STAGE_TRANSPORTS = ("bls", "ensemble", "grpc")
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element; torch's names
DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
# "auto": our kernel (trt_plugins) on a GPU, PyTorch SDPA on the CPU (where the kernel runs
# only under the Triton interpreter, for tests).
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# "null": no model work, a token per sampling row after null_step_seconds (the host path's benchmark)
ENGINES = ("torch", "tensorrt", "null")
# The projections' GEMM: "auto" is oneDNN with prepacked weights on the CPU, torch's own
# elsewhere (runner/models/linear.py). Quantization "int8": a full-precision checkpoint's
# projections quantized to int8 per output channel at load (torch's weight-only int8 GEMM, CPU).
LINEARS = ("auto", "onednn", "torch")
MOE_KERNELS = ("auto", "torch", "triton")
QUANTIZATIONS = ("none", "int8")
# Embeddings: a model with a pooling type also answers embedding requests, pooling its prompt's
# final hidden states (after the last norm): the last token's, or the mean over the prompt.
POOLING_TYPES = ("none", "last", "mean")
TENSORRT_RUNTIMES = ("tensorrt", "torch")
# Options that a served model's config.pbtxt does not set.
_NOT_A_PARAMETER = {"parameter": False}


@dataclass(slots=True)
class SchedulerConfig:
    """How iterations are formed. The scheduler, and the simulator, take it as it is."""

    max_batch_size: int = 32  # requests per iteration
    max_num_batched_tokens: int = 512
    policy: str = "paged"  # one of POLICIES
    batching: str = "iteration"  # one of BATCHING_MODES
    # Iterations submitted and not yet returned; None: 2 with async scheduling, else 1 (EngineConfig
    # makes it pipeline_stages for a pipeline, except over the ensemble transport, which runs one
    # iteration at a time: Triton does not order concurrent calls).
    max_inflight: int | None = None
    # A request in flight may be scheduled again, one step ahead, its next token a placeholder that
    # the runner which samples it fills in: the host prepares iteration k+1 while k runs. None: off
    # (EngineConfig turns it on for one stage, inline or process: a pipeline's first stage does not sample).
    async_scheduling: bool | None = None
    # Priorities (a request's sampling parameter `priority`, lower first): a request ranks by
    # priority x this + the iteration it arrived in, so one arriving this many iterations later
    # than another of the next better priority ranks behind it (starvation's bound).
    priority_aging_iterations: int = 256
    scheduling_policy: str = "priority"  # one of SCHEDULING_POLICIES
    preemption_victim: str = "least_waste"  # one of PREEMPTION_VICTIMS
    # Long prompts (vLLM's names; 0: off): a prompt of more than long_prefill_token_threshold tokens
    # prefills at most that many a step, and at most max_long_partial_prefills such prompts prefill at
    # once; the others wait, and short prompts behind them are admitted first.
    long_prefill_token_threshold: int = 0
    max_long_partial_prefills: int = 1
    # Multi-LoRA (vLLM's names): requests may name adapters (PEFT folders); at most max_loras
    # distinct ones among running requests (the device slots).
    enable_lora: bool = False
    max_loras: int = 1
    # Speculative decoding, vLLM's `speculative_config` (a mapping or its JSON text; "" or None: off):
    # {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
    #  "max_batch_size": 8} or {"method": "draft_model", "model": "/path/to/draft", ...}; read into a
    # SpeculativeConfig.
    speculative_config: str | dict | SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        _need_one_of(self, "policy", POLICIES)
        _need_one_of(self, "batching", BATCHING_MODES)
        _need_one_of(self, "preemption_victim", PREEMPTION_VICTIMS)
        _need_one_of(self, "scheduling_policy", SCHEDULING_POLICIES)
        _need(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
              self.long_prefill_token_threshold, "an integer >= 0 (0: off)")
        if self.async_scheduling is None:
            self.async_scheduling = False
        _need_flags(self, "async_scheduling", "enable_lora")
        if self.max_inflight is None:
            self.max_inflight = 2 if self.async_scheduling else 1
        _need_counts(self, "max_batch_size", "max_num_batched_tokens", "max_inflight", "priority_aging_iterations",
                     "max_loras", "max_long_partial_prefills")


@dataclass(slots=True)
class CacheConfig:
    """The K/V pool: its block size, its size, and whether full blocks are shared by content."""

    block_size: int = 16
    kv_cache_tokens: int | None = None  # pool size in tokens; else from kv_cache_bytes
    kv_cache_bytes: int | None = None  # each rank's; default DEFAULT_KV_CACHE_BYTES
    enable_prefix_caching: bool = True  # full K/V blocks shared by content across requests

    def __post_init__(self) -> None:
        _need_counts(self, "block_size")
        _need_counts(self, "kv_cache_tokens", "kv_cache_bytes", unset=True)
        _need_flags(self, "enable_prefix_caching")

    def num_kv_blocks(self, kv_bytes_per_token: int) -> int:
        """Pool size in blocks from kv_cache_tokens, else from the byte budget."""
        tokens = self.kv_cache_tokens
        if tokens is None:
            tokens = (self.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // kv_bytes_per_token
        num_blocks = tokens // self.block_size
        if num_blocks < 1:
            raise ConfigError(f"the K/V pool holds {tokens} tokens, less than one block "
                              f"of block_size {self.block_size}")
        return num_blocks


@dataclass(slots=True)
class ParallelConfig:
    """Where the model runner lives and how it is split: pipeline stages, tensor-parallel ranks."""

    executor: str = "inline"  # where the model runner lives: one of EXECUTORS
    pipeline_stages: int = 2  # with the "pipeline" or "stages" executor: stages, layers split evenly
    stage_transport: str = "bls"  # "stages": BLS calls per stage from this model, or one "ensemble" call,
    # or "grpc": stage i in the tritonserver at stage_urls' i-th host:port (empty: this one, over BLS)
    stage_urls: str = ""  # with "grpc": one gRPC URL per stage, comma-separated
    # Ranks of the runner (and of each pipeline stage), each holding 1/T of every layer:
    # processes on the CPU (gloo), one GPU each from the instance's first (NCCL).
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1  # ranks splitting MoE experts, whole (attention: over T = E ranks, or T = 1)
    iteration_timeout_seconds: int = 600  # a runner silent this long is treated as dead

    def __post_init__(self) -> None:
        _need_one_of(self, "executor", EXECUTORS)
        _need_one_of(self, "stage_transport", STAGE_TRANSPORTS)
        _need_counts(self, "pipeline_stages", "tensor_parallel_size", "expert_parallel_size",
                     "iteration_timeout_seconds")
        e, t = self.expert_parallel_size, self.tensor_parallel_size
        _need(e == 1 or t in (1, e), "tensor_parallel_size", t, f"1 or {e} with expert_parallel_size {e} (attention "
              "replicated on every rank, or split over the same ranks as the experts)")
        _need(e == 1 or self.executor in ("inline", "process", "pipeline"), "executor", self.executor,
              "'inline', 'process' or 'pipeline' with expert_parallel_size > 1")
        if self.executor == "stages" and self.stage_transport == "grpc":
            _need(len(self.stage_url_list) == self.pipeline_stages, "stage_urls", self.stage_urls,
                  f"{self.pipeline_stages} comma-separated gRPC URLs (host:port; empty: this server), "
                  f"one per stage, with stage_transport 'grpc'")

    @property
    def num_ranks(self) -> int:
        """Processes of the runner (of each pipeline stage): tensor- or expert-parallel ranks."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    @property
    def one_stage(self) -> bool:
        """The whole model in one runner (which samples)."""
        return self.executor in ("inline", "process")

    @property
    def pipelined(self) -> bool:
        """Stages that take iterations one behind another."""
        return self.executor == "pipeline" or (self.executor == "stages" and self.stage_transport != "ensemble")

    @property
    def stage_url_list(self) -> list[str]:
        """Stage i's gRPC URL ("" for this server)."""
        return [url.strip() for url in self.stage_urls.split(",")] if self.stage_urls.strip() else []


@dataclass(slots=True)
class RunnerConfig:
    """The model and how it runs (checkpoint, dtype, device, kernels, engine, adapters in host
    memory, pooling), and what a request to it may be."""

    model: str | None = None  # None: the default model
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # cap on the model's context
    seed: int = 0
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # longer prompts are refused untokenized
    keep_logits: bool = field(default=False, metadata=_NOT_A_PARAMETER)  # each iteration's logits (tests)
    attention: str = "auto"  # "torch" (SDPA), "triton" (our kernel) or "auto"
    cuda_graphs: bool = True  # decode iterations replayed from CUDA graphs (kernel backend)
    engine: str = "torch"  # "torch": PyTorch layers; "tensorrt": a TensorRT engine with our attention plugin
    # "torch": evaluate the TensorRT engine's graph with torch instead of TensorRT (checks on the CPU)
    tensorrt_runtime: str = "tensorrt"
    engine_cache_dir: str | None = None  # built TensorRT engines; None: <cache>/engines
    null_step_seconds: float = 0.0  # engine "null": each iteration's stand-in for a forward
    # A request's structured_outputs grammar not compiled by then fails (it never holds up others).
    grammar_compile_timeout_seconds: float = 10.0
    # A stage of the model's load (folder, weights, K/V pool, runner processes, ranks) still running
    # after this fails the load, naming the stage, with every thread's stack (core/load_watch.py).
    load_timeout_seconds: float = LOAD_TIMEOUT_SECONDS
    linear: str = "auto"  # the projections' GEMM: one of LINEARS
    quantization: str = "none"  # "int8": weights quantized per output channel at load (CPU)
    moe_kernel: str = "auto"  # a mixture of experts' grouped GEMM: one of MOE_KERNELS
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # LoRA adapters kept in host memory; None: max_loras
    # Embeddings (vLLM's pooler config): how an embedding request's prompt is pooled ("none": the
    # model refuses them), and whether the vector is scaled to length 1.
    pooling_type: str = "none"
    pooling_normalize: bool = True
    # Batch-invariant numerics (docs/deterministic.md): a request's logprobs the same bits whatever
    # else is in its iterations, however its prompt was chunked or cached. None: VLLM_BATCH_INVARIANT=1.
    deterministic: bool | None = None

    def __post_init__(self) -> None:
        _need_one_of(self, "dtype", DTYPE_SIZES)
        _need(self.device == "cpu" or self.device.startswith("cuda"), "device", self.device,
              "'cpu' or 'cuda[:N]'")
        if self.device == "cpu" and self.dtype == "float16":
            raise ConfigError("dtype 'float16' is for GPUs; use 'float32' on cpu (or 'bfloat16' "
                              "where the processor has a bfloat16 GEMM)")
        _need_one_of(self, "linear", LINEARS)
        _need_one_of(self, "quantization", QUANTIZATIONS)
        if self.quantization == "int8":
            _need(self.device == "cpu" and self.engine == "torch", "quantization", self.quantization,
                  "'none' except on the CPU with engine 'torch' ('int8' is torch's weight-only "
                  "int8 GEMM for the CPU)")
        _need_counts(self, "max_prompt_bytes", "max_lora_rank")
        _need_counts(self, "max_model_len", unset=True)
        _need_one_of(self, "attention", ATTENTION_BACKENDS)
        _need_one_of(self, "moe_kernel", MOE_KERNELS)
        _need_one_of(self, "pooling_type", POOLING_TYPES)
        _need(self.pooling_type == "none" or self.engine == "torch", "pooling_type", self.pooling_type,
              "'none' with engine 'tensorrt' or 'null' (embeddings need the model's hidden states)")
        if self.deterministic is None:
            self.deterministic = os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1"
        _need_flags(self, "cuda_graphs", "pooling_normalize", "deterministic")
        if self.deterministic:
            _need(self.device == "cpu" and self.engine == "torch" and self.attention in ("auto", "torch")
                  and self.linear != "torch" and self.quantization == "none", "deterministic", True,
                  "false except on the CPU with engine 'torch', attention 'torch' or 'auto', linear "
                  "'onednn' or 'auto' and quantization 'none' (the kernels shown batch-invariant so far)")
        _need_one_of(self, "engine", ENGINES)
        _need(isinstance(self.null_step_seconds, (int, float)) and 0 <= self.null_step_seconds <= 60,
              "null_step_seconds", self.null_step_seconds, "between 0 and 60")
        _need(isinstance(self.grammar_compile_timeout_seconds, (int, float)) and not isinstance(
            self.grammar_compile_timeout_seconds, bool) and 0 < self.grammar_compile_timeout_seconds <= 3600,
            "grammar_compile_timeout_seconds", self.grammar_compile_timeout_seconds, "in (0, 3600]")
        _need(isinstance(self.load_timeout_seconds, (int, float)) and not isinstance(self.load_timeout_seconds, bool)
              and 0 < self.load_timeout_seconds < float("inf"), "load_timeout_seconds", self.load_timeout_seconds,
              "a number of seconds > 0")
        _need_one_of(self, "tensorrt_runtime", TENSORRT_RUNTIMES)
        if self.engine == "tensorrt":
            _need(self.tensorrt_runtime == "torch" or self.device != "cpu", "device", self.device,
                  "a GPU ('cuda[:N]') with engine 'tensorrt' (tensorrt_runtime 'torch' evaluates "
                  "its graph on the CPU, for checks)")

    @property
    def moe_kernel_backend(self) -> str:
        """The experts' kernel "auto" stands for: torch's grouped GEMM on the CPU, ours on GPUs."""
        return self.moe_kernel if self.moe_kernel != "auto" else "torch" if self.device == "cpu" else "triton"

    @property
    def attention_backend(self) -> str:
        """The backend "auto" stands for on this device."""
        return self.attention if self.attention != "auto" else "torch" if self.device == "cpu" else "triton"


# EngineConfig's parts by attribute, and the part each option belongs to.
PARTS = {"scheduler": SchedulerConfig, "cache": CacheConfig, "parallel": ParallelConfig, "runner": RunnerConfig}
_PART_OF = {f.name: part for part, cls in PARTS.items() for f in fields(cls)}


@dataclass(slots=True, init=False)
class EngineConfig:
    """Everything an engine is built from, in parts. It takes the options by name, as `LLM(...)`
    and config.pbtxt give them (`EngineConfig(max_batch_size=8, executor="process")`): each goes
    to its part, which checks it; then the rules that join parts are checked here."""

    scheduler: SchedulerConfig
    cache: CacheConfig
    parallel: ParallelConfig
    runner: RunnerConfig

    def __init__(self, **options) -> None:
        by_part = {part: {} for part in PARTS}
        if "enable_deterministic_inference" in options:  # SGLang's name
            options["deterministic"] = options.pop("enable_deterministic_inference")
        for name, value in options.items():
            if name not in _PART_OF:
                raise TypeError(f"EngineConfig() got an unexpected keyword argument {name!r}")
            by_part[_PART_OF[name]][name] = value
        self.parallel = ParallelConfig(**by_part["parallel"])
        self.runner = RunnerConfig(**by_part["runner"])
        self.cache = CacheConfig(**by_part["cache"])
        self.scheduler = SchedulerConfig(**self._layout_defaults(by_part["scheduler"]))
        self._check_across_parts()

    def _layout_defaults(self, options: dict) -> dict:
        """The scheduler's options, its unset in-flight ones as this layout wants them."""
        if options.get("async_scheduling") is None:
            options["async_scheduling"] = self.parallel.one_stage
        if options.get("max_inflight") is None and self.parallel.pipelined:
            options["max_inflight"] = self.parallel.pipeline_stages
        return options

    def _check_across_parts(self) -> None:
        scheduler, parallel, runner = self.scheduler, self.parallel, self.runner
        _need(parallel.one_stage or not scheduler.async_scheduling, "async_scheduling", scheduler.async_scheduling,
              "false with executor 'pipeline' or 'stages' (their first stage does not sample the tokens it "
              "would take as placeholders)")
        if runner.max_cpu_loras is None:
            runner.max_cpu_loras = scheduler.max_loras
        _need(isinstance(runner.max_cpu_loras, int) and runner.max_cpu_loras >= scheduler.max_loras,
              "max_cpu_loras", runner.max_cpu_loras, f"an integer >= max_loras ({scheduler.max_loras})")
        if scheduler.enable_lora:
            _need(runner.engine != "tensorrt", "enable_lora", scheduler.enable_lora,
                  "false with engine 'tensorrt' (its engines have no LoRA path; use engine 'torch')")
        spec = scheduler.speculative_config
        _need(spec is None or runner.engine != "tensorrt", "speculative_config", spec,
              "unset with engine 'tensorrt' (its profile has one logit row a request)")
        if spec is not None and spec.method == "draft_model":
            _need(parallel.one_stage and runner.engine == "torch", "speculative_config", spec,
                  "method 'ngram' with engine 'null' or executor 'pipeline'/'stages' (the draft model runs "
                  "beside a whole model with engine 'torch', in the runner that samples)")
        if runner.engine == "null":
            _need(parallel.one_stage, "executor", parallel.executor, "'inline' or 'process' with engine 'null'")
            _need(parallel.tensor_parallel_size == 1, "tensor_parallel_size", parallel.tensor_parallel_size,
                  "1 with engine 'null'")
        if runner.engine == "tensorrt":
            _need(parallel.one_stage, "executor", parallel.executor,
                  "'inline' or 'process' with engine 'tensorrt' (it builds whole models, not stages)")
            _need(parallel.tensor_parallel_size == 1, "tensor_parallel_size", parallel.tensor_parallel_size,
                  "1 with engine 'tensorrt' (its engines are built for one rank)")

    def options(self) -> dict:
        """Every option's value by name, as the parts hold it (unset ones worked out)."""
        return {name: getattr(getattr(self, part), name) for name, part in _PART_OF.items()}

    @property
    def draft_model_path(self) -> str:
        """Speculative decoding's draft checkpoint ("" without one)."""
        spec = self.scheduler.speculative_config
        return spec.model if spec is not None and spec.method == "draft_model" else ""


def is_model_parameter(f) -> bool:
    """Whether an option (a field of a part) is also a parameter of a served model's config.pbtxt."""
    return f.metadata.get("parameter", True)


def auto_device(instance_kind: str, device_id: int = 0) -> str:
    """The device "auto" means for a Triton model instance: its GPU (KIND_GPU), else the CPU."""
    return f"cuda:{device_id}" if instance_kind.upper() == "GPU" else "cpu"


def auto_dtype(device: str) -> str:
    """The dtype "auto" means on a device: bfloat16 on a GPU, float32 on the CPU."""
    return "float32" if device == "cpu" else "bfloat16"
