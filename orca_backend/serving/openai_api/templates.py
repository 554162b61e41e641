"""Each served model's chat template, loaded once per tokenizer folder before the model is
listed: the first caller starts the load (a thread reads the files), every caller awaits the
same task. The rendering is `checkpoint.chat_template`'s (jinja2, no transformers)."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from ...checkpoint.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from ...core.errors import ConfigError
from .backend import ServedModel
from .errors import APIError, invalid

log = logging.getLogger(__name__)
_INLINE_CHARS = 16384  # longer conversations are rendered on a thread


class ChatTemplates:
    def __init__(self, template: str | Path | None = None) -> None:
        """`template` replaces every model's own (a file, or the template text)."""
        self._template = template
        self._loads: dict[Path | None, asyncio.Task] = {}

    def loaded(self, model: ServedModel) -> bool:
        """Whether the model's template has been looked for (found or not); starts the load if not."""
        return self._load(model).done()

    async def get(self, model: ServedModel) -> ChatTemplate | None:
        """The model's template, None if it has none; raises APIError if it cannot be loaded."""
        try:
            return await asyncio.shield(self._load(model))
        except ConfigError:  # logged once by _read; the client sees no path of this machine
            raise APIError(500, f"the chat template of the model '{model.name}' cannot be loaded") from None

    async def render(self, model: ServedModel, messages: list[dict], tools: list[dict] | None = None) -> str:
        template = await self.get(model)
        if template is None:
            raise invalid(f"the model '{model.name}' has no chat template: send the prompt to "
                          "/v1/completions, or start the API with --chat-template FILE", "messages")
        # A short conversation renders in tens of microseconds, less than a hop to a thread.
        if sum(len(m.get("content") or "") for m in messages) < _INLINE_CHARS:
            return _render(template, messages, tools)
        return await asyncio.to_thread(_render, template, messages, tools)

    def _load(self, model: ServedModel) -> asyncio.Task:
        folder = model.tokenizer
        if folder not in self._loads:
            task = asyncio.ensure_future(asyncio.to_thread(self._read, model))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # raised again by get()
            self._loads[folder] = task
        return self._loads[folder]

    def _read(self, model: ServedModel) -> ChatTemplate | None:
        folder = model.tokenizer
        try:
            template = load_chat_template(folder if folder is not None and folder.is_dir() else None,
                                          self._template)
        except ConfigError as e:
            log.error("model %s: %s", model.name, e)
            raise
        if template is None:
            log.warning("model %s has no chat template (tokenizer folder %s): chats get an error; pass "
                        "--tokenizer FOLDER or --chat-template FILE", model.name, folder)
        return template


def _render(template: ChatTemplate, messages: list[dict], tools: list[dict] | None) -> str:
    try:
        return template.render(messages, tools)
    except ChatTemplateError as e:  # the template refused the conversation (its raise_exception)
        raise invalid(f"messages: the model's chat template refused them: {e}", "messages") from None
