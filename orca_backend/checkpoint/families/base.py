"""What the decoder families share when reading a config: the sizes, layer types and windows,
and RoPE. A family module calls `decoder(...)` with what differs and adds its own fields."""
from __future__ import annotations

from ...core.errors import ConfigError
from .fields import ConfigFields, activation
from .rope import read_ropes

LAYER_TYPES = ("full_attention", "sliding_attention")


def read_layer_types(f: ConfigFields, num_layers: int, legacy: list[str] | None = None) -> tuple[str, ...]:
    """`layer_types` (transformers 5 writes it), else `legacy`, the family's rule for older
    configs, else every layer full attention. A type we do not implement is refused."""
    types = f.get("layer_types") or legacy or ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ConfigError(f"{f.where}: layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"{f.where}: layer_types {', '.join(map(repr, unknown))} is not supported for "
                          f"{f.architecture} (supported: {', '.join(LAYER_TYPES)})")
    return tuple(types)


def read_window(f: ConfigFields, layer_types: tuple[str, ...], enabled: bool = True,
                default: int | None = None) -> int | None:
    """The sliding window in tokens (a query sees itself and the window - 1 tokens before it),
    or None when no layer slides; `enabled=False` reads the field and uses none (Qwen2's
    `use_sliding_window: false`)."""
    window = f.get("sliding_window", default)
    if not enabled or "sliding_attention" not in layer_types:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConfigError(f"{f.where}: sliding_window = {window!r}, but layers slide: it must be a positive "
                          "integer")
    return window


def decoder(f: ConfigFields, family: str, *, tie_default: bool = False, eps_default: float = 1e-6,
            max_len_default: int = 2048, head_dim_default: int | None = None, head_dim: int | None = None,
            layer_types: tuple[str, ...] | None = None,
            window: int | None = None, default_theta: float = 10000.0, per_layer_rope=None,
            act_field: str = "hidden_act", act_default: str = "silu", scaled_context: bool = True,
            original_max_default: int | None = None, **fields) -> dict:
    """The ModelConfig fields of a Llama-shaped decoder (`fields` override or add).
    `scaled_context=False`: max_position_embeddings is the context whatever the RoPE scaling
    (Gemma 3's already counts it); `original_max_default`: the pretraining length where the
    config names none (transformers' class default, Phi-3's); `head_dim`: the head size the
    family fixes (DeepSeek's rotary width), the config's own read and not used."""
    heads = f.require("num_attention_heads")
    hidden = f.require("hidden_size")
    num_layers = f.require("num_hidden_layers")
    configured = f.get("head_dim", head_dim_default)  # `head_dim`: the family's own, whatever the config says
    head_dim = head_dim or configured or hidden // heads
    max_len = f.get("max_position_embeddings", max_len_default)
    types = layer_types or ("full_attention",) * num_layers
    config = dict(
        architecture=f.architecture, family=family, vocab_size=f.require("vocab_size"), hidden_size=hidden,
        num_layers=num_layers, num_heads=heads, num_kv_heads=f.get("num_key_value_heads") or heads,
        head_dim=head_dim, intermediate_size=f.require("intermediate_size"), max_model_len=max_len,
        norm_eps=f.get("rms_norm_eps", eps_default), tie_word_embeddings=f.get("tie_word_embeddings", tie_default),
        layer_types=types, sliding_window=window,
        ropes=read_ropes(f, head_dim, max_len, types, default_theta, per_layer_rope, original_max_default),
        activation=activation(f, act_field, act_default),
    )
    config.update(fields)
    if scaled_context:
        config["max_model_len"] = max(_scaled_context(spec) for spec in config["ropes"].values())
    if config["num_heads"] % config["num_kv_heads"]:
        raise ConfigError(f"{f.where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                          f"{config['num_kv_heads']}")
    return config


def no_bidirectional(f: ConfigFields) -> None:
    f.refuse("use_bidirectional_attention", (None, False),
             "bidirectional attention is for encoders (embedding models); this server decodes causally")


def _scaled_context(spec) -> int:
    """The context a RoPE scaling is for, as vLLM derives it: max_position_embeddings times the
    factor for linear and dynamic scaling (whose configs keep the pretraining length there),
    the pretraining length times the factor for YaRN (Qwen2.5 keeps 32768 with factor 4);
    llama3 and longrope configs state the scaled length already."""
    if spec.kind in ("linear", "dynamic"):
        return int(spec.max_len * spec.factor)
    if spec.kind == "yarn":
        return max(spec.max_len, int(spec.original_max_len * spec.factor))
    return spec.max_len
