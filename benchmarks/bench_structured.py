"""What structured outputs cost: the grammar masks alone, then served throughput with 0%, 20%
and 100% of the requests under a JSON schema, in one run on this machine.

1. Compiles: each of four specs compiled once, then found in the cache. Masks, in this
   process: N requests under the JSON schema of the tests (nested objects,
   arrays of enums, bounded strings), each at its own point of a valid document, one decode
   step after another: the time to fill the batch's bitmask (`GrammarMasks`, the library's
   threads) and to apply it to [N, vocab] logits in place (`apply_bitmask`), per iteration and
   per row, for N = 1, 8, 32, 256.
2. Served, through a real tritonserver and tritonclient, closed loop: the shipped `orca` (the
   default model) with 16 streams, and `engine: null` with 256 streams at a 10 ms step and at
   once (the host-path benchmark's runner; under a grammar it writes its text where the grammar
   allows it, else the first token it allows, so its masks are computed as a model's). A
   free request asks for `--tokens` tokens (ignore_eos); a constrained one for up to 3x that
   under the schema, ending where the JSON ends. Reported: delivered tokens/s, the ratio to
   0%, the mean mask time per iteration (`orca_grammar_mask_seconds`) and invalid outputs.

    python benchmarks/bench_structured.py [--seconds 15] [--markdown docs/benchmarks/structured.md]
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import jsonschema  # noqa: E402
import torch  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from benchmarks.bench_host import copy_orca  # noqa: E402
from benchmarks.host_load import PROMPT, TritonLoad, _Open  # noqa: E402
from benchmarks.report import log, machine_lines, table  # noqa: E402
from orca_backend.checkpoint.config import ModelConfig  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.core.structured_outputs import StructuredOutputsParams  # noqa: E402
from orca_backend.grammar import apply_bitmask, compiler_for  # noqa: E402
from orca_backend.runner.grammar_masks import GrammarMasks  # noqa: E402
from orca_backend.serving.grpc_io import build_inputs  # noqa: E402
from orca_backend.serving.launch import Server  # noqa: E402
from test_structured_outputs import SCHEMA  # noqa: E402

MIXES = (0.0, 0.2, 1.0)
NAMES = ["Ada", "Grace Hopper", "Linus", "Margaret H.", "Alan Turing", "Barbara", "Ken", "Dennis R."]
CITIES = ["Paris", "Lagos", "Sao Paulo", "Kyoto", "Oslo", "New York", "Cairo"]


class _Row:
    """A stand-in for a runner's request: what GrammarMasks reads."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher


def documents(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        doc = {"name": rng.choice(NAMES), "age": rng.randint(0, 120),
               "tags": rng.sample(["red", "green", "blue"], rng.randint(0, 3)),
               "address": {"city": rng.choice(CITIES), "zip": f"{rng.randint(0, 99999):05d}"}}
        jsonschema.validate(doc, SCHEMA)
        docs.append(json.dumps(doc, indent=rng.choice([None, 2])))
    return docs


def mask_rows(folder: Path, batches: list[int], steps: int) -> list[list]:
    config = ModelConfig.from_folder(folder)
    compiler = compiler_for(folder, config.vocab_size, config.eos_token_ids)
    grammar = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    docs = [tokenizer.encode(d, add_special_tokens=False).ids for d in documents(64)]
    masks = GrammarMasks(config.vocab_size)
    rows = []
    for n in batches:
        rng = random.Random(n)
        # Each row at its own point of its document, then `steps` decode steps together.
        picked = [docs[i % len(docs)] for i in range(n)]
        starts = [rng.randrange(0, max(1, len(d) - steps)) for d in picked]
        states = []
        for doc, start in zip(picked, starts):
            matcher = grammar.matcher()
            for token in doc[:start]:
                assert matcher.accept(token)
            states.append(_Row(matcher))
        logits = torch.randn(n, config.vocab_size)
        fill, apply = [], []
        for step in range(steps):
            done = masks.start(states).result()
            fill.append(done.seconds)
            start = time.perf_counter()
            apply_bitmask(logits, done.bitmask)
            apply.append(time.perf_counter() - start)
            for state, doc, first in zip(states, picked, starts):
                position = first + step
                state.matcher.accept(doc[position] if position < len(doc) else config.eos_token_ids[0])
        f, a = statistics.median(fill) * 1e3, statistics.median(apply) * 1e3
        rows.append([n, f"{f:.2f}", f"{max(fill) * 1e3:.2f}", f"{a:.2f}", f"{(f + a) * 1e3 / n:.1f}",
                     f"{f + a:.2f}"])
    masks.shutdown()
    return rows


def compile_rows(folder: Path) -> list[list]:
    """Each spec compiled once by a fresh compiler (its tokenizer loaded first), then a cache hit."""
    from orca_backend.grammar import GrammarCompiler

    config = ModelConfig.from_folder(folder)
    compiler = GrammarCompiler(folder, config.vocab_size, config.eos_token_ids)
    start = time.perf_counter()
    compiler.compile(StructuredOutputsParams(regex="x"))
    rows = [["first compile of the process (loads the tokenizer)", f"{(time.perf_counter() - start) * 1e3:.0f}", "-"]]
    wide = {"type": "object", "required": [f"p{i}" for i in range(300)],
            "properties": {f"p{i}": {"type": "integer", "minimum": i, "maximum": 1000 * i + 7} for i in range(300)}}
    for name, spec in (("the tests' JSON schema", {"json": SCHEMA}), ("choice of 3", {"choice": ["a", "b", "c"]}),
                       ("regex (a phone number)", {"regex": r"\(\d{3}\) \d{3}-\d{4}"}),
                       ("300 bounded integer properties", {"json": wide})):
        params = StructuredOutputsParams(**spec)
        start = time.perf_counter()
        compiler.compile(params)
        first = time.perf_counter() - start
        start = time.perf_counter()
        compiler.compile(params)
        rows.append([name, f"{first * 1e3:.1f}", f"{(time.perf_counter() - start) * 1e6:.0f}"])
    return rows


class MixedLoad(TritonLoad):
    """TritonLoad with every k-th request under the schema (k from the mix), checked at its end."""

    def __init__(self, url: str, model: str, streams: int, max_tokens: int, constrained: float) -> None:
        super().__init__(url, model, streams, max_tokens, None)
        self.every = round(1 / constrained) if constrained else 0
        self.free = self.inputs
        self.schema = build_inputs(PROMPT, {"max_tokens": 3 * max_tokens, "temperature": 0,
                                            "structured_outputs": {"json": SCHEMA}},
                                   stream=True, flags={"return_num_output_tokens": True})
        self.kinds: dict[str, bool] = {}
        self.invalid = 0

    def _send(self) -> None:
        request_id = str(next(self._ids))
        constrained = bool(self.every) and int(request_id) % self.every == 0
        self.kinds[request_id] = constrained
        self._open[request_id] = _Open(time.perf_counter())
        self.client.async_stream_infer(self.model, self.schema if constrained else self.free,
                                       request_id=request_id, outputs=self.outputs)

    def _on_response(self, result, error) -> None:
        if error is None:
            self._last_id = result.get_response().id
        super()._on_response(result, error)

    def _finished(self, stream, now: float) -> None:
        r = self._window.result
        if self._window.inside(now):
            r.requests_done += 1
        if not self.kinds.pop(self._last_id):
            r.wrong += stream.tokens != self.max_tokens
            return
        try:
            jsonschema.validate(json.loads("".join(stream.text)), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            r.wrong += 1


def mask_metric(server: Server, model: str) -> tuple[float, float]:
    values = server.metrics()
    key = f'{{model="{model}"}}'
    return (values.get(f"orca_grammar_mask_seconds_sum{key}", 0.0),
            values.get(f"orca_grammar_mask_seconds_count{key}", 0.0))


def served_rows(args, server: Server, runs: list[tuple[str, int, str]]) -> list[list]:
    rows = []
    for model, streams, label in runs:
        base = None
        for mix in MIXES:
            log(f"{label}: {streams} streams, {mix:.0%} constrained")
            load = MixedLoad(server.grpc_url, model, streams, args.tokens, mix)
            before = mask_metric(server, model)
            result = load.run(args.warmup, args.seconds)
            time.sleep(1.5)  # the model's metrics thread flushes
            after = mask_metric(server, model)
            count = after[1] - before[1]
            mask_ms = (after[0] - before[0]) / count * 1e3 if count else 0.0
            rate = result.tokens_per_second
            base = base or rate
            rows.append([label, streams, f"{mix:.0%}", f"{rate:,.0f}", f"{rate / base:.3f}",
                         f"{mask_ms:.2f}" if count else "-", result.requests_done,
                         result.wrong, len(result.errors)])
    return rows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32,256")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per batch size")
    p.add_argument("--tokens", type=int, default=64, help="tokens of a free request")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def main() -> None:
    args = parse_args()
    started = datetime.datetime.now()
    folder = prepare_default_model()
    log("compiles and masks")
    compiles = compile_rows(folder)
    masks = mask_rows(folder, args.batches, args.steps)
    with tempfile.TemporaryDirectory(prefix="orca-structured-") as tmp:
        work = Path(tmp)
        repo = work / "repo"
        repo.mkdir()
        copy_orca(repo, "orca")
        for name, step in (("orca_null_10ms", "0.01"), ("orca_null_0ms", "0")):
            copy_orca(repo, name, engine="null", null_step_seconds=step, max_batch_size="256",
                      max_num_batched_tokens="8192", kv_cache_tokens=str(1 << 20))
        server = Server(work, repo)
        try:
            server.wait_ready()
            served = served_rows(args, server, [("orca", 16, "default model"),
                                                ("orca_null_10ms", 256, "null runner, 10 ms step"),
                                                ("orca_null_0ms", 256, "null runner, instant")])
        finally:
            server.stop()
    lines = [f"# Structured outputs: mask cost and served throughput ({started:%Y-%m-%d %H:%M})", "",
             f"`make bench-structured` ({' '.join(sys.argv[1:])}); {', '.join(machine_lines())}.", "",
             "## Compiles", "",
             *table(["spec", "compile ms", "cache hit us"], compiles), "",
             "## Masks: the JSON schema of the tests, each row at its own point of a valid document", "",
             *table(["rows", "fill ms (median)", "fill ms (max)", "apply ms", "us per row", "ms per iteration"],
                    masks), "",
             "## Served: delivered tokens/s with a share of the requests under the schema", "",
             *table(["model", "streams", "constrained", "tokens/s", "ratio to 0%", "mask ms / iteration",
                     "requests", "invalid", "errors"], served)]
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
