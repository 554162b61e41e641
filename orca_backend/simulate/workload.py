"""Seeded request traces: arrival offsets, lengths and prompts, for the load generator
(`client.bench`, `make bench`) and the simulator alike, so that both replay the same requests.

A trace is plain data, so two runs with the same seed send exactly the same requests at
exactly the same offsets, and a trace can be built once and replayed against several models.
Two workloads share prefixes between requests (for prefix caching): `system`, one long system
prompt before every short question, and `chat`, conversations whose every turn sends the
whole history (earlier messages and the model's answers) and a new message, each turn after
the previous one's answer.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

# Prompts are windows of this text, cycled as often as a window needs. Real prose rather than
# random token ids keeps the prompt's tokenization stable when it is decoded and sent as text.
CORPUS = """\
The harbour town woke slowly on winter mornings. Fishing boats came in before sunrise, their
decks white with frost, and the men who worked them carried crates of cod and herring up the
stone ramp to the market hall. By seven the bakery on the corner had its windows fogged with
steam, and children on their way to school would stop to press their noses against the glass.

Nobody in the town remembered exactly when the lighthouse had stopped working. Some said it
was the year of the great storm, when the sea climbed over the breakwater and flooded the
lower streets. Others insisted the keeper had simply grown old and that no one had wanted the
job after him. Whatever the reason, the tower stood dark on its rock at the mouth of the bay,
and the boats found their way home by the lamps of the houses along the shore.

In spring the town changed. Visitors arrived on the afternoon train with walking boots and
maps, asking the way to the cliff path or the ruined abbey on the hill. The inn put tables
outside, the ferry to the islands began running twice a day, and the harbour filled with
small sailing boats whose owners spent more time polishing brass than going to sea. The
fishermen complained about the noise, but they sold more fish in a week than in a whole
winter month, and most of them were quietly glad.

A young engineer came one summer to survey the lighthouse for the county council. She spent
three weeks climbing the spiral stairs with a notebook, measuring the rust on the railings
and testing the old clockwork that had once turned the great lens. At the end of it she wrote
a report explaining that the tower was sound, the lens was undamaged, and that a small
electric motor and a modern lamp would make the light work again for less than the cost of a
new fishing boat. The council read the report, thanked her, and put it in a drawer.

It was the schoolchildren who changed their minds. Their teacher read the report aloud in
class, and by the end of the week every pupil had written a letter to the council asking for
the light to be repaired. The letters were long and earnest and full of drawings of ships in
danger. Some of them described storms that had never happened; one described a sea monster.
The council could not answer a hundred letters with a drawer, so in the autumn a team of
workers arrived with a crane, a motor and a lamp, and on the first night of winter the beam
swept across the bay again while the whole town stood on the quay and cheered.
"""
ORCA_INPUT = (32, 512)   # ORCA's synthetic trace: uniform integer token counts, inclusive
ORCA_OUTPUT = (1, 128)
LOGNORMAL_CAPS = (1024, 512)


@dataclass(slots=True)
class LengthDist:
    """How prompt and output token counts are drawn: `orca`, `fixed` or `lognormal`."""

    kind: str = "orca"
    scale: float = 1.0           # orca: multiplies both ranges' bounds
    input_tokens: int = 128      # fixed
    output_tokens: int = 64
    input_mean: float = 256.0    # lognormal: means of the distributions, before clipping
    output_mean: float = 64.0
    sigma: float = 0.5

    def draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`n` (input, output) token counts, each at least 1."""
        if self.kind == "orca":
            (in_low, in_high), (out_low, out_high) = self.orca_bounds()
            return (rng.integers(in_low, in_high + 1, size=n),
                    rng.integers(out_low, out_high + 1, size=n))
        if self.kind == "fixed":
            return (np.full(n, max(1, self.input_tokens)), np.full(n, max(1, self.output_tokens)))
        if self.kind == "lognormal":
            return (self._lognormal(rng, n, self.input_mean, LOGNORMAL_CAPS[0]),
                    self._lognormal(rng, n, self.output_mean, LOGNORMAL_CAPS[1]))
        raise ValueError(f"unknown length distribution {self.kind!r}: orca, fixed or lognormal")

    def orca_bounds(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The scaled inclusive (low, high) ranges of the `orca` distribution."""
        return tuple(tuple(max(1, round(b * self.scale)) for b in bounds)
                     for bounds in (ORCA_INPUT, ORCA_OUTPUT))

    def _lognormal(self, rng, n, mean, cap) -> np.ndarray:
        # Shift mu so that `mean` is the distribution's mean, not its median.
        mu = np.log(mean) - self.sigma ** 2 / 2
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, size=n)), 1, cap).astype(np.int64)


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a trace: when to send it (seconds from the start) and what."""

    index: int
    offset: float
    prompt: str
    input_tokens: int    # drawn; the server's count of the decoded prompt may differ slightly
    output_tokens: int   # drawn; sent as max_tokens with ignore_eos, so it is exact
    # A later turn of a conversation: sent `offset` seconds after request `after` has ended,
    # its prompt being that request's prompt, then its answer, then `prompt`.
    after: int | None = None


@dataclass(slots=True)
class SharedPrefixes:
    """The `system` and `chat` workloads: lengths in tokens; `rate` counts requests (a chat
    of `turns` turns starts every `turns / rate` seconds on average)."""

    kind: str = "system"
    system_tokens: int = 400     # the shared system prompt (chat: before each conversation)
    question_tokens: int = 30    # each new user message
    answer_tokens: int = 30      # max_tokens of each request
    turns: int = 4               # chat: requests per conversation
    think_seconds: float = 0.0   # chat: from an answer to the next turn

    def trace(self, num_requests: int, rate: float | None, seed: int, tokenizer: Tokenizer) -> list[TraceRequest]:
        if self.kind not in ("system", "chat"):
            raise ValueError(f"unknown shared-prefix workload {self.kind!r}: system or chat")
        rng = np.random.default_rng(seed)
        corpus = tokenizer.encode(corpus_text(), add_special_tokens=False).ids

        def window(start: int, n: int) -> str:  # n tokens of the corpus from `start`, cycled
            return tokenizer.decode([corpus[(start + i) % len(corpus)] for i in range(n)],
                                    skip_special_tokens=True)

        system = window(0, self.system_tokens) + "\n\n" if self.system_tokens else ""
        turns = self.turns if self.kind == "chat" else 1
        num_chats = -(-num_requests // turns)
        offsets = (poisson_offsets(rate / turns, num_chats, rng) if rate is not None else np.zeros(num_chats))
        trace: list[TraceRequest] = []
        for chat in range(num_chats):
            for turn in range(min(turns, num_requests - len(trace))):
                question = window(int(rng.integers(0, len(corpus))), self.question_tokens)
                first = turn == 0
                trace.append(TraceRequest(
                    index=len(trace), offset=float(offsets[chat]) if first else self.think_seconds,
                    prompt=system + question if first else "\n\n" + question,
                    input_tokens=self.system_tokens * first + self.question_tokens,
                    output_tokens=self.answer_tokens, after=None if first else len(trace) - 1))
        return trace


def load_tokenizer(folder: str | Path | None = None) -> Tokenizer:
    """The tokenizer.json of `folder`, or of the default model when None."""
    if folder is None:
        from ..checkpoint.store import prepare_default_model
        folder = prepare_default_model()
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def corpus_text() -> str:
    """CORPUS with its source line breaks undone; paragraphs stay apart."""
    return "\n\n".join(" ".join(p.split()) for p in CORPUS.split("\n\n"))


def poisson_offsets(rate: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Arrival offsets of a Poisson process at `rate` per second; the first is at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def make_trace(dist: LengthDist, num_requests: int, rate: float | None, seed: int,
               tokenizer: Tokenizer) -> list[TraceRequest]:
    """A deterministic trace; `rate` None sends everything at offset 0 (closed loop)."""
    rng = np.random.default_rng(seed)
    inputs, outputs = dist.draw(rng, num_requests)
    corpus = np.array(tokenizer.encode(corpus_text(), add_special_tokens=False).ids)
    starts = rng.integers(0, len(corpus), size=num_requests)
    offsets = (poisson_offsets(rate, num_requests, rng) if rate is not None
               else np.zeros(num_requests))
    # np.resize repeats the corpus cyclically, so any start has a full window after it.
    cycled = np.resize(corpus, len(corpus) + int(inputs.max(initial=0)))
    return [TraceRequest(index=i, offset=float(offsets[i]),
                         prompt=tokenizer.decode(cycled[s:s + n].tolist(), skip_special_tokens=True),
                         input_tokens=int(n), output_tokens=int(m))
            for i, (s, n, m) in enumerate(zip(starts, inputs, outputs))]


def exact_rate(trace: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """The trace with its offsets stretched so that its last arrival is at (n - 1) / rate.

    A short Poisson run's realized rate strays from the nominal one (40 arrivals at 2 req/s
    span 19.5 +- 3.1 s); stretching keeps the arrival pattern and makes every run offer the
    load its label says. Only arrivals are stretched (for conversations, of their first turns,
    at rate x arrivals / requests): a later turn keeps its think time."""
    arrivals = [r for r in trace if r.after is None]
    last = arrivals[-1].offset if arrivals else 0.0
    if len(arrivals) < 2 or last <= 0:
        return trace
    factor = (len(arrivals) - 1) / (rate * len(arrivals) / len(trace)) / last
    return [dataclasses.replace(r, offset=r.offset * factor) if r.after is None else r for r in trace]


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The command-line options that choose a trace's lengths, seed and tokenizer."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dist", choices=("orca", "fixed", "lognormal", "system", "chat"), default="orca",
                   help="system: a shared system prompt and short questions; chat: multi-turn "
                        "conversations (both share prefixes between requests)")
    p.add_argument("--scale", type=float, default=1.0, help="orca: multiplies the length ranges")
    p.add_argument("--input-tokens", type=int, default=128, help="fixed")
    p.add_argument("--output-tokens", type=int, default=64, help="fixed")
    p.add_argument("--input-mean", type=float, default=256.0, help="lognormal")
    p.add_argument("--output-mean", type=float, default=64.0, help="lognormal")
    p.add_argument("--sigma", type=float, default=0.5, help="lognormal")
    p.add_argument("--system-tokens", type=int, help="system, chat: the system prompt (default 400, chat 0)")
    p.add_argument("--question-tokens", type=int, default=30, help="system, chat: each user message")
    p.add_argument("--answer-tokens", type=int, default=30, help="system, chat: each answer (max_tokens)")
    p.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    p.add_argument("--think-seconds", type=float, default=0.0, help="chat: from an answer to the next turn")
    p.add_argument("--tokenizer", help="folder with tokenizer.json (default: the default model)")


def trace_from_arguments(args: argparse.Namespace, num_requests: int,
                         rate: float | None) -> list[TraceRequest]:
    """The trace that the options of `add_trace_arguments` describe."""
    if args.dist in ("system", "chat"):
        system = args.system_tokens if args.system_tokens is not None else (400 if args.dist == "system" else 0)
        return SharedPrefixes(args.dist, system, args.question_tokens, args.answer_tokens, args.turns,
                              args.think_seconds).trace(num_requests, rate, args.seed, load_tokenizer(args.tokenizer))
    dist = LengthDist(kind=args.dist, scale=args.scale, input_tokens=args.input_tokens,
                      output_tokens=args.output_tokens, input_mean=args.input_mean,
                      output_mean=args.output_mean, sigma=args.sigma)
    return make_trace(dist, num_requests, rate, args.seed, load_tokenizer(args.tokenizer))
