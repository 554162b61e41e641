"""What the engine needs to know of a checkpoint, read from its config.json.

`ModelConfig` describes the math of every supported family with the same fields (norm kind
and placement, RoPE per layer type, sliding windows, soft caps, multipliers); the family's
parser in `families/` fills them from the checkpoint's own field names.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import ConfigError
from .families import PARSERS, SUPPORTED_ARCHITECTURES, ConfigFields
from .families.deepseek import MLASpec
from .families.experts import MoESpec
from .families.rope import RopeSpec
from .quant_formats import parse_quantization

__all__ = ["ModelConfig", "MoESpec", "RopeSpec", "SUPPORTED_ARCHITECTURES"]


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_model_len: int
    norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: list[int] = field(default_factory=list)
    family: str = "llama"
    rope_theta: float = 10000.0  # where `ropes` is empty: plain RoPE over the whole head
    ropes: dict[str, RopeSpec] = field(default_factory=dict)  # by layer type
    layer_types: tuple[str, ...] = ()  # "full_attention" or "sliding_attention" per layer; () all full
    sliding_window: int | None = None  # tokens a sliding layer's query sees, itself included
    no_rope_layers: tuple[int, ...] = ()  # layers that skip RoPE (SmolLM3)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"  # silu, gelu_tanh or gelu
    gated_mlp: bool = True  # down(act(gate) * up); False: GPT-2's down(act(fc))
    norm: str = "rms"  # rms, rms_unit_offset (Gemma's 1 + w), rms_fp32_weight (OLMo 2), layer
    norm_layout: str = "pre"  # pre, sandwich (Gemma 2/3: also after each branch), post (OLMo 2)
    qk_norm: str = "none"  # none, head (each head, Qwen3 / Gemma 3) or all (all heads at once, OLMo 2)
    positions: str = "rope"  # rope, or learned (GPT-2's table)
    fused_projections: bool = False  # the checkpoint's own modules are qkv_proj and gate_up_proj (Phi-3)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    attention_sinks: bool = False  # a learnt logit per head in every softmax, its share dropped (gpt-oss)
    final_softcap: float | None = None
    logits_divisor: float = 1.0
    moe: MoESpec | None = None  # the mixture of experts of its sparse layers; None: every MLP dense
    mla: MLASpec | None = None  # multi-head latent attention (DeepSeek); None: q/k/v heads
    extra_layers: int = 0  # layers a checkpoint may hold after the last that the model does not run (MTP)
    unknown_fields: tuple[str, ...] = ()  # in config.json, not the family's: logged when the weights load

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.exists():
            raise ConfigError(f"model folder {folder} has no config.json")
        raw = json.loads(path.read_text())
        arch = (raw.get("architectures") or ["?"])[0]
        parse = PARSERS.get(arch)
        if parse is None:
            raise ConfigError(f"unsupported architecture {arch!r} in {path}; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if raw.get("quantization_config") is not None:  # read by the weights; refused here if not readable
            parse_quantization(raw["quantization_config"], str(path))
        if raw.get("is_encoder_decoder"):
            raise ConfigError(f"{path}: is_encoder_decoder is set; this engine serves decoder-only models")
        fields = ConfigFields(raw, arch, str(path))
        fields.no_math("is_encoder_decoder", "quantization_config", "eos_token_id")  # checked here
        config = cls(**parse(fields))
        config.unknown_fields = fields.unknown()
        config.eos_token_ids = _eos_ids(raw, Path(folder))
        return config

    # -- layers ---------------------------------------------------------------------------
    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else "full_attention"

    def window_of(self, layer: int) -> int | None:
        """The layer's sliding window in tokens, or None (full attention)."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def rope_of(self, layer: int) -> RopeSpec | None:
        """The layer's rotary embedding; None where it has none (learned positions, NoPE layers)."""
        if self.positions != "rope" or layer in self.no_rope_layers:
            return None
        return self.ropes.get(self.layer_type(layer)) or RopeSpec(theta=self.rope_theta, rotary_dim=self.head_dim,
                                                                  max_len=self.max_model_len)

    @property
    def kv_window(self) -> int | None:
        """The window when every layer slides over the same one (K/V blocks that leave it can
        be freed); None when any layer attends to the whole context."""
        windows = {self.window_of(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def kernel_gap(self) -> str | None:
        """What of this model's attention our paged-attention kernel does not compute, named;
        None if it computes all of it (SDPA's backend computes every model's)."""
        return "latent attention (MLA)" if self.mla is not None else None

    @property
    def scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        return self.attention_scale if self.attention_scale is not None else self.head_dim ** -0.5

    def is_sparse(self, layer: int) -> bool:
        """Whether the layer's MLP is a mixture of experts."""
        return self.moe is not None and self.moe.is_sparse(layer)

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """[out, in] of each projection of one layer, by the checkpoint's module names (those
        a LoRA adapter targets)."""
        h, q, kv, i = (self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                       self.intermediate_size)
        if self.mla is not None:
            return {**self.mla.projection_shapes(h, self.num_heads), "gate_proj": (i, h), "up_proj": (i, h),
                    "down_proj": (h, i)}
        if self.fused_projections:
            return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * i, h), "down_proj": (h, i)}
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    # -- tensor parallelism ---------------------------------------------------------------
    def kv_elements_per_rank_token(self, tensor_parallel_size: int = 1) -> int:
        """K and V elements per token over all layers (multiply by the dtype's size) that each
        of T ranks holds: its K/V heads only (MLA: the whole latent, on every rank)."""
        heads, dim, values = self.kv_layout(tensor_parallel_size)
        return (2 if values else 1) * self.num_layers * heads * dim

    def kv_layout(self, tensor_parallel_size: int = 1) -> tuple[int, int, bool]:
        """(heads, dims per head, whether V is stored apart from K) of one layer's cache entry
        per token on each of T ranks. MLA stores one latent per token; its first kv_lora_rank
        dims serve as the values."""
        if self.mla is not None:
            return 1, self.mla.latent_dim, False
        return self.num_local_kv_heads(tensor_parallel_size), self.head_dim, True

    def num_local_kv_heads(self, tensor_parallel_size: int) -> int:
        """K/V heads each of T ranks holds: its share, or one (replicated) when there are
        fewer K/V heads than ranks."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def check_parallel(self, tensor_parallel_size: int, expert_parallel_size: int = 1) -> None:
        """`check_tensor_parallel`, and that E ranks can split the experts of every MoE layer."""
        e = expert_parallel_size
        self.check_tensor_parallel(tensor_parallel_size, experts_split=e == 1)
        if e > 1 and self.moe is None:
            raise ConfigError(f"expert_parallel_size {e}: {self.architecture} has no mixture of experts to split")
        if e > 1 and self.moe.num_experts % e:
            raise ConfigError(f"expert_parallel_size {e} does not divide the model's {self.moe.num_experts} experts")
        if e > 1 and self.moe.shared_size % e:  # the shared expert is split over every rank
            raise ConfigError(f"expert_parallel_size {e} does not divide the model's shared expert's intermediate "
                              f"size {self.moe.shared_size}")

    def check_tensor_parallel(self, tensor_parallel_size: int, experts_split: bool = True) -> None:
        """Refuse a rank count that does not divide the shapes every rank takes 1/T of,
        naming both numbers."""
        t = tensor_parallel_size
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {t!r}")
        if t > 1 and self.qk_norm == "all":
            raise ConfigError(f"tensor_parallel_size {t}: {self.architecture} normalizes all query heads "
                              "together (and all key heads), which ranks holding a share of the heads cannot")
        shapes = [("attention heads", self.num_heads), ("intermediate size", self.intermediate_size),
                  ("vocabulary size", self.vocab_size)]
        if self.moe is not None and experts_split:  # each expert split as a dense MLP is (not whole, as under EP)
            shapes += [("experts' intermediate size", self.moe.intermediate_size),
                       ("shared expert's intermediate size", self.moe.shared_size)]
        if self.num_kv_heads >= t:
            shapes.append(("key/value heads", self.num_kv_heads))
        elif t % self.num_kv_heads:  # replicated: each K/V head on T / Hkv ranks
            raise ConfigError(f"tensor_parallel_size {t} is not a multiple of the model's "
                              f"{self.num_kv_heads} key/value heads (with fewer K/V heads than "
                              f"ranks, each is replicated on an equal number of ranks)")
        for what, size in shapes:
            if size % t:
                raise ConfigError(f"tensor_parallel_size {t} does not divide the model's {what} "
                                  f"{size}")


def _eos_ids(raw: dict, folder: Path) -> list[int]:
    ids: set[int] = set()
    gen = folder / "generation_config.json"
    for source in (raw, json.loads(gen.read_text()) if gen.exists() else {}):
        eos = source.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(ids)
