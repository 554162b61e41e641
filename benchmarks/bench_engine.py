"""Benchmark orca_backend against Hugging Face transformers on the default model (fp32).

Runs in one process, side by side, and prints markdown tables:

1. Decode throughput: B greedy requests of equal length (prompt `--prompt-tokens`, output
   `--max-tokens`, ignore_eos) through `LLM.generate` and through `model.generate` on one
   static batch. Reported as generated tokens/s and the ratio ours / transformers.
2. Varying output lengths: 2 x 32 requests whose max_tokens are drawn uniformly from
   [1, M]. Our engine gets them all at once (max_batch_size 32, so finished requests are
   retired and waiting ones admitted every iteration); transformers runs static batches of
   32 in arrival order, each to its longest request, and only each request's own max_tokens
   count as useful output. Our engine with batching="request" runs the same requests.
3. Engine overhead at each batch size of part 1: the share of `LLMEngine.step` spent outside
   the model forward (scheduling, metadata, sampling, detokenizing), and the share of the
   whole `generate` spent outside `step` (LLM.generate's own loop).

4. The serving benchmark's trace offline: 64 requests of `make bench`'s ORCA trace (prompt and
   output lengths both vary; `--trace-scale` as its `--scale`) given all at once, run as part 2.
5. The executor boundary: part 1's workload at batch 1 and 32 with the runner inline and in a
   child process (`executor="process"`, also with two iterations in flight of half the batch
   each): time per iteration, the share outside the model forward, and the bytes of the
   messages per iteration. `--executors-only` runs this part alone.

Wall times include prefill for both systems. Usage: python benchmarks/bench_engine.py [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

# `python benchmarks/bench_engine.py` puts benchmarks/ on the path, not the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import cpu_name, log, table  # noqa: E402
from client.trace import LengthDist, load_tokenizer, make_trace  # noqa: E402
from orca_backend import LLM, SamplingParams  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402

# Real English text, so prompts look like ordinary input rather than random token ids.
TEXT = (
    "The history of computing is a story of abstractions built on top of one another. Early "
    "machines were programmed by rewiring panels and flipping switches, and every program was "
    "tied to the exact hardware it ran on. The invention of stored programs changed that: "
    "instructions became data, and a machine could load a new task as easily as it loaded new "
    "numbers. Assemblers gave names to instructions, compilers translated whole languages into "
    "machine code, and operating systems shared one computer among many users who never saw "
    "each other. Each layer hid details from the layer above while adding costs of its own, and "
    "engineers have argued ever since about when those costs are worth paying. Networks then "
    "joined computers into systems that no single person could see in full. A request typed in "
    "one city might be served by a machine on another continent, passing through routers, "
    "caches and queues along the way. Making such systems fast meant measuring them carefully: "
    "where does the time go, which resource is the bottleneck, and what happens when the load "
    "doubles? The answers were rarely obvious, and intuition was often wrong. Today the same "
    "questions are asked about serving large language models. A model answers one token at a "
    "time, each step reading every weight from memory, so serving many users together is the "
    "only way to keep the hardware busy. How requests are grouped, when new ones may join, and "
    "how their memory is managed decide whether a server answers thousands of users or dozens."
)
VARY_BATCH = 32  # batch size of part 2 (our max_batch_size, transformers' static batch)
VARY_REQUESTS = 2 * VARY_BATCH  # more requests than fit, so our scheduler must admit late ones


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8,32,64", help="comma-separated, part 1 and 3")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="batch sizes 1,8,32 and max_tokens 32")
    p.add_argument("--trace-scale", type=float, default=0.25,
                   help="part 4: scale of the ORCA trace's length ranges")
    p.add_argument("--markdown", type=Path, help="also write the tables to this file")
    p.add_argument("--executors-only", action="store_true", help="part 5 alone (no transformers)")
    # Best of several runs: on a shared machine the fastest run is the one least disturbed.
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; best kept")
    args = p.parse_args()
    if args.quick:
        args.batch_sizes, args.max_tokens = "1,8,32", 32
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    return args


def machine_facts(started: datetime.datetime, load_at_start: float, repeats: int) -> list[str]:
    return [f"- date: {started.isoformat(timespec='seconds')}",
            f"- CPU: {cpu_name()}", f"- torch {torch.__version__}, threads {torch.get_num_threads()}",
            f"- transformers {transformers.__version__}, python {platform.python_version()}",
            # Other work on the machine slows both systems; the load average shows if it was busy.
            f"- load average (1 min): {load_at_start:.2f} at start, "
            f"{os.getloadavg()[0]:.2f} at end",
            f"- each time is the best of {repeats} runs after a warm-up"]


def make_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n different windows of TEXT, each exactly `length` tokens."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    starts = len(ids) - length
    if starts < n:
        raise SystemExit(f"TEXT has {len(ids)} tokens: too short for {n} distinct prompts")
    stride = max(1, starts // n)  # spread the windows so prompts overlap as little as possible
    return [ids[(i * stride) % starts:(i * stride) % starts + length] for i in range(n)]


def new_llm(max_batch_size: int, max_tokens: int, prompt_len: int, **options) -> LLM:
    # Prefill of a whole batch fits one iteration, as in transformers' single prefill forward;
    # the K/V pool is sized to the work so several engines fit in memory at once.
    return LLM(max_batch_size=max_batch_size,
               max_num_batched_tokens=max(512, max_batch_size * prompt_len),
               kv_cache_tokens=max_batch_size * (prompt_len + max_tokens) + 1024, **options)


def run_ours(llm: LLM, prompts: list[list[int]], max_tokens: list[int], repeats: int) -> dict:
    """Warm up, then time `repeats` generates; keep the fastest with its engine counters."""
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine, best = llm.engine, None
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    for _ in range(repeats):
        engine.stats.step_seconds, engine.stats.forward_seconds = 0.0, 0.0
        iters_before = engine.stats.num_iterations
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        if best is None or wall < best["wall"]:
            best = {"wall": wall, "tokens": [o.token_ids for o in outs],
                    "step": engine.stats.step_seconds, "forward": engine.stats.forward_seconds,
                    "iters": engine.stats.num_iterations - iters_before}
    return best


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new: int, pad_id: int) -> list[list[int]]:
    # Prompts of unequal length are left-padded and masked, as transformers expects for
    # batched generation. min_new_tokens plays the part of ignore_eos.
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id)
    return out[:, width:].tolist()


def run_hf(model, prompts: list, max_tokens: list[int], batch: int, pad_id: int,
           repeats: int) -> dict:
    """Static batches of `batch` in arrival order, each run to its longest request."""
    hf_generate(model, prompts[:batch], 2, pad_id)  # warm-up at the same batch size
    groups = [slice(i, i + batch) for i in range(0, len(prompts), batch)]
    best = None
    for _ in range(repeats):
        start, tokens = time.perf_counter(), []
        for g in groups:
            out = hf_generate(model, prompts[g], max(max_tokens[g]), pad_id)
            tokens += [t[:m] for t, m in zip(out, max_tokens[g])]  # only these are useful
        wall = time.perf_counter() - start
        if best is None or wall < best["wall"]:
            best = {"wall": wall, "tokens": tokens}
    best["computed"] = sum(max(max_tokens[g]) * len(max_tokens[g]) for g in groups)
    return best


def bench_fixed(args, model, tokenizer, pad_id: int) -> tuple[list, list]:
    """Parts 1 and 3: equal-length requests at each batch size."""
    M, P = args.max_tokens, args.prompt_tokens
    llm = new_llm(max(args.batch_sizes), M, P)
    speed, overhead = [], []
    for B in args.batch_sizes:
        prompts = make_prompts(tokenizer, B, P)
        ours = run_ours(llm, prompts, [M] * B, args.repeats)
        hf = run_hf(model, prompts, [M] * B, B, pad_id, args.repeats)
        ours_rate = sum(map(len, ours["tokens"])) / ours["wall"]
        hf_rate = sum(map(len, hf["tokens"])) / hf["wall"]
        same = sum(a == b for a, b in zip(ours["tokens"], hf["tokens"]))
        speed.append([B, sum(map(len, ours["tokens"])), f"{ours_rate:.1f}", f"{hf_rate:.1f}",
                      f"{ours_rate / hf_rate:.2f}x", f"{same}/{B}"])
        overhead.append([B, ours["iters"], f"{ours['wall']:.2f}", f"{ours['step']:.2f}",
                         f"{ours['forward']:.2f}", pct(1 - ours["forward"] / ours["step"]),
                         pct(1 - ours["step"] / ours["wall"])])
        log(f"  B={B}: ours {ours_rate:.1f} tok/s, transformers {hf_rate:.1f} tok/s")
    del llm
    return speed, overhead


def bench_varying(args, model, tokenizer, pad_id: int) -> list:
    """Part 2: random output lengths; useful tokens only."""
    M, P = args.max_tokens, args.prompt_tokens
    max_tokens = np.random.default_rng(0).integers(1, M + 1, size=VARY_REQUESTS).tolist()
    return compare_batching(model, make_prompts(tokenizer, VARY_REQUESTS, P), max_tokens, pad_id,
                            args.repeats)


def bench_trace(args, model, tokenizer, pad_id: int) -> tuple[list, list]:
    """Part 4: the serving benchmark's ORCA trace (scaled lengths), all requests at once."""
    trace = make_trace(LengthDist(kind="orca", scale=args.trace_scale), VARY_REQUESTS, None, 0,
                       load_tokenizer())
    prompts = [tokenizer(r.prompt, add_special_tokens=False)["input_ids"] for r in trace]
    return prompts, compare_batching(model, prompts, [r.output_tokens for r in trace], pad_id,
                                     args.repeats)


def compare_batching(model, prompts: list, max_tokens: list[int], pad_id: int, repeats: int) -> list:
    """Our engine iteration- and request-level vs transformers' static batches, same requests."""
    useful, rows, longest = sum(max_tokens), [], max(map(len, prompts))
    for batching in ("iteration", "request"):
        label = f"ours, {batching}-level"
        llm = new_llm(VARY_BATCH, max(max_tokens), longest, batching=batching)
        r = run_ours(llm, prompts, max_tokens, repeats)
        del llm
        made = sum(map(len, r["tokens"]))
        rows.append([label, made, made, r["iters"], f"{made / r['iters']:.1f}", r["wall"]])
        log(f"  {label}: {made / r['wall']:.1f} useful tok/s")
    hf = run_hf(model, prompts, max_tokens, VARY_BATCH, pad_id, repeats)
    rows.append(["transformers, static", sum(map(len, hf["tokens"])), hf["computed"], "-", "-",
                 hf["wall"]])
    hf_rate = useful / hf["wall"]
    return [row[:-1] + [f"{row[-1]:.2f}", f"{row[1] / row[-1]:.1f}",
                        f"{row[1] / row[-1] / hf_rate:.2f}x"] for row in rows]


def bench_executors(args, tokenizer) -> list:
    """Part 5: the same decode workload through each executor; per-iteration figures."""
    M, P, rows = args.max_tokens, args.prompt_tokens, []
    for B in (1, 32):
        prompts = make_prompts(tokenizer, B, P)
        variants = [("inline", 1, {}), ("process", 1, {"executor": "process"})]
        if B > 1:
            variants.append(("process, 2 in flight", 2, {"executor": "process", "max_inflight": 2}))
        inline_outside = None
        for label, inflight, options in variants:
            with LLM(max_batch_size=B // inflight, max_num_batched_tokens=max(512, B * P),
                     kv_cache_tokens=B * (P + M) + 1024, **options) as llm:
                r = run_ours(llm, prompts, [M] * B, args.repeats)
                sent, got = message_bytes(llm, prompts, M)
            ms, fwd_ms = 1000 * r["step"] / r["iters"], 1000 * r["forward"] / r["iters"]
            # The forward itself varies by a few percent from run to run on a shared machine,
            # so the executor's cost is read from the time outside it.
            inline_outside = ms - fwd_ms if inline_outside is None else inline_outside
            rows.append([B, label, r["iters"], f"{ms:.2f}", f"{fwd_ms:.2f}", f"{ms - fwd_ms:.2f}",
                         pct(1 - r["forward"] / r["step"]), f"{ms - fwd_ms - inline_outside:+.2f}",
                         f"{sent:.0f}", f"{got:.0f}", f"{sum(map(len, r['tokens'])) / r['wall']:.1f}"])
            log(f"  B={B} {label}: {ms:.2f} ms/iteration, forward {fwd_ms:.2f} ms")
    return rows


def message_bytes(llm: LLM, prompts: list, max_tokens: int) -> tuple[float, float]:
    """Mean encoded size of the SchedulerOutput and RunnerOutput per iteration, one more run."""
    from orca_backend.core.messages import encode

    executor, sizes = llm.engine.executor, []
    submit = executor.submit

    def recording(message):
        future = submit(message)
        future.add_done_callback(lambda f: sizes.append((len(encode(message)), len(encode(f.result())))))
        return future

    executor.submit = recording
    try:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        del executor.submit
    return sum(s for s, _ in sizes) / len(sizes), sum(g for _, g in sizes) / len(sizes)


EXECUTOR_HEADER = ["batch", "executor", "iterations", "ms/iteration", "forward ms", "outside forward ms",
                   "outside share", "outside vs inline ms", "bytes sent", "bytes back", "tok/s"]


def pct(x: float) -> str:
    return f"{100 * x:.2f}%"  # two decimals: the shares outside the forward are small


def main() -> None:
    args = parse_args()
    load_at_start, started = os.getloadavg()[0], datetime.datetime.now()
    transformers.logging.set_verbosity_error()  # generation-config notices would bury the tables
    folder = prepare_default_model()  # the folder LLM() loads by default
    tokenizer = AutoTokenizer.from_pretrained(folder)
    M, P = args.max_tokens, args.prompt_tokens
    part5 = [f"## 5. The executor boundary (prompt {P} tokens, {M} output tokens, greedy; per iteration)",
             "", "Decode iterations of part 1's workload. `process`: the runner in a child process, "
             "messages over pipes; `2 in flight`: two iterations of half the batch each are out at "
             "once. Forward: the runner's model forward; outside: everything else of a step (scheduling, the "
             "messages, the pipes, sampling, detokenizing). Bytes are the encoded SchedulerOutput and "
             "RunnerOutput, mean per iteration.", ""]
    if args.executors_only:
        log("measuring the executors ...")
        out = ["# orca_backend executors, SmolLM2-135M-Instruct fp32 CPU", "",
               *machine_facts(started, load_at_start, args.repeats), "",
               *part5, *table(EXECUTOR_HEADER, bench_executors(args, tokenizer)), ""]
        print("\n".join(out))
        if args.markdown:
            args.markdown.write_text("\n".join(out))
        return
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    pad_id = tokenizer.pad_token_id
    pad_id = tokenizer.eos_token_id if pad_id is None else pad_id  # in case a model sets none
    log("measuring equal-length batches ...")
    speed, overhead = bench_fixed(args, model, tokenizer, pad_id)
    log("measuring varying output lengths ...")
    varying = bench_varying(args, model, tokenizer, pad_id)
    log("measuring the ORCA trace ...")
    trace_prompts, traced = bench_trace(args, model, tokenizer, pad_id)
    log("measuring the executors ...")
    executors = bench_executors(args, tokenizer)
    (lo_in, hi_in), (lo_out, hi_out) = LengthDist(kind="orca", scale=args.trace_scale).orca_bounds()
    facts = machine_facts(started, load_at_start, args.repeats)
    out = ["# orca_backend vs transformers, SmolLM2-135M-Instruct fp32 CPU", "", *facts, "",
           f"## 1. Decode throughput (prompt {P} tokens, {M} output tokens, greedy, ignore_eos)",
           "", *table(["batch", "tokens", "ours tok/s", "transformers tok/s", "ours/transformers",
                       "same greedy output"], speed),
           "", f"## 2. Varying output lengths ({VARY_REQUESTS} requests, max_tokens uniform in "
           f"[1, {M}], batch {VARY_BATCH}, prompt {P} tokens)", "",
           *table(["system", "useful tokens", "computed tokens", "iterations", "tokens/iteration",
                   "wall s", "useful tok/s", "vs transformers"], varying),
           "", "## 3. Our engine's time outside the model forward (runs of part 1)", "",
           *table(["batch", "iterations", "generate s", "step s", "forward s",
                   "step outside forward", "generate outside step"], overhead),
           "", f"## 4. The ORCA trace offline ({len(trace_prompts)} requests of `make bench`'s "
           f"trace: prompts {min(map(len, trace_prompts))}-{max(map(len, trace_prompts))} tokens "
           f"(drawn from [{lo_in}, {hi_in}]), max_tokens uniform in [{lo_out}, {hi_out}], "
           f"batch {VARY_BATCH}, all at once)", "",
           *table(["system", "useful tokens", "computed tokens", "iterations", "tokens/iteration",
                   "wall s", "useful tok/s", "vs transformers"], traced), "",
           *part5, *table(EXECUTOR_HEADER, executors), ""]
    print("\n".join(out))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(out))


if __name__ == "__main__":
    main()
