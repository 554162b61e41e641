"""A checkpoint's chat template, rendered without transformers.

The template is Jinja, run as transformers' `apply_chat_template` runs it: a sandboxed,
immutable environment with `trim_blocks` and `lstrip_blocks`, loop controls, its `tojson`,
`raise_exception`, `strftime_now`, `{% generation %}` blocks, and the variables it passes
(`messages`, `tools`, `documents`, `add_generation_prompt` and the special tokens). jinja2
imports in milliseconds where transformers takes seconds, and nothing here is imported
lazily, so no thread can find it half imported.

Where a folder keeps its templates (as transformers reads them): `chat_template.jinja` and
`additional_chat_templates/NAME.jinja`, else `chat_template` in `tokenizer_config.json` (one
template, or a list of named ones). With several, `tool_use` renders conversations with
tools and `default` the others.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..core.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_TOKENS_MAP = "special_tokens_map.json"  # older checkpoints name their tokens here too
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is what templates read


class ChatTemplateError(ValueError):
    """The template refused a conversation (its `raise_exception`, or an error while rendering)."""


@dataclass(slots=True, frozen=True)
class ChatTemplate:
    """A checkpoint's templates by name (`default`, `tool_use`, ...) and its special tokens."""

    templates: dict[str, jinja2.Template]
    special_tokens: dict[str, str]  # bos_token, eos_token, ...: variables of every template

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **variables) -> str:
        """The conversation as the model's prompt text; raises ChatTemplateError."""
        template = self._pick(tools)
        try:
            return template.render(messages=[_message(m) for m in messages], tools=tools, documents=None,
                                   add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **variables})
        except Exception as e:  # a template may fail on any input it did not expect
            raise ChatTemplateError(_first_line(e)) from None

    def _pick(self, tools: list[dict] | None) -> jinja2.Template:
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(f"the model has chat templates named {sorted(self.templates)} and no "
                                "default one")


def load_chat_template(folder: Path | None, template: str | Path | None = None) -> ChatTemplate | None:
    """The chat template of the checkpoint in `folder` (its special tokens too), or None if it
    has none. `template` replaces the folder's: a file, or the template text itself. Raises
    ConfigError naming the file that cannot be read or does not compile."""
    config = _read_json(folder / TOKENIZER_CONFIG) if folder is not None else {}
    sources = _given(template) if template is not None else _sources(folder, config)
    if not sources:
        return None
    compiled = {}
    for name, (text, where) in sources.items():
        try:
            compiled[name] = _ENV.from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"the chat template in {where} does not compile: {e.message} "
                              f"(line {e.lineno})") from None
    return ChatTemplate(compiled, _special_tokens(folder, config))


def _given(template: str | Path) -> dict[str, tuple[str, str]]:
    path = Path(template)
    if isinstance(template, Path) or ("\n" not in template and "{" not in template):
        try:
            return {"default": (path.read_text(encoding="utf-8"), str(path))}
        except OSError as e:
            raise ConfigError(f"cannot read the chat template {path}: {e.strerror}") from None
    return {"default": (template, "the given text")}


def _sources(folder: Path | None, config: dict) -> dict[str, tuple[str, str]]:
    """name -> (template text, where it came from)."""
    if folder is None:
        return {}
    found = {}
    files = [folder / TEMPLATE_FILE, *sorted((folder / NAMED_TEMPLATES_DIR).glob("*.jinja"))]
    for path in files:
        if path.is_file():
            name = "default" if path.name == TEMPLATE_FILE and path.parent == folder else path.stem
            found[name] = (path.read_text(encoding="utf-8"), str(path))
    if found:
        return found
    value, where = config.get("chat_template"), str(folder / TOKENIZER_CONFIG)
    if isinstance(value, str):
        return {"default": (value, where)}
    if isinstance(value, list):
        try:
            return {t["name"]: (t["template"], where) for t in value}
        except (TypeError, KeyError):
            raise ConfigError(f"{where}: chat_template is a list whose items are not "
                              "{'name': ..., 'template': ...}") from None
    return {}


def _special_tokens(folder: Path | None, config: dict) -> dict[str, str]:
    """The named special tokens, as strings (a checkpoint may write one as {"content": ...})."""
    legacy = _read_json(folder / _SPECIAL_TOKENS_MAP) if folder is not None else {}
    named = {key: config.get(key, legacy.get(key)) for key in _SPECIAL_TOKENS}
    # A model's own named tokens (image_token, ...): a dict here, a list of extra tokens otherwise.
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        if isinstance(config.get(key), dict):
            named.update(config[key])
    tokens = {}
    for key, value in named.items():
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return value if isinstance(value, dict) else {}


def _message(message: dict) -> dict:
    """As transformers hands a message over: no keys set to None (many templates test only
    whether a key is there), and reasoning under each of the names templates read it by."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:300]


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks;
    a prompt needs only its body, rendered in a scope of its own (a call block, as transformers
    renders it)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML (<, >, &, '), which a prompt must not see.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


_ENV = _environment()
