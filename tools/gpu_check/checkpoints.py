"""Random checkpoints for the engine sections: tiny Llama and Qwen2 ones on disk, an
8B-shaped one kept in memory, and a tokenizer that covers any vocabulary."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from tools.gpu_check.report import Context


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the whole vocabulary ("t0" .. "t{n-1}"): the engine only
    needs one to load and to detokenize; these checks send token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def save_tiny(kind: str, folder: Path) -> Path:
    """A small random Llama or Qwen2 checkpoint (fp32, head_dim 32) with biases and norm
    weights perturbed, so that a dropped one would change the tokens."""
    import torch
    import transformers as tf

    arch = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=0.2, tie_word_embeddings=kind == "qwen2")
    config = (tf.Qwen2Config if kind == "qwen2" else tf.LlamaConfig)(**arch)
    torch.manual_seed(0)
    model = (tf.Qwen2ForCausalLM if kind == "qwen2" else tf.LlamaForCausalLM)(config).float()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    write_tokenizer(folder, arch["vocab_size"])
    return folder


def new_engine(folder: Path, **options):
    from orca_backend import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(folder), **options))


def big_model(ctx: Context, folder: Path, dtype_name: str):
    """transformers' random model from the config, made on the device; config and tokenizer saved."""
    import torch
    import transformers as tf

    shape = dict(ctx.sizes.big_model)
    if ctx.args.layers is not None:
        shape["num_hidden_layers"] = ctx.args.layers
    config = tf.LlamaConfig(**shape, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                            architectures=["LlamaForCausalLM"])
    with torch.device(ctx.device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name),
                                                    attn_implementation="sdpa").eval()
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    write_tokenizer(folder, config.vocab_size)
    return model


def engine_on_live_model(folder: Path, state: dict, **options):
    """Our engine over `state`'s tensors (the folder holds config.json and tokenizer.json)."""
    import orca_backend.runner.models as models
    from orca_backend.runner.models.weights import Weights

    def weights(_folder, dtype, device, strip_prefix=""):
        # The model's own tensors, so that the 8B-shaped checkpoint never goes through the disk.
        return Weights.from_tensors(state, dtype, device)

    with mock.patch.object(models, "Weights", weights):
        return new_engine(folder, **options)


@dataclass(slots=True)
class LiveModel:
    """Where our engines get the in-memory model: its folder (config and tokenizer), its
    tensors, and the engine options every run shares."""

    folder: Path
    state: dict
    options: dict

    def engine(self, **options):
        return engine_on_live_model(self.folder, self.state, **self.options, **options)
