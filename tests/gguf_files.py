"""Tiny GGUF checkpoints for the tests, written with the `gguf` package: random weights in the
GGUF types under test (quantized by `gguf.quants.quantize`, or random blocks for the k-quants,
which it does not quantize), the default model's tokenizer metadata."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from orca_backend.checkpoint.store import default_gguf

# hidden 256: rows of whole 256-weight k-quant super-blocks; 4 heads of 64 (Qwen3: of 128,
# transformers' default head_dim, which its GGUF loader does not read), 2 K/V heads
SHAPE = dict(hidden=256, inter=512, layers=2, heads=4, kv_heads=2)
# A k-quant block's float16 scales: byte offsets, and a bound keeping weights near 0.1 (a
# weight is d times a 6- or 8-bit sub-block scale times the integer)
_SCALES = {"Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 5e-5), "Q6_K": ((-2,), 2e-5)}


def _tokenizer_fields():
    import gguf

    reader = gguf.GGUFReader(str(default_gguf()))
    return [f for name, f in reader.fields.items() if name.startswith("tokenizer.")], reader


def quantized_bytes(w: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """`w` in GGUF type `kind`: quantized by `gguf`, or for a k-quant random blocks of its shape
    (valid scales, random integers)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if kind not in _SCALES:
        return gguf.quants.quantize(w, qtype)
    size, block = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (w.shape[0], w.shape[1] // size, block), dtype=np.uint8)
    offsets, bound = _SCALES[kind]
    for offset in offsets:
        start = offset % block
        data[..., start:start + 2] = (rng.random(data.shape[:2] + (1,)) * bound).astype(np.float16).view(np.uint8)
    return data.reshape(w.shape[0], -1)


def write_gguf(path: Path, arch: str = "llama", kind: str = "Q4_0", embed_kind: str = "Q8_0",
               tied: bool = False, seed: int = 0, kinds: dict[str, str] | None = None) -> Path:
    """A 2-layer `arch` model (llama, qwen2 or qwen3) whose projections are `kind` (those
    named in `kinds`, e.g. attn_v, of the type given there) and whose embedding table is
    `embed_kind`."""
    import gguf

    fields, tok_reader = _tokenizer_fields()
    vocab = len(tok_reader.fields["tokenizer.ggml.tokens"].contents())
    s, rng = dict(SHAPE, head_dim=128 if arch == "qwen3" else 64), np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(s["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["inter"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_dimension_count(s["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    for f in fields:
        value = f.contents()
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, value, f.types[0], sub_type=sub)

    def add(name: str, shape: tuple[int, ...], tensor_kind: str, scale: float = 0.08):
        w = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) == 1 or tensor_kind == "F32":
            writer.add_tensor(name, (w + 1.0) if len(shape) == 1 else w)
        else:
            writer.add_tensor(name, quantized_bytes(w, tensor_kind, rng), raw_dtype=gguf.GGMLQuantizationType[tensor_kind])
    h, d = s["hidden"], s["head_dim"]
    add("token_embd.weight", (vocab, h), embed_kind, 0.25)  # logits of a real model's size
    if not tied:
        add("output.weight", (vocab, h), embed_kind)
    add("output_norm.weight", (h,), "F32")
    for i in range(s["layers"]):
        p = f"blk.{i}."
        for name, shape in (("attn_q", (s["heads"] * d, h)), ("attn_k", (s["kv_heads"] * d, h)),
                            ("attn_v", (s["kv_heads"] * d, h)), ("attn_output", (h, s["heads"] * d)),
                            ("ffn_gate", (s["inter"], h)), ("ffn_up", (s["inter"], h)),
                            ("ffn_down", (h, s["inter"]))):
            add(p + name + ".weight", shape, (kinds or {}).get(name, kind))
        add(p + "attn_norm.weight", (h,), "F32")
        add(p + "ffn_norm.weight", (h,), "F32")
        if arch == "qwen2":
            for name, rows in (("attn_q", s["heads"] * d), ("attn_k", s["kv_heads"] * d), ("attn_v", s["kv_heads"] * d)):
                add(p + name + ".bias", (rows,), "F32")
        if arch == "qwen3":
            add(p + "attn_q_norm.weight", (d,), "F32")
            add(p + "attn_k_norm.weight", (d,), "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
