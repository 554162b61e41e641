"""Chat templates from each model's tokenizer files (transformers renders them), loaded once
per folder and rendered off the event loop."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from .backend import ServedModel
from .errors import APIError, invalid

log = logging.getLogger(__name__)
_INLINE_CHARS = 16384  # longer conversations are rendered on a thread


class ChatTemplates:
    def __init__(self) -> None:
        self._tokenizers: dict[Path, object] = {}

    async def render(self, model: ServedModel, messages: list[dict]) -> str:
        # A short conversation renders in tens of microseconds, less than a hop to a thread.
        if sum(len(m["content"]) for m in messages) < _INLINE_CHARS and self._tokenizers.get(model.tokenizer):
            return self._render(model, messages)
        return await asyncio.to_thread(self._render, model, messages)

    async def load(self, model: ServedModel) -> None:
        """Load a model's template ahead of its first chat; a model without one is left to fail then."""
        try:
            await asyncio.to_thread(self._tokenizer, model)
        except APIError:
            pass

    def _render(self, model: ServedModel, messages: list[dict]) -> str:
        tokenizer = self._tokenizer(model)
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template refused the conversation (jinja raise_exception)
            raise invalid(f"messages: the model's chat template refused them: {_first_line(e)}",
                          "messages") from None

    def _tokenizer(self, model: ServedModel):
        folder = model.tokenizer
        if folder not in self._tokenizers:
            from transformers import AutoTokenizer  # slow to import; chat requests only

            tokenizer = None
            if folder is not None and folder.is_dir():
                try:
                    tokenizer = AutoTokenizer.from_pretrained(folder)
                except (OSError, ValueError) as e:
                    log.warning("no tokenizer for model %s in %s: %s", model.name, folder, e)
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                log.warning("model %s has no chat template (tokenizer folder %s); pass --tokenizer",
                            model.name, folder)
                tokenizer = None  # remembered: the folder is not read again for every chat
            self._tokenizers[folder] = tokenizer
        if self._tokenizers[folder] is None:
            raise APIError(500, f"the model '{model.name}' has no chat template here: start the "
                           "frontend with --tokenizer FOLDER")
        return self._tokenizers[folder]


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]
