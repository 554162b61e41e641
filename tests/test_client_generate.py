"""client.generate --chat: the prompt rendered with the default model's chat template."""
from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest

from client import generate
from client.generate import chat_prompt, main

QUESTION = "What is the capital of France?"


def test_chat_prompt_is_one_user_turn_then_the_assistant_header(default_model):
    prompt = chat_prompt(QUESTION, default_model)
    assert f"<|im_start|>user\n{QUESTION}<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")  # the model answers rather than ends at once


class _FakeClient:
    """Stands in for StreamingClient: records what is sent and answers with one finished response."""

    sent: list[str] = []

    def __init__(self, url: str, model: str) -> None:
        self.events: queue.Queue = queue.Queue()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def send(self, prompt: str, **options) -> str:
        self.sent.append(prompt)
        self.events.put(("0", {"text_output": "Paris", "finish_reason": "stop"}))
        return "0"

    def wait(self, request_id: str):
        return SimpleNamespace(responses=[{"finish_reason": "stop"}])


@pytest.mark.parametrize("chat", [False, True])
def test_main_sends_the_chat_prompt_only_with_chat(monkeypatch, capsys, default_model, chat):
    monkeypatch.setattr(generate, "StreamingClient", _FakeClient)
    monkeypatch.setattr(_FakeClient, "sent", [])
    argv = [QUESTION, "--tokenizer", str(default_model)] + (["--chat"] if chat else [])
    assert main(argv) == 0
    assert _FakeClient.sent == [chat_prompt(QUESTION, default_model) if chat else QUESTION]
    assert capsys.readouterr().out.startswith("Paris")


def test_chat_without_a_tokenizer_folder_is_a_clear_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(generate, "StreamingClient", _FakeClient)  # must not be reached
    monkeypatch.setattr(_FakeClient, "sent", [])
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path))  # the default model's folder is missing
    for argv in ([QUESTION, "--chat"], [QUESTION, "--chat", "--tokenizer", str(tmp_path / "nothing")]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "no tokenizer folder" in err and "--tokenizer FOLDER" in err and "make model" in err
    assert _FakeClient.sent == []


def test_chat_with_a_folder_without_tokenizer_files_is_a_clear_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main([QUESTION, "--chat", "--tokenizer", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"cannot render the chat template of {tmp_path}" in capsys.readouterr().err
