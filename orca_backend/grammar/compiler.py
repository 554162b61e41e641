"""Compiling grammars off the engine thread: a small pool, a cache of compiled grammars (and of
refusals) by the spec's canonical form, and a time limit per request.

One compiler per model in a process (`compiler_for`): the engine's and an in-process runner's
are the same, so the runner finds the grammar the engine waited for already compiled. A runner
in another process or model compiles it again, once, into its own cache.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import InvalidRequestError
from ..core.structured_outputs import StructuredOutputsParams
from .backend import Grammar

NUM_THREADS = 2
CACHE_SIZE = 512  # compiled grammars (and refusals) kept, least recently used out first
DEFAULT_TIMEOUT_SECONDS = 10.0


class GrammarTimeoutError(InvalidRequestError):
    """A grammar did not compile within the time limit."""


@dataclass(slots=True, eq=False)
class _Entry:
    compiled: Future[Grammar]  # the compile itself, shared by every request of the spec
    waiters: list[tuple[Future, threading.Timer]] = field(default_factory=list)  # until it ends


def grammar_of(future: Future[Grammar]) -> Grammar:
    """A done future's grammar, or its refusal raised as a new exception: raising the cached
    one again would add to its traceback, and keep each raiser's frames, at every repeat."""
    error = future.exception()
    if error is None:
        return future.result()
    try:
        fresh = type(error)(str(error))
    except Exception:
        fresh = RuntimeError(str(error))
    raise fresh from None


class GrammarCompiler:
    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = CACHE_SIZE, backend=None) -> None:
        """`backend`: made on the first compile (loading the tokenizer takes ~0.5 s) unless given."""
        self._args = (model_path, vocab_size, list(eos_token_ids))
        self.cache_size = cache_size
        self._backend = backend
        self._backend_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._pool = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="orca-grammar")
        self._compile_seconds: list[float] = []  # since the last take_compile_seconds()

    def submit(self, spec: StructuredOutputsParams,
               timeout_seconds: float | None = DEFAULT_TIMEOUT_SECONDS) -> Future[Grammar]:
        """A future of the compiled grammar: done at once on a cache hit; else done when the
        compile ends, or failed with GrammarTimeoutError after `timeout_seconds` (counted from
        now: a compile queued behind others counts). Its exception, if any, is an
        InvalidRequestError naming what is wrong; read it with `grammar_of`."""
        key = spec.key
        with self._lock:
            entry = self._cache.get(key)
            if entry is None:
                entry = self._cache[key] = _Entry(self._pool.submit(self._compile, spec))
                entry.compiled.add_done_callback(lambda _, entry=entry: self._settle_waiters(entry))
                self._evict()
            self._cache.move_to_end(key)
            if entry.compiled.done() or timeout_seconds is None:
                return entry.compiled
            waiter: Future[Grammar] = Future()
            timer = threading.Timer(timeout_seconds, _settle, (waiter, None, GrammarTimeoutError(
                f"structured_outputs {spec.kind!r} did not compile within {timeout_seconds:g} s "
                "(grammar_compile_timeout_seconds)")))
            timer.daemon = True
            entry.waiters.append((waiter, timer))
        timer.start()
        return waiter

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """Blocking, no time limit but the library's own: the grammar, or the
        InvalidRequestError of `submit`'s future (a runner's, for a spec the engine checked)."""
        return grammar_of(self.submit(spec, None))

    def _settle_waiters(self, entry: _Entry) -> None:
        """The compile ended: every waiter gets its outcome, and the entry lets go of them (a
        future keeps its callbacks, and a waiter's lead to its request)."""
        with self._lock:
            waiters, entry.waiters = entry.waiters, []
        for waiter, timer in waiters:
            timer.cancel()
            _settle(waiter, entry.compiled, None)

    def take_compile_seconds(self) -> list[float]:
        """How long each compile since the last call took (for the metrics)."""
        with self._lock:
            taken, self._compile_seconds = self._compile_seconds, []
        return taken

    def _compile(self, spec: StructuredOutputsParams) -> Grammar:
        start = time.perf_counter()
        try:
            with self._backend_lock:
                if self._backend is None:
                    from .backend import GuidanceBackend

                    self._backend = GuidanceBackend(*self._args)
            return self._backend.compile(spec)
        finally:
            with self._lock:
                self._compile_seconds.append(time.perf_counter() - start)

    def _evict(self) -> None:
        for key in list(self._cache):
            if len(self._cache) <= self.cache_size:
                return
            if self._cache[key].compiled.done():  # one still compiling stays: its waiters need it
                del self._cache[key]


def _settle(waiter: Future, source: Future | None, error: Exception | None) -> None:
    try:
        if source is None:
            waiter.set_exception(error)
        elif source.exception() is not None:
            waiter.set_exception(source.exception())
        else:
            waiter.set_result(source.result())
    except InvalidStateError:  # the timer and the compile both ended it: the first one counts
        pass


_COMPILERS: dict[tuple, GrammarCompiler] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(model_path: str | Path, vocab_size: int, eos_token_ids: list[int]) -> GrammarCompiler:
    """This process's compiler for a model's tokenizer (shared by its engine and runner)."""
    key = (str(model_path), vocab_size, tuple(eos_token_ids))
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            compiler = _COMPILERS[key] = GrammarCompiler(model_path, vocab_size, eos_token_ids)
        return compiler
