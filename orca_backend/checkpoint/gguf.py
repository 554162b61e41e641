"""A GGUF file as a model: llama.cpp's single-file format, read as stored.

`gguf_folder(path)` gives the engine the folder it loads every model from, made once per
file in the cache: a config.json written from the file's metadata, the tokenizer and chat
template transformers builds from it, and a link to the file itself, whose tensors
`runner/models/gguf_tensors.py` hands out under the Hugging Face names (quantized ones stay
quantized). The architectures read are those whose GGUF layout maps onto a family
here: llama (Llama, Mistral, SmolLM), qwen2 and qwen3; others are refused by name.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..core.errors import ConfigError
from .cache_folder import made_once

LINK = "model.gguf"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Metadata that would change the math if ignored, and that no family here reads from GGUF.
_REFUSED_KEYS = ("rope.scaling.type", "rope.scaling.factor", "attention.sliding_window", "expert_count")


def is_gguf(path: Path) -> bool:
    """A .gguf file, or a folder holding one and no config.json."""
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and not (path / "config.json").exists() and any(path.glob("*.gguf"))


def gguf_folder(path: Path, cache: Path) -> Path:
    """The model folder of the GGUF file `path` (or of a folder's only .gguf file), made in
    `cache` on first use."""
    path = _the_file(Path(path).resolve())
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return made_once(cache / f"{path.stem}-{key}", lambda staging: _made_folder(path, staging))


def _made_folder(path: Path, staging: Path) -> None:
    (staging / LINK).symlink_to(path)
    _write_folder(path, staging)


def _the_file(path: Path) -> Path:
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf"))
    if len(files) != 1:
        raise ConfigError(f"model folder {path} holds {len(files)} .gguf files and no config.json; "
                          "give the file to load as the model")
    return files[0]


def _write_folder(path: Path, out: Path) -> None:
    import gguf
    from transformers import AutoTokenizer  # builds a `tokenizers` tokenizer from GGUF metadata

    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:  # Llama 3.1's scaled RoPE, as llama.cpp stores it
        raise ConfigError(f"{path}: tensor rope_freqs.weight (RoPE frequency factors) is not read by this engine")
    config = gguf_config(meta, names, str(path))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))
    config["bos_token_id"], config["eos_token_id"] = tok.bos_token_id, tok.eos_token_id
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}, indent=2))


def gguf_config(meta: dict, tensor_names: set[str], source: str) -> dict:
    """A Hugging Face config.json for the file's metadata; refuses what it cannot express."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: GGUF architecture {arch!r} is not read by this engine; it reads "
                          f"{', '.join(ARCHITECTURES)}")
    for key in _REFUSED_KEYS:
        if f"{arch}.{key}" in meta:
            raise ConfigError(f"{source}: GGUF metadata {arch}.{key} is not read by this engine")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"{source}: GGUF metadata has no {arch}.{key}")
        return value
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    config = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", get("rope.dimension_count", hidden // heads))),
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or 0) or None,
        "hidden_act": "silu", "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }
    if config["vocab_size"] is None:
        raise ConfigError(f"{source}: GGUF metadata has no {arch}.vocab_size")
    if arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=config["num_hidden_layers"])
    return config
