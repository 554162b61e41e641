"""Tiny random checkpoints of every supported model family, made by transformers' own config
and model classes: what tests/test_models.py compares with transformers, what the models
benchmark times, and what the GPU check runs on the device."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
# id: (architecture, config fields over TINY). Together: every RoPE kind (default, linear,
# dynamic, yarn, llama3, longrope, partial rotary, a base per layer type), windows shorter than
# the prompts (all layers, alternating, from a layer on), GQA 1:1, 2:1 and 4:1, head_dim other
# than hidden / heads, tied and untied embeddings, fused projections, and each family's own norms,
# caps and multipliers.
FAMILIES = {
    "llama-3.1": ("LlamaForCausalLM", dict(rope_theta=500.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama-linear-bias": ("LlamaForCausalLM", dict(head_dim=32, attention_bias=True, mlp_bias=True,
                                                   tie_word_embeddings=True, rope_scaling=dict(rope_type="linear", factor=2.0))),
    "llama-dynamic": ("LlamaForCausalLM", dict(max_position_embeddings=24, rope_scaling=dict(rope_type="dynamic", factor=3.0))),
    "qwen2-yarn": ("Qwen2ForCausalLM", dict(rope_theta=1000.0, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    "qwen2-window": ("Qwen2ForCausalLM", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=8,
                                              max_window_layers=1, tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", dict(num_attention_heads=8, head_dim=32)),
    "mistral": ("MistralForCausalLM", dict(sliding_window=8, head_dim=16)),
    "ministral": ("MinistralForCausalLM", dict(num_hidden_layers=3, sliding_window=8, head_dim=16,
                                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma": ("GemmaForCausalLM", dict(head_dim=16, num_key_value_heads=4)),
    "gemma2": ("Gemma2ForCausalLM", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(head_dim=16, num_hidden_layers=3, sliding_window=8, sliding_window_pattern=2,
                                         rope_scaling=dict(rope_type="linear", factor=2.0))),
    "phi3": ("Phi3ForCausalLM", dict(hidden_size=96, partial_rotary_factor=0.5)),
    "phi3-longrope": ("Phi3ForCausalLM", dict(original_max_position_embeddings=32, rope_scaling=dict(
        type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)], long_factor=[2.0 + 0.2 * i for i in range(8)]))),
    "granite": ("GraniteForCausalLM", dict(embedding_multiplier=2.0, residual_multiplier=0.5,
                                           attention_multiplier=0.2, logits_scaling=3.0)),
    "smollm3": ("SmolLM3ForCausalLM", dict(num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True,
                                           sliding_window=8)),
    "olmo2": ("Olmo2ForCausalLM", dict()),
    # Mixtures of experts: top-1, 2 and 4; experts that a batch leaves idle; dense layers among
    # sparse ones (mlp_only_layers, decoder_sparse_step); a gated shared expert.
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=64)),
    "qwen2-moe": ("Qwen2MoeForCausalLM", dict(num_hidden_layers=3, num_experts=6, num_experts_per_tok=4,
                                              moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                              mlp_only_layers=[1])),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(num_hidden_layers=3, head_dim=16, num_experts=5, num_experts_per_tok=1,
                                              moe_intermediate_size=48, decoder_sparse_step=2)),
    "olmoe": ("OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                       norm_topk_prob=True)),
    # Attention sinks, alternating windowed and full layers, YaRN untruncated, top-k softmax
    # routing with a router bias, the clamped SwiGLU (a limit low enough to clamp) with biases.
    "gpt-oss": ("GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                                          sliding_window=8, swiglu_limit=0.5, rope_theta=1000.0, rope_scaling=dict(
                                              rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                              beta_fast=32.0, beta_slow=1.0, truncate=False))),
    # Latent attention (MLA): queries through a low rank or not, the first layer dense, routing
    # greedy or grouped (V2's max, V3's top-2 sum after the correction bias), shared experts.
    "deepseek-v2": ("DeepseekV2ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=3, topk_group=2,
        routed_scaling_factor=1.5)),
    "deepseek-v3": ("DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=2,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0))),
}
# (prompt length, max_tokens): longer than the windows (8), past the pretraining lengths of the
# scaled RoPEs (32, and 24 for dynamic), some longer than the token budget of 16.
SHAPES = [(5, 12), (40, 8), (17, 12), (1, 8), (33, 10)]


def save_family(kind: str, folder: Path, tokenizer_json: Path | None, **overrides) -> Path:
    """The `FAMILIES[kind]` checkpoint (biases and norm weights perturbed, routers' correction
    biases and experts' stacked biases too, so that a dropped one shows) in `folder`, with a copy of `tokenizer_json`
    (None: the caller writes one)."""
    import transformers as tf

    arch, fields = FAMILIES[kind]
    model_class = getattr(tf, arch)
    config = model_class.config_class(**{**TINY, **fields, **overrides})
    config.architectures = [arch]
    torch.manual_seed(0)
    model = model_class(config).float()
    with torch.no_grad():
        biases = [b for name, b in model.named_buffers() if name.endswith("correction_bias")]  # DeepSeek-V3's
        stacked = [p for name, p in model.named_parameters() if name.endswith("_bias") and p.dim() > 1]  # gpt-oss's
        for param in [*model.parameters(), *biases]:
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
        for param in stacked:
            param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    if tokenizer_json is not None:
        shutil.copy(tokenizer_json, folder / "tokenizer.json")
    return folder


def prompts(vocab: int = 512, shapes=SHAPES) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n, _ in shapes]
