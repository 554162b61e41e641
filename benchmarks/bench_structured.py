"""What structured outputs cost: grammar compiles, the masks alone (the tests' JSON schema, N
rows each at its own point of a valid document: `GrammarMasks` fill, `apply_bitmask` apply),
then delivered tokens/s through tritonserver with 0%, 20% and 100% of requests under the schema
(the default model at 16 streams; `engine: null` at 256, a 10 ms step and instant).

    python -m benchmarks.bench_structured [--seconds 15]
"""
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import torch
from tokenizers import Tokenizer

from benchmarks.common import Report, copy_model, log, metric_total, options, serving, work_dir
from benchmarks.headline import record
from benchmarks.host_load import Ask, TritonLoad
from orca_backend.checkpoint.config import ModelConfig
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.core.structured_outputs import StructuredOutputsParams
from orca_backend.grammar import GrammarCompiler, apply_bitmask
from orca_backend.runner.grammar_masks import GrammarMasks
from orca_backend.serving.launch import REPO_ROOT

sys.path.append(str(REPO_ROOT / "tests"))  # the tests' schema: their modules import each other by name
from test_structured_outputs import SCHEMA  # noqa: E402

MIXES = (0.0, 0.2, 1.0)
NAMES = ["Ada", "Grace Hopper", "Linus", "Margaret H.", "Alan Turing", "Barbara", "Ken", "Dennis R."]
CITIES = ["Paris", "Lagos", "Sao Paulo", "Kyoto", "Oslo", "New York", "Cairo"]
WIDE = {"type": "object", "required": [f"p{i}" for i in range(300)],
        "properties": {f"p{i}": {"type": "integer", "minimum": i, "maximum": 1000 * i + 7} for i in range(300)}}
SPECS = {"the tests' JSON schema": {"json": SCHEMA}, "choice of 3": {"choice": ["a", "b", "c"]},
         "regex (a phone number)": {"regex": r"\(\d{3}\) \d{3}-\d{4}"},
         "300 bounded integer properties": {"json": WIDE}}


def documents(count: int, seed: int = 0) -> list[str]:
    rng, docs = random.Random(seed), []
    for _ in range(count):
        doc = {"name": rng.choice(NAMES), "age": rng.randint(0, 120),
               "tags": rng.sample(["red", "green", "blue"], rng.randint(0, 3)),
               "address": {"city": rng.choice(CITIES), "zip": f"{rng.randint(0, 99999):05d}"}}
        jsonschema.validate(doc, SCHEMA)
        docs.append(json.dumps(doc, indent=rng.choice([None, 2])))
    return docs


def compile_rows(compiler: GrammarCompiler) -> list[list]:
    """Each spec compiled once by a fresh compiler (its tokenizer loaded first), then a cache hit."""
    def seconds(params) -> float:
        start = time.perf_counter()
        compiler.compile(params)
        return time.perf_counter() - start

    rows = [["first compile of the process (loads the tokenizer)",
             f"{seconds(StructuredOutputsParams(regex='x')) * 1e3:.0f}", "-"]]
    for name, spec in SPECS.items():
        params = StructuredOutputsParams(**spec)
        rows.append([name, f"{seconds(params) * 1e3:.1f}", f"{seconds(params) * 1e6:.0f}"])
    return rows


def mask_rows(folder: Path, config: ModelConfig, grammar, batches: list[int], steps: int) -> list[list]:
    """`steps` decode steps of n rows, each at its own point of its document."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    docs = [tokenizer.encode(d, add_special_tokens=False).ids for d in documents(64)]
    masks, rows = GrammarMasks(config.vocab_size), []
    for n in batches:
        rng = random.Random(n)
        picked = [docs[i % len(docs)] for i in range(n)]
        starts = [rng.randrange(0, max(1, len(d) - steps)) for d in picked]
        states = [SimpleNamespace(matcher=grammar.matcher()) for _ in picked]
        for state, doc, start in zip(states, picked, starts):
            if not all(state.matcher.accept(token) for token in doc[:start]):
                raise SystemExit("a valid document was refused by its grammar")
        logits, fill, apply = torch.randn(n, config.vocab_size), [], []
        for step in range(steps):
            done = masks.start(states).result()
            fill.append(done.seconds)
            start = time.perf_counter()
            apply_bitmask(logits, done.bitmask)
            apply.append(time.perf_counter() - start)
            for state, doc, first in zip(states, picked, starts):
                state.matcher.accept(doc[first + step] if first + step < len(doc) else config.eos_token_ids[0])
        f, a = statistics.median(fill) * 1e3, statistics.median(apply) * 1e3
        rows.append([n, f"{f:.2f}", f"{max(fill) * 1e3:.2f}", f"{a:.2f}", f"{(f + a) * 1e3 / n:.1f}", f"{f + a:.2f}"])
    masks.shutdown()
    return rows


def valid(tokens: int, text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def mask_time(server, model: str) -> list[float]:
    """`model`'s grammar mask seconds so far, and the iterations they were counted over."""
    samples = server.metrics()
    return [metric_total(samples, f"orca_grammar_mask_seconds_{k}", model=model) for k in ("sum", "count")]


def served_rows(args, server, models: list[tuple[str, int, str]]) -> list[list]:
    """Each model at each mix: every k-th request under the schema (k from the mix)."""
    free = Ask.exact(args.tokens)
    constrained = Ask.of({"max_tokens": 3 * args.tokens, "structured_outputs": {"json": SCHEMA}}, valid)
    rows = []
    for model, streams, label in models:
        base = None
        for mix in MIXES:
            log(f"{label}: {streams} streams, {mix:.0%} constrained")
            before = mask_time(server, model)
            asks = [constrained] + [free] * (round(1 / mix) - 1) if mix else [free]
            result = TritonLoad(server.grpc_url, model, streams, asks).run(args.warmup, args.seconds)
            time.sleep(1.5)  # the model's metrics thread flushes
            (seconds, count), rate = [b - a for a, b in zip(before, mask_time(server, model))], result.tokens_per_second
            base = base or rate
            rows.append([label, streams, f"{mix:.0%}", f"{rate:,.0f}", f"{rate / base:.3f}" if base else "-",
                         f"{seconds / count * 1e3:.2f}" if count else "-", result.requests_done, result.wrong,
                         len(result.errors)])
    return rows


def main() -> None:
    p = options(__doc__, "structured.md")
    p.add_argument("--batches", default="1,8,32,256")
    p.add_argument("--steps", type=int, default=30, help="decode steps timed per batch size")
    p.add_argument("--tokens", type=int, default=64, help="tokens of a free request")
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=5.0)
    args = p.parse_args()
    r = Report("Structured outputs: mask cost and served throughput", "bench-structured")
    folder = prepare_default_model()
    config = ModelConfig.from_folder(folder)
    compiler = GrammarCompiler(folder, config.vocab_size, config.eos_token_ids)
    log("compiles and masks")
    r.add("## Compiles", "").table(["spec", "compile ms", "cache hit us"], compile_rows(compiler))
    masks = mask_rows(folder, config, compiler.compile(StructuredOutputsParams(json=SCHEMA)),
                      [int(b) for b in args.batches.split(",")], args.steps)
    r.add("## Masks: the JSON schema of the tests, each row at its own point of a valid document", "")
    r.table(["rows", "fill ms (median)", "fill ms (max)", "apply ms", "us per row", "ms per iteration"], masks)
    with work_dir("orca-structured-") as work:
        (work / "repo").mkdir()
        copy_model(work / "repo", "orca")
        for name, step in (("orca_null_10ms", "0.01"), ("orca_null_0ms", "0")):
            copy_model(work / "repo", "orca", name, engine="null", null_step_seconds=step, max_batch_size="256",
                       max_num_batched_tokens="8192", kv_cache_tokens=str(1 << 20))
        with serving(work, repository=work / "repo") as (server, _):
            served = served_rows(args, server, [("orca", 16, "default model"),
                                                ("orca_null_10ms", 256, "null runner, 10 ms step"),
                                                ("orca_null_0ms", 256, "null runner, instant")])
    r.section("Served: delivered tokens/s with a share of the requests under the schema",
              f"Closed loop, {args.warmup:g} s of warm-up then {args.seconds:g} s measured; a free request asks for "
              f"{args.tokens} tokens (ignore_eos), a constrained one for up to {3 * args.tokens} under the schema, "
              "ending where the JSON ends; invalid: outputs that are not exactly what was asked for.")
    r.table(["model", "streams", "constrained", "tokens/s", "ratio to 0%", "mask ms / iteration", "requests",
             "invalid", "errors"], served).setup().write(args.markdown)
    full = next((row for row in served if row[0] == "default model" and row[2] == "100%"), None)
    if full is not None:
        record(args.markdown, "bench-structured", {"structured": (
            "Structured outputs: the default model's tokens/s with every request under a JSON schema, against none "
            f"({full[1]} streams)", f"{full[4]}x (goal 0.95x), {full[7]} of {full[6]} outputs invalid")})


if __name__ == "__main__":
    main()
