"""What the engine needs to know of a checkpoint, read from its config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")


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
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    activation: str = "silu"

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.exists():
            raise ConfigError(f"model folder {folder} has no config.json")
        raw = json.loads(path.read_text())
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {arch!r} in {path}; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        try:
            config = _gpt2(raw) if arch == "GPT2LMHeadModel" else _llama(raw, arch)
        except KeyError as e:
            raise ConfigError(f"{path} has no {e.args[0]!r}, which {arch} needs") from None
        config.eos_token_ids = _eos_ids(raw, Path(folder))
        return config

    def kv_elements_per_rank_token(self, tensor_parallel_size: int = 1) -> int:
        """K and V elements per token over all layers (multiply by the dtype's size) that each
        of T ranks holds: its K/V heads only."""
        return 2 * self.num_layers * self.num_local_kv_heads(tensor_parallel_size) * self.head_dim

    def num_local_kv_heads(self, tensor_parallel_size: int) -> int:
        """K/V heads each of T ranks holds: its share, or one (replicated) when there are
        fewer K/V heads than ranks."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> None:
        """Refuse a rank count that does not divide the shapes every rank takes 1/T of,
        naming both numbers."""
        t = tensor_parallel_size
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {t!r}")
        shapes = [("attention heads", self.num_heads), ("intermediate size", self.intermediate_size),
                  ("vocabulary size", self.vocab_size)]
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


def _llama(raw: dict, arch: str) -> ModelConfig:
    scaling = raw.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        raise ConfigError(f"rope_scaling {scaling!r} is not supported (only plain RoPE)")
    heads = raw["num_attention_heads"]
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act {act!r} is not supported for {arch} (only silu)")
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"],
        max_model_len=raw.get("max_position_embeddings", 2048),
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        rope_theta=(raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta", 10000.0)),
        qkv_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
    )


def _gpt2(raw: dict) -> ModelConfig:
    if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("reorder_and_upcast_attn"):
        raise ConfigError("GPT-2 options scale_attn_by_inverse_layer_idx and "
                          "reorder_and_upcast_attn are not supported")
    act = raw.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ConfigError(f"activation_function {act!r} is not supported for GPT-2")
    hidden, heads = raw["n_embd"], raw["n_head"]
    return ModelConfig(
        architecture="GPT2LMHeadModel",
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=raw.get("n_inner") or 4 * hidden,
        max_model_len=raw.get("n_positions", 1024),
        norm_eps=raw.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        activation=act,
    )


def _eos_ids(raw: dict, folder: Path) -> list[int]:
    ids: set[int] = set()
    gen = folder / "generation_config.json"
    for source in (raw, json.loads(gen.read_text()) if gen.exists() else {}):
        eos = source.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(ids)
