"""One API request's generations: a gRPC request per choice (each prompt times n), run at once
and merged in arrival order. An error before any choice has produced text is the request's
HTTP error; after that it ends the stream."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import Request

from .backend import Backend, Piece, ServedModel
from .errors import APIError
from .formats import Choice

log = logging.getLogger(__name__)
_END = object()  # a choice's last item on the queue


class Generation:
    def __init__(self, backend: Backend, model: ServedModel, prompts: list[str], sampling: dict,
                 n: int, stream: bool) -> None:
        self.n = n
        self.choices = [Choice(i * n + j, prompt) for i, prompt in enumerate(prompts) for j in range(n)]
        self._streams = [backend.generate(model, c.prompt, _nth(sampling, c.index % n), stream)
                         for c in self.choices]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._early: list[tuple[Choice, Piece]] = []  # read while waiting for every first piece
        self._open = len(self.choices)
        self._stopped: set[int] = set()  # choices ended early by stop()

    async def start(self) -> None:
        """Send every request and wait for each one's first response; raises APIError if
        one fails first (and cancels the rest)."""
        self._tasks = [asyncio.create_task(self._pump(c, s)) for c, s in zip(self.choices, self._streams)]
        waiting = set(range(len(self.choices)))
        try:
            while waiting:
                choice, item = await self._queue.get()
                if isinstance(item, APIError):
                    raise item
                waiting.discard(choice.index)
                if item is _END:
                    self._open -= 1
                else:
                    self._early.append((choice, item))
        except BaseException:
            self.cancel()
            raise

    async def pieces(self) -> AsyncIterator[tuple[Choice, Piece]]:
        """Every response after start(), each added to its choice; raises APIError. What
        has arrived while the caller was busy (an HTTP client reading slowly) comes merged,
        one piece per choice, so that a slow reader gets fewer, larger chunks."""
        try:
            batch, self._early = self._early, []
            failure: APIError | None = None
            while True:
                for choice, piece in _merged(batch):  # what came before an error goes out first
                    choice.add(piece)
                    yield choice, piece
                if failure is not None:
                    raise failure
                if not self._open:
                    return
                batch = []
                for item in [await self._queue.get(), *_drained(self._queue)]:
                    choice, piece = item
                    if isinstance(piece, APIError):
                        failure = piece
                        break
                    if piece is _END:
                        self._open -= 1
                    else:
                        batch.append(item)
        finally:
            await self.aclose()

    async def collect(self) -> list[Choice]:
        await self.start()
        async for _ in self.pieces():
            pass
        return self.choices

    def stop(self, choice: Choice) -> None:
        """End one choice early: its request is cancelled, and what it sent is all it has."""
        task = self._tasks[choice.index]
        if not task.done() and choice.index not in self._stopped:
            self._stopped.add(choice.index)
            task.cancel()  # it puts nothing more on the queue: this ends the choice instead
            self._queue.put_nowait((choice, _END))

    def cancel(self) -> None:
        """Cancel every request still open (their gRPC streams are cancelled)."""
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        """Cancel and close every request: a stream that has been read from, and is not read
        any more, cancels its gRPC stream when closed."""
        self.cancel()
        for stream in self._streams:
            try:
                await stream.aclose()
            except RuntimeError:  # a pump task is still inside it, being cancelled: it closes itself
                pass

    async def _pump(self, choice: Choice, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                self._queue.put_nowait((choice, piece))
            self._queue.put_nowait((choice, _END))
        except APIError as e:
            self._queue.put_nowait((choice, e))
        except Exception:  # a bug here must end the request, not leave it waiting
            log.exception("a generation failed")
            self._queue.put_nowait((choice, APIError(500, "internal error")))


def _drained(q: asyncio.Queue) -> list:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def _merged(items: list[tuple[Choice, Piece]]) -> list[tuple[Choice, Piece]]:
    """Consecutive pieces of a choice as one (text, tokens and logprobs joined), in order."""
    out: list[tuple[Choice, Piece]] = []
    for choice, piece in items:
        if out and out[-1][0] is choice:
            out[-1] = (choice, out[-1][1].followed_by(piece))
        else:
            out.append((choice, piece))
    return out


def _nth(sampling: dict, i: int) -> dict:
    """The i-th sample of a prompt: with a seed, seed + i, so that n samples differ yet repeat."""
    if i == 0 or sampling.get("seed") is None:
        return sampling
    return {**sampling, "seed": sampling["seed"] + i}


async def unless_disconnected(request: Request, work):
    """Await `work`, but cancel it (and so its gRPC streams) if the client goes away first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
