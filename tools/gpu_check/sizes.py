"""The sizes of everything the sections run, at full scale and for the CPU dry run."""
from __future__ import annotations

from dataclasses import dataclass

LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, vocab_size=512, rope_theta=500000.0,
                  max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)
# (prompt tokens, max_tokens) of the parity prompts: one token, several blocks, one output.
PARITY_SHAPES = [(3, 16), (48, 8), (19, 24), (1, 12), (130, 6), (27, 18), (11, 2), (36, 14)]
SMOKE_PARITY_SHAPES = [(20, 2), (1, 3)]  # several blocks; one token


@dataclass(slots=True)
class Sizes:
    """Every size the sections use: full on a GPU, tiny for the CPU dry run."""

    dtypes: tuple[str, ...]
    heads: tuple[tuple[int, int, int], ...]  # (query heads, K/V heads, head_dim)
    num_requests: int  # per numerics batch
    max_context: int  # cached tokens before a decode or a prefill chunk, drawn up to this
    max_query: int  # prefill tokens, drawn up to this
    parity_shapes: list[tuple[int, int]]
    big_model: dict
    batch_sizes: tuple[int, ...]
    no_graph_batch_sizes: tuple[int, ...]
    prompt_tokens: int
    warmup_steps: int
    timed_steps: int
    trace_requests: int
    trace_max_output: int
    trace_batch_size: int
    prefill: tuple[int, int]  # (requests, tokens each) for kernel_vs_sdpa
    decode_requests: int
    decode_contexts: tuple[int, ...]
    attention_heads: tuple[int, int, int]
    reps: int
    pipeline_prompts: tuple[int, ...]  # prompt lengths of the pipeline section's requests
    pipeline_max_tokens: int  # greedy tokens each
    transfer_tokens: tuple[int, ...]  # rows of the hidden states timed per transfer and stage forward


FULL = Sizes(
    dtypes=("bfloat16", "float16", "float32"), heads=((32, 8, 128), (9, 3, 64)), num_requests=16,
    max_context=2048, max_query=512, parity_shapes=PARITY_SHAPES, big_model=LLAMA_8B,
    batch_sizes=(1, 16, 64, 256), no_graph_batch_sizes=(1, 16), prompt_tokens=128, warmup_steps=5,
    timed_steps=40, trace_requests=64, trace_max_output=128, trace_batch_size=16, prefill=(4, 1024),
    decode_requests=64, decode_contexts=(1024, 4096), attention_heads=(32, 8, 128), reps=30,
    pipeline_prompts=tuple(n for n, _ in PARITY_SHAPES), pipeline_max_tokens=32, transfer_tokens=(8, 64, 512))
SMOKE = Sizes(
    dtypes=("bfloat16", "float32"), heads=((9, 3, 64),), num_requests=3, max_context=40, max_query=20,
    parity_shapes=SMOKE_PARITY_SHAPES, big_model=TINY_LLAMA, batch_sizes=(1, 3), no_graph_batch_sizes=(1,),
    prompt_tokens=8, warmup_steps=1, timed_steps=2, trace_requests=4, trace_max_output=4,
    trace_batch_size=2, prefill=(2, 24), decode_requests=3, decode_contexts=(40,),
    attention_heads=(4, 2, 16), reps=2, pipeline_prompts=tuple(n for n, _ in SMOKE_PARITY_SHAPES),
    pipeline_max_tokens=2, transfer_tokens=(8, 32))
