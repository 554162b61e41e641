"""Chat templates rendered with jinja2 alone equal transformers' `apply_chat_template` on the
same folder: the default model, Llama-3.1, Qwen2.5 and Mistral templates kept as fixtures
(tests/fixtures/chat_templates/, each as its model ships it), with tools, tool calls in the
history and a system message; and every place a checkpoint keeps its templates."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orca_backend.checkpoint.chat_template import ChatTemplateError, load_chat_template
from orca_backend.core.errors import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
# The special tokens each family's tokenizer_config.json names.
FAMILIES = {
    "llama3_1_instruct": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen2_5_instruct": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "mistral_7b_instruct_v0_3": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "München, or <any>"}},
                   "required": ["city"]}}}
CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ADDED_B = {"__type": "AddedToken", "content": "<B>", "lstrip": False, "normalized": False, "rstrip": False,
           "single_word": False, "special": True}  # a token as transformers writes one
SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
USER = {"role": "user", "content": "What is the weather in Paris?"}
CONVERSATIONS = {
    "one_turn": ([USER], None),
    "system": ([SYSTEM, USER], None),
    "turns": ([SYSTEM, USER, {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "And in Rome?"}],
              None),
    "tools": ([SYSTEM, USER], [WEATHER]),
    "tool_call_history": ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                           {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "21"}],
                          [WEATHER]),
}


def _folder(tmp_path: Path, default_model: Path, config: dict, files: dict[str, str] = {}) -> Path:
    """A tokenizer folder: the default model's tokenizer.json, `config` as tokenizer_config.json."""
    folder = tmp_path / "tokenizer"
    folder.mkdir(parents=True)
    shutil.copy(default_model / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              **config}))
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _reference(folder: Path, messages: list[dict], tools=None, add_generation_prompt: bool = True) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_the_default_model_renders_as_transformers_renders_it(default_model):
    template = load_chat_template(default_model)
    for name, (messages, _) in CONVERSATIONS.items():
        if name.startswith("tool"):
            continue  # SmolLM2's template knows no tools
        for add in (True, False):
            assert template.render(messages, add_generation_prompt=add) == _reference(default_model, messages,
                                                                                     None, add), (name, add)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_each_familys_template_renders_as_transformers_renders_it(tmp_path, default_model, family, conversation):
    tokens = {k: v for k, v in FAMILIES[family].items() if v is not None}
    folder = _folder(tmp_path, default_model,
                     {**tokens, "chat_template": (FIXTURES / f"{family}.jinja").read_text()})
    messages, tools = CONVERSATIONS[conversation]
    ours = load_chat_template(folder).render(messages, tools=tools)
    assert ours == _reference(folder, messages, tools)
    if tools is not None:
        assert "get_weather" in ours and "München, or <any>" in ours  # tojson: no \u escapes, no HTML escapes


def test_a_template_that_refuses_a_conversation_raises_what_it_says(tmp_path, default_model):
    folder = _folder(tmp_path, default_model, {"chat_template": (FIXTURES / "mistral_7b_instruct_v0_3.jinja").read_text()})
    two_users = [USER, USER]
    with pytest.raises(ChatTemplateError, match="alternate"):
        load_chat_template(folder).render(two_users)
    with pytest.raises(Exception, match="alternate"):
        _reference(folder, two_users)


def test_where_a_checkpoint_keeps_its_templates(tmp_path, default_model):
    """chat_template.jinja before tokenizer_config.json; named files; a list of named templates;
    tokens written as AddedToken objects; `tool_use` chosen for a conversation with tools."""
    plain, tool_use = "{{ bos_token }}{{ messages[0].content }}", "TOOLS{{ tools | length }}"
    cases = {
        "file": ({"chat_template": "ignored", "bos_token": ADDED_B}, {"chat_template.jinja": plain}),
        "named_files": ({"bos_token": "<B>"}, {"chat_template.jinja": plain,
                                                "additional_chat_templates/tool_use.jinja": tool_use}),
        "named_list": ({"bos_token": "<B>", "chat_template": [{"name": "default", "template": plain},
                                                             {"name": "tool_use", "template": tool_use}]}, {}),
    }
    for name, (config, files) in cases.items():
        folder = _folder(tmp_path / name, default_model, config, files)
        template = load_chat_template(folder)
        for tools in (None, [WEATHER]):
            ours = template.render([USER], tools=tools)
            assert ours == _reference(folder, [USER], tools), name
        assert template.render([USER]) == "<B>" + USER["content"]
        if name != "file":
            assert template.render([USER], tools=[WEATHER]) == "TOOLS1"


def test_generation_blocks_tojson_options_and_loop_controls(tmp_path, default_model):
    text = ("{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
            "{% generation %}{% set x = m.content %}[{{ x }}]{% endgeneration %}{{ x is defined }}{% endfor %}"
            "{{ tools | tojson(indent=2, sort_keys=True) }}{{ strftime_now('%Y') | length }}")
    folder = _folder(tmp_path, default_model, {"chat_template": text})
    ours = load_chat_template(folder).render([SYSTEM, USER], tools=[WEATHER])
    assert ours == _reference(folder, [SYSTEM, USER], [WEATHER])
    assert ours.startswith(f"[{USER['content']}]False")  # the block's `set` stays in the block


def test_no_template_is_none_and_a_broken_one_names_its_file(tmp_path, default_model):
    assert load_chat_template(_folder(tmp_path, default_model, {})) is None
    assert load_chat_template(None) is None
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match="broken.jinja does not compile"):
        load_chat_template(None, broken)
    with pytest.raises(ConfigError, match="cannot read the chat template"):
        load_chat_template(None, tmp_path / "missing.jinja")
    assert load_chat_template(None, "{{ messages | length }}").render([USER, USER]) == "2"
    (tmp_path / "tokenizer" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer_config.json"):
        load_chat_template(tmp_path / "tokenizer")


def test_block_whitespace_and_messages_as_transformers_hands_them_over(tmp_path, default_model):
    """Blocks on lines of their own leave no indentation or newline; a key set to None is
    absent; reasoning under any of its names is `reasoning_content` and `thinking`."""
    text = ("{% for m in messages %}\n    {% if m.content is defined %}\n        content\n    {% endif %}\n"
            "[{{ m.reasoning_content }}|{{ m.thinking }}]\n{% endfor %}")
    folder = _folder(tmp_path, default_model, {"chat_template": text})
    messages = [{"role": "assistant", "content": None, "reasoning": "because"}, USER]
    ours = load_chat_template(folder).render(messages)
    assert ours == _reference(folder, messages) == "[because|because]\n        content\n[|]\n"
