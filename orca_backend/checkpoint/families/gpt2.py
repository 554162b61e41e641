"""GPT-2: LayerNorm with biases, learned absolute positions, a plain GELU MLP, biases on
every projection, weights stored transposed (Conv1D)."""
from __future__ import annotations

from .fields import ConfigFields, activation


def gpt2(f: ConfigFields) -> dict:
    f.refuse("scale_attn_by_inverse_layer_idx", (False,), "scores scaled by 1 / (layer + 1) are not "
             "implemented", default=False)
    f.refuse("reorder_and_upcast_attn", (False,), "this upcast attention is not implemented", default=False)
    f.refuse("scale_attn_weights", (True,), "attention without the 1/sqrt(head_dim) scale is not "
             "implemented", default=True)
    f.refuse("add_cross_attention", (False,), "cross-attention belongs to encoder-decoder models",
             default=False)
    # The sequence-classification head's options, which a causal LM does not use.
    f.no_math("summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
              "summary_first_dropout", "is_encoder_decoder")
    act = activation(f, "activation_function", "gelu_new")
    hidden, heads = f.require("n_embd"), f.require("n_head")
    return dict(architecture=f.architecture, family="gpt2", vocab_size=f.require("vocab_size"),
                hidden_size=hidden, num_layers=f.require("n_layer"), num_heads=heads, num_kv_heads=heads,
                head_dim=hidden // heads, intermediate_size=f.get("n_inner") or 4 * hidden,
                max_model_len=f.get("n_positions", 1024), norm_eps=f.get("layer_norm_epsilon", 1e-5),
                tie_word_embeddings=f.get("tie_word_embeddings", True), activation=act, qkv_bias=True,
                o_bias=True, mlp_bias=True, norm="layer", positions="learned", gated_mlp=False)


ARCHITECTURES = {"GPT2LMHeadModel": gpt2}
