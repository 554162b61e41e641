"""Reading a checkpoint's config.json so that no field goes unaccounted for.

A family's parser reads every field it honours through `ConfigFields`, which remembers what
was read; fields known not to change what the model computes are declared as such
(`COMMON_NO_MATH`, or a family's own list); a value the engine does not implement is refused
with the field's name (`refuse`). `tests/test_models.py` walks each supported architecture's
transformers config class and checks that every field is one of the three. Fields outside
the class (a stray key in a hub config) are kept in `ModelConfig.unknown_fields` and logged at
load: transformers ignores them too.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ...core.errors import ConfigError

# Fields of every transformers config that do not change what a served model computes.
COMMON_NO_MATH = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "auto_map",
    "torch_dtype", "dtype",  # the engine's `dtype` option decides
    "use_cache", "initializer_range", "pad_token_id", "bos_token_id", "id2label", "label2id",
    "problem_type", "return_dict", "output_attentions", "output_hidden_states",
    "chunk_size_feed_forward",  # the same feed-forward computed in chunks
    "attention_dropout", "embd_pdrop", "resid_pdrop", "attn_pdrop",  # training only
    "pretraining_tp",  # transformers 5 ignores it (its split matmuls had the same math)
    "tokenizer_class", "prefix", "task_specific_params", "finetuning_task",
})


class ConfigFields:
    """config.json's fields for one architecture; `get` marks a field read. An absent field
    reads as its default (pass transformers' class default), one set to null as None, as
    transformers reads them."""

    def __init__(self, raw: dict, architecture: str, where: str) -> None:
        self.raw, self.architecture, self.where = raw, architecture, where
        self.read: set[str] = set()

    def get(self, name: str, default: Any = None) -> Any:
        self.read.add(name)
        return self.raw.get(name, default)

    def require(self, name: str) -> Any:
        value = self.get(name)
        if value is None:
            raise ConfigError(f"{self.where} has no {name!r}, which {self.architecture} needs")
        return value

    def refuse(self, name: str, allowed: Iterable[Any] | Callable[[Any], bool], why: str,
               default: Any = None) -> Any:
        """The field's value, or ConfigError naming it when the value is not `allowed` (a
        collection, or a predicate) and saying why."""
        value = self.get(name, default)
        ok = allowed(value) if callable(allowed) else value in tuple(allowed)
        if not ok:
            raise ConfigError(f"{self.where}: {name} = {value!r} is not supported for "
                              f"{self.architecture}: {why}")
        return value

    def no_math(self, *names: str) -> None:
        """Fields this architecture has that do not change the served model's math."""
        self.read.update(names)

    def unknown(self) -> tuple[str, ...]:
        """Fields neither read nor known not to matter."""
        return tuple(sorted(k for k in self.raw if k not in self.read and k not in COMMON_NO_MATH))


def activation(f: ConfigFields, name: str = "hidden_act", default: str = "silu") -> str:
    """The MLP's activation, by transformers' ACT2FN name, as one of ours: silu, gelu_tanh or
    gelu (erf)."""
    value = f.get(name, default)
    kind = ACTIVATIONS.get(value)
    if kind is None:
        raise ConfigError(f"{f.where}: {name} = {value!r} is not supported for {f.architecture} "
                          f"(supported: {', '.join(sorted(ACTIVATIONS))})")
    return kind


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu"}
