"""The time an iteration takes, from a model's shapes and a machine's peaks.

Each operator of a layer costs the larger of its FLOPs over the compute a device reaches
and its bytes (weights, K/V read and written, activations in and out) over the bandwidth it
reaches. Tensor parallelism divides every operator's work by the ranks and adds two ring
all-reduces of the hidden states per layer; pipeline stages each run their share of the
layers and hand the hidden states to the next stage. A per-iteration overhead, fixed and per
request, covers the host. The numbers are per device: all ranks of a stage do the same work at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..checkpoint.config import ModelConfig
from ..core.errors import ConfigError
from .hardware import Hardware

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class Rows:
    """One request's share of an iteration: `num_scheduled_tokens` new tokens after
    `num_computed_tokens` whose K/V is cached."""

    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(frozen=True, slots=True)
class OpCost:
    flops: float
    bytes: float

    def seconds(self, hw: Hardware) -> float:
        return max(self.flops / (hw.peak_flops * hw.compute_efficiency),
                   self.bytes / (hw.memory_bandwidth * hw.bandwidth_efficiency))


@dataclass(frozen=True, slots=True)
class Layout:
    tensor_parallel_size: int = 1
    pipeline_stages: int = 1

    @property
    def num_devices(self) -> int:
        return self.tensor_parallel_size * self.pipeline_stages


class CostModel:
    def __init__(self, model: ModelConfig, hardware: Hardware, layout: Layout = Layout(),
                 dtype: str = "bfloat16") -> None:
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        model.check_tensor_parallel(layout.tensor_parallel_size)
        unmodelled = [what for has, what in ((model.moe, "a mixture of experts"), (model.mla, "latent attention"),
                                            (model.attention_sinks, "attention sinks")) if has]
        if unmodelled:
            raise ConfigError(f"the cost model has dense layers and per-head K/V only: {model.architecture} has "
                              f"{' and '.join(unmodelled)}, which it does not model")
        if not 1 <= layout.pipeline_stages <= model.num_layers:
            raise ConfigError(f"pipeline_stages must be in [1, {model.num_layers}] (the model's "
                              f"layers), got {layout.pipeline_stages}")
        self.model, self.hw, self.layout = model, hardware, layout
        self.dtype_bytes = DTYPE_BYTES[dtype]
        s, n = layout.pipeline_stages, model.num_layers
        self.stage_layers = [n // s + (i < n % s) for i in range(s)]  # earlier stages take the extra

    # -- per operator -----------------------------------------------------------------------
    def layer_ops(self, rows: list[Rows]) -> dict[str, OpCost]:
        """One layer on one rank, for an iteration of `rows`."""
        m, b, t = self.model, self.dtype_bytes, self.layout.tensor_parallel_size
        h, d = m.hidden_size, m.head_dim
        hq, hkv = m.num_heads / t, m.num_local_kv_heads(t)
        inter = m.intermediate_size / t
        tokens = sum(r.num_scheduled_tokens for r in rows)

        def gemm(num_in: float, num_out: float) -> OpCost:
            params = num_in * num_out
            return OpCost(2 * tokens * params, (params + tokens * (num_in + num_out)) * b)
        positions = sum(r.num_scheduled_tokens * r.num_computed_tokens
                        + r.num_scheduled_tokens * (r.num_scheduled_tokens + 1) / 2 for r in rows)
        kv_read = sum(r.num_computed_tokens + r.num_scheduled_tokens for r in rows)
        attention = OpCost(4 * hq * d * positions,  # q.k and p.v over every attended position
                           (2 * hkv * d * (kv_read + tokens) + 2 * hq * d * tokens) * b)
        gated = m.gated_mlp
        return {"qkv": gemm(h, (hq + 2 * hkv) * d), "attention": attention, "o": gemm(hq * d, h),
                "mlp_in": gemm(h, (2 if gated else 1) * inter), "mlp_out": gemm(inter, h)}

    def all_reduce_seconds(self, num_bytes: float) -> float:
        """A ring all-reduce over the tensor-parallel ranks (within a node when they fit)."""
        t = self.layout.tensor_parallel_size
        if t == 1:
            return 0.0
        bandwidth, latency = self._link(t <= self.hw.devices_per_node)
        return 2 * (t - 1) / t * num_bytes / bandwidth + 2 * (t - 1) * latency

    # -- per stage and iteration ------------------------------------------------------------
    def stage_seconds(self, stage: int, rows: list[Rows], num_sampled: int) -> float:
        """One stage's part of an iteration: its layers, its all-reduces, the LM head on the
        last stage, and the hand-off of the hidden states to the next stage."""
        m, hw, b = self.model, self.hw, self.dtype_bytes
        tokens = sum(r.num_scheduled_tokens for r in rows)
        if tokens == 0:
            return 0.0
        layer = sum(op.seconds(hw) for op in self.layer_ops(rows).values())
        layer += 2 * self.all_reduce_seconds(tokens * m.hidden_size * b)
        seconds = self.stage_layers[stage] * layer
        if stage == self.layout.pipeline_stages - 1:
            seconds += self.head(num_sampled).seconds(hw)
        else:
            bandwidth, latency = self._link(self._hop_within_node(stage))
            seconds += tokens * m.hidden_size * b / bandwidth + latency
        return seconds

    def head(self, num_sampled: int) -> OpCost:
        m, b = self.model, self.dtype_bytes
        params = m.hidden_size * m.vocab_size / self.layout.tensor_parallel_size
        return OpCost(2 * num_sampled * params, params * b + num_sampled * m.vocab_size * 4)

    def iteration_seconds(self, rows: list[Rows], num_sampled: int) -> float:
        """Every stage one after the other, plus the host's overhead: the latency of one
        iteration (with several in flight, stages overlap; the event loop models that)."""
        return self.host_seconds(len(rows)) + sum(
            self.stage_seconds(s, rows, num_sampled) for s in range(self.layout.pipeline_stages))

    def host_seconds(self, num_rows: int) -> float:
        """The host's part of an iteration of `num_rows` requests, before its first stage."""
        return self.hw.iteration_overhead_seconds + self.hw.row_overhead_seconds * num_rows

    # -- memory -------------------------------------------------------------------------------
    def weight_bytes_per_device(self) -> float:
        """The fullest stage's weights on one of its ranks (the first holds the embeddings,
        the last the LM head; an untied model holds both)."""
        m, b, t = self.model, self.dtype_bytes, self.layout.tensor_parallel_size
        h, d = m.hidden_size, m.head_dim
        layer = (h * (m.num_heads + 2 * m.num_kv_heads) * d + m.num_heads * d * h
                 + (3 if m.architecture != "GPT2LMHeadModel" else 2) * h * m.intermediate_size) / t
        table = m.vocab_size * h / t
        per_stage = [n * layer for n in self.stage_layers]
        per_stage[0] += table
        if not m.tie_word_embeddings or self.layout.pipeline_stages > 1:  # the head's own copy
            per_stage[-1] += table
        return max(per_stage) * b

    def kv_bytes_per_token(self) -> float:
        """One token's K/V on one rank of the stage with the most layers."""
        m = self.model
        return 2 * self.stage_layers[0] * m.num_local_kv_heads(self.layout.tensor_parallel_size) \
            * m.head_dim * self.dtype_bytes

    def kv_capacity_tokens(self) -> int:
        """Tokens of K/V that fit beside the weights; refuses a layout whose weights do not fit."""
        usable = self.hw.memory_bytes * self.hw.memory_utilization
        weights = self.weight_bytes_per_device()
        if weights >= usable:
            raise ConfigError(
                f"the model's weights do not fit: {weights / 2**30:.1f} GiB per device with tensor "
                f"parallelism {self.layout.tensor_parallel_size} and {self.layout.pipeline_stages} "
                f"pipeline stage(s), of {usable / 2**30:.1f} GiB usable on {self.hw.name}")
        return math.floor((usable - weights) / self.kv_bytes_per_token())

    def _link(self, within_node: bool) -> tuple[float, float]:
        hw = self.hw
        return ((hw.intra_node_bandwidth, hw.intra_node_latency) if within_node
                else (hw.inter_node_bandwidth, hw.inter_node_latency))

    def _hop_within_node(self, stage: int) -> bool:
        """Whether stage -> stage + 1 stays in one node: the last device of one and the first
        of the next (stages take consecutive devices)."""
        first_next = (stage + 1) * self.layout.tensor_parallel_size
        per_node = self.hw.devices_per_node
        return (first_next - 1) // per_node == first_next // per_node
