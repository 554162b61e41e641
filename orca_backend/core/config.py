"""Engine options, with defaults, validated on construction; and the choices each option has.

The config names the modules it configures only by these strings: it imports none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError
from .speculative import SpeculativeConfig

POLICIES = ("paged", "reserve")  # K/V: blocks as tokens arrive, or ORCA's reservation of max_tokens
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
# elsewhere (runner/models/linear.py). Quantization "int8": int8 weights on the CPU (fbgemm).
LINEARS = ("auto", "onednn", "torch")
QUANTIZATIONS = ("none", "int8")
# Embeddings: a model with a pooling type also answers embedding requests, pooling its prompt's
# final hidden states (after the last norm): the last token's, or the mean over the prompt.
POOLING_TYPES = ("none", "last", "mean")
TENSORRT_RUNTIMES = ("tensorrt", "torch")
# Fields of EngineConfig that a served model's config.pbtxt does not set.
_NOT_A_PARAMETER = {"parameter": False}


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine is built from. `model=None` means the default model."""

    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    max_batch_size: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    kv_cache_tokens: int | None = None  # pool size in tokens; else from kv_cache_bytes
    kv_cache_bytes: int | None = None  # default DEFAULT_KV_CACHE_BYTES
    policy: str = "paged"
    batching: str = "iteration"
    enable_prefix_caching: bool = True  # full K/V blocks shared by content across requests
    max_model_len: int | None = None  # cap on the model's context
    seed: int = 0
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # longer prompts are refused untokenized
    keep_logits: bool = field(default=False, metadata=_NOT_A_PARAMETER)  # each iteration's logits (tests)
    executor: str = "inline"  # where the model runner lives: one of EXECUTORS
    pipeline_stages: int = 2  # with the "pipeline" or "stages" executor: stages, layers split evenly
    stage_transport: str = "bls"  # "stages": BLS calls per stage from this model, or one "ensemble" call,
    # or "grpc": stage i in the tritonserver at stage_urls' i-th host:port (empty: this one, over BLS)
    stage_urls: str = ""  # with "grpc": one gRPC URL per stage, comma-separated
    max_inflight: int | None = None  # iterations out at once; None: pipeline_stages for a pipeline, 2 with
    # async scheduling, else 1 (the ensemble transport runs one iteration at a time: Triton does not order
    # concurrent calls)
    # The host prepares iteration k+1 while k runs (a request scheduled again before its token is
    # back); None: on for one stage (inline, process), off for pipelines (their first stage does not sample)
    async_scheduling: bool | None = None
    iteration_timeout_seconds: int = 600  # a runner silent this long is treated as dead
    attention: str = "auto"  # "torch" (SDPA), "triton" (our kernel) or "auto"
    cuda_graphs: bool = True  # decode iterations replayed from CUDA graphs (kernel backend)
    engine: str = "torch"  # "torch": PyTorch layers; "tensorrt": a TensorRT engine with our attention plugin
    # "torch": evaluate the TensorRT engine's graph with torch instead of TensorRT (checks on the CPU)
    tensorrt_runtime: str = "tensorrt"
    engine_cache_dir: str | None = None  # built TensorRT engines; None: <cache>/engines
    null_step_seconds: float = 0.0  # engine "null": each iteration's stand-in for a forward
    # A request's structured_outputs grammar not compiled by then fails (it never holds up others).
    grammar_compile_timeout_seconds: float = 10.0
    # Ranks of the runner (and of each pipeline stage), each holding 1/T of every layer:
    # processes on the CPU (gloo), one GPU each from the instance's first (NCCL).
    tensor_parallel_size: int = 1
    linear: str = "auto"  # the projections' GEMM: one of LINEARS
    quantization: str = "none"  # "int8": weights quantized per channel, activations per token (CPU)
    # Multi-LoRA (vLLM's names): requests may name adapters (PEFT folders); at most max_loras distinct
    # ones among running requests (the device slots), max_cpu_loras kept in host memory (None: max_loras).
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    max_cpu_loras: int | None = None
    # Speculative decoding, vLLM's `speculative_config` (a mapping or its JSON text; "" or None: off):
    # {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
    #  "max_batch_size": 8} or {"method": "draft_model", "model": "/path/to/draft", ...}; read into a
    # SpeculativeConfig.
    speculative_config: str | dict | SpeculativeConfig | None = None
    # Priorities (a request's sampling parameter `priority`, lower first): a request ranks by
    # priority x this + the iteration it arrived in, so one arriving this many iterations later
    # than another of the next better priority ranks behind it (starvation's bound).
    priority_aging_iterations: int = 256
    # Embeddings (vLLM's pooler config): how an embedding request's prompt is pooled ("none": the
    # model refuses them), and whether the vector is scaled to length 1.
    pooling_type: str = "none"
    pooling_normalize: bool = True

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        _need(self.dtype in DTYPE_SIZES, "dtype", self.dtype, f"one of {', '.join(DTYPE_SIZES)}")
        _need(self.device == "cpu" or self.device.startswith("cuda"), "device", self.device,
              "'cpu' or 'cuda[:N]'")
        if self.device == "cpu" and self.dtype == "float16":
            raise ConfigError("dtype 'float16' is for GPUs; use 'float32' on cpu (or 'bfloat16' "
                              "where the processor has a bfloat16 GEMM)")
        _need(self.linear in LINEARS, "linear", self.linear, f"one of {', '.join(LINEARS)}")
        _need(self.quantization in QUANTIZATIONS, "quantization", self.quantization,
              f"one of {', '.join(QUANTIZATIONS)}")
        if self.quantization == "int8":
            _need(self.device == "cpu" and self.dtype == "float32" and self.engine == "torch",
                  "quantization", self.quantization, "'none' except on the CPU with dtype float32 "
                  "and engine 'torch' ('int8' is fbgemm's CPU GEMM)")
        one_stage = self.executor in ("inline", "process")
        if self.async_scheduling is None:
            self.async_scheduling = one_stage
        _need(isinstance(self.async_scheduling, bool), "async_scheduling", self.async_scheduling, "true or false")
        _need(one_stage or not self.async_scheduling, "async_scheduling", self.async_scheduling,
              "false with executor 'pipeline' or 'stages' (their first stage does not sample the tokens it "
              "would take as placeholders)")
        if self.max_inflight is None:
            pipelined = self.executor == "pipeline" or (self.executor == "stages" and self.stage_transport != "ensemble")
            self.max_inflight = self.pipeline_stages if pipelined else (2 if self.async_scheduling else 1)
        for name in ("max_batch_size", "max_num_batched_tokens", "block_size", "max_prompt_bytes",
                     "max_inflight", "iteration_timeout_seconds", "pipeline_stages", "tensor_parallel_size",
                     "max_lora_rank", "max_loras", "priority_aging_iterations"):
            value = getattr(self, name)
            _need(isinstance(value, int) and value >= 1, name, value, "an integer >= 1")
        _need(isinstance(self.enable_lora, bool), "enable_lora", self.enable_lora, "true or false")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        _need(isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras, "max_cpu_loras",
              self.max_cpu_loras, f"an integer >= max_loras ({self.max_loras})")
        if self.enable_lora:
            _need(self.engine != "tensorrt", "enable_lora", self.enable_lora,
                  "false with engine 'tensorrt' (its engines have no LoRA path; use engine 'torch')")
        _need(self.speculative_config is None or self.engine != "tensorrt", "speculative_config",
              self.speculative_config, "unset with engine 'tensorrt' (its profile has one logit row a request)")
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            _need(one_stage and self.engine == "torch", "speculative_config", self.speculative_config,
                  "method 'ngram' with engine 'null' or executor 'pipeline'/'stages' (the draft model runs "
                  "beside a whole model with engine 'torch', in the runner that samples)")
        for name in ("kv_cache_tokens", "kv_cache_bytes", "max_model_len"):
            value = getattr(self, name)
            _need(value is None or (isinstance(value, int) and value >= 1), name, value,
                  "unset or an integer >= 1")
        _need(self.policy in POLICIES, "policy", self.policy, f"one of {', '.join(POLICIES)}")
        _need(self.batching in BATCHING_MODES, "batching", self.batching,
              f"one of {', '.join(BATCHING_MODES)}")
        _need(self.attention in ATTENTION_BACKENDS, "attention", self.attention,
              f"one of {', '.join(ATTENTION_BACKENDS)}")
        _need(self.pooling_type in POOLING_TYPES, "pooling_type", self.pooling_type,
              f"one of {', '.join(POOLING_TYPES)}")
        _need(self.pooling_type == "none" or self.engine == "torch", "pooling_type", self.pooling_type,
              "'none' with engine 'tensorrt' or 'null' (embeddings need the model's hidden states)")
        for name in ("cuda_graphs", "enable_prefix_caching", "pooling_normalize"):
            _need(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")
        _need(self.executor in EXECUTORS, "executor", self.executor, f"one of {', '.join(EXECUTORS)}")
        _need(self.engine in ENGINES, "engine", self.engine, f"one of {', '.join(ENGINES)}")
        _need(isinstance(self.null_step_seconds, (int, float)) and 0 <= self.null_step_seconds <= 60,
              "null_step_seconds", self.null_step_seconds, "between 0 and 60")
        _need(isinstance(self.grammar_compile_timeout_seconds, (int, float)) and not isinstance(
            self.grammar_compile_timeout_seconds, bool) and 0 < self.grammar_compile_timeout_seconds <= 3600,
            "grammar_compile_timeout_seconds", self.grammar_compile_timeout_seconds, "in (0, 3600]")
        if self.engine == "null":
            _need(self.executor in ("inline", "process"), "executor", self.executor,
                  "'inline' or 'process' with engine 'null'")
            _need(self.tensor_parallel_size == 1, "tensor_parallel_size", self.tensor_parallel_size,
                  "1 with engine 'null'")
        _need(self.tensorrt_runtime in TENSORRT_RUNTIMES, "tensorrt_runtime", self.tensorrt_runtime,
              f"one of {', '.join(TENSORRT_RUNTIMES)}")
        if self.engine == "tensorrt":
            _need(self.executor in ("inline", "process"), "executor", self.executor,
                  "'inline' or 'process' with engine 'tensorrt' (it builds whole models, not stages)")
            _need(self.tensor_parallel_size == 1, "tensor_parallel_size", self.tensor_parallel_size,
                  "1 with engine 'tensorrt' (its engines are built for one rank)")
            _need(self.tensorrt_runtime == "torch" or self.device != "cpu", "device", self.device,
                  "a GPU ('cuda[:N]') with engine 'tensorrt' (tensorrt_runtime 'torch' evaluates "
                  "its graph on the CPU, for checks)")
        _need(self.stage_transport in STAGE_TRANSPORTS, "stage_transport", self.stage_transport,
              f"one of {', '.join(STAGE_TRANSPORTS)}")
        if self.executor == "stages" and self.stage_transport == "grpc":
            _need(len(self.stage_url_list) == self.pipeline_stages, "stage_urls", self.stage_urls,
                  f"{self.pipeline_stages} comma-separated gRPC URLs (host:port; empty: this server), "
                  f"one per stage, with stage_transport 'grpc'")

    @property
    def stage_url_list(self) -> list[str]:
        """Stage i's gRPC URL ("" for this server)."""
        return [url.strip() for url in self.stage_urls.split(",")] if self.stage_urls.strip() else []

    @property
    def attention_backend(self) -> str:
        """The backend "auto" stands for on this device."""
        if self.attention != "auto":
            return self.attention
        return "torch" if self.device == "cpu" else "triton"

    @property
    def draft_model_path(self) -> str:
        """Speculative decoding's draft checkpoint ("" without one)."""
        spec = self.speculative_config
        return spec.model if spec is not None and spec.method == "draft_model" else ""

    def num_kv_blocks(self, kv_elements_per_token: int) -> int:
        """Pool size in blocks from kv_cache_tokens, else from the byte budget."""
        tokens = self.kv_cache_tokens
        if tokens is None:
            bytes_per_token = kv_elements_per_token * DTYPE_SIZES[self.dtype]
            tokens = (self.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // bytes_per_token
        num_blocks = tokens // self.block_size
        if num_blocks < 1:
            raise ConfigError(f"the K/V pool holds {tokens} tokens, less than one block "
                              f"of block_size {self.block_size}")
        return num_blocks


def is_model_parameter(f) -> bool:
    """Whether an EngineConfig field is also a parameter of a served model's config.pbtxt."""
    return f.metadata.get("parameter", True)


def auto_device(instance_kind: str, device_id: int = 0) -> str:
    """The device "auto" means for a Triton model instance: its GPU (KIND_GPU), else the CPU."""
    return f"cuda:{device_id}" if instance_kind.upper() == "GPU" else "cpu"


def auto_dtype(device: str) -> str:
    """The dtype "auto" means on a device: bfloat16 on a GPU, float32 on the CPU."""
    return "float32" if device == "cpu" else "bfloat16"


def _need(ok: bool, name: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"engine option {name!r} must be {allowed}, got {value!r}")
