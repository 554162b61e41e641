"""The `cpu` hardware preset: a short profile of our real engine on this machine, and the fit.

Measures the machine's read bandwidth and fp32 GEMM peak (bench_cpu's figures), then times
every iteration of the engine (the served model's defaults: SmolLM2-135M, fp32, inline
executor, max_batch_size 32, 512 batched tokens) on prefills of 1 to 8 prompts and on decodes
at batch 1 to 32, recording each iteration's rows as the scheduler sent them. The efficiency
factors and the per-iteration overhead are fitted to those (`simulate.calibrate.fit`), and
checked on held-out iterations: the quick serving trace's requests, all queued at once, so
that prefill chunks and decodes mix as they do under load.

    python benchmarks/profile_cpu.py --out docs/benchmarks/simulation_cpu.json \\
        --samples docs/benchmarks/simulation_profile.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from benchmarks.bench_cpu import machine_limits  # noqa: E402
from benchmarks.report import log  # noqa: E402
from client.trace import LengthDist, load_tokenizer, make_trace  # noqa: E402
from orca_backend import LLM, SamplingParams  # noqa: E402
from orca_backend.checkpoint.config import ModelConfig  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.simulate.calibrate import Sample, errors, fit, write_hardware  # noqa: E402
from orca_backend.simulate.cost_model import Rows  # noqa: E402
from orca_backend.simulate.hardware import GIB, Hardware  # noqa: E402

PREFILLS = [(1, 16), (1, 64), (1, 128), (1, 512), (2, 64), (4, 32), (4, 128), (8, 64)]  # (batch, prompt)
DECODE_BATCHES = (1, 4, 8, 16, 32)
DECODE_PROMPT, DECODE_STEPS = 32, 10
REPEATS = 3


def timed_iterations(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[Sample]:
    """Every iteration of one generate: its rows (from the scheduler's message) and seconds
    (the engine's step, which with one iteration in flight is one iteration)."""
    engine = llm.engine
    sent = []
    submit = engine.executor.submit
    engine.executor.submit = lambda message: (sent.append(message), submit(message))[1]
    try:
        for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
            engine.add_request(f"p{time.monotonic_ns()}-{i}", prompt,
                               SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        samples = []
        while engine.has_unfinished_requests():
            before = len(sent)
            start = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - start
            for message in sent[before:]:
                rows = tuple(Rows(s.num_computed_tokens, s.num_scheduled_tokens) for s in message.scheduled)
                if rows:
                    samples.append(Sample(rows, sum(s.sample for s in message.scheduled), seconds))
    finally:
        engine.executor.submit = submit
    return samples


def repeated(llm: LLM, prompts, max_tokens) -> list[Sample]:
    """The median of REPEATS runs, iteration by iteration (the same rows each time)."""
    runs = [timed_iterations(llm, prompts, max_tokens) for _ in range(REPEATS)]
    assert all([s.rows for s in r] == [s.rows for s in runs[0]] for r in runs), "the repeats differ"
    return [Sample(first.rows, first.num_sampled, statistics.median(r[i].seconds for r in runs))
            for i, first in enumerate(runs[0])]


def windows(ids: list[int], n: int, length: int, seed: int) -> list[list[int]]:
    cycled = ids * (1 + (length * n) // len(ids) + 1)
    return [cycled[(seed * 97 + i * 131) % len(ids):][:length] for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the calibration file (hardware fields)")
    p.add_argument("--samples", type=Path, required=True, help="every timed iteration, fit and held out")
    p.add_argument("--refit", action="store_true", help="fit again from --samples, without profiling")
    args = p.parse_args()
    if args.refit:
        raw = json.loads(args.samples.read_text())
        model = ModelConfig.from_folder(prepare_default_model())
        report(model, Hardware(**raw["base"]), [Sample.from_json(s) for s in raw["fit"]],
               [Sample.from_json(s) for s in raw["held_out"]], args.out)
        return
    bandwidth, peak = machine_limits()
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 GEMM peak {peak / 1e9:.0f} GFLOP/s")
    tokenizer = load_tokenizer()
    ids = tokenizer.encode(" ".join(["The harbour town woke slowly on winter mornings."] * 200),
                           add_special_tokens=False).ids
    # No prefix caching: the repeats send the same prompts, and must compute the same rows.
    llm = LLM(enable_prefix_caching=False)
    model = ModelConfig.from_folder(llm.model_path)
    llm.generate(windows(ids, 4, 64, 0), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    fit_samples = []
    for batch, length in PREFILLS:
        fit_samples += repeated(llm, windows(ids, batch, length, batch), [1] * batch)
    for batch in DECODE_BATCHES:
        fit_samples += repeated(llm, windows(ids, batch, DECODE_PROMPT, batch), [DECODE_STEPS] * batch)
    log(f"{len(fit_samples)} iterations profiled")
    trace = make_trace(LengthDist(kind="orca", scale=0.25), 40, 2.0, 0, tokenizer)
    held_out = repeated(llm, [tokenizer.encode(r.prompt, add_special_tokens=False).ids for r in trace],
                        [r.output_tokens for r in trace])
    llm.shutdown()
    base = Hardware("cpu", peak, bandwidth, 24 * GIB, 1, bandwidth, 0.0, bandwidth, 0.0)
    args.samples.write_text(json.dumps({
        "torch_threads": torch.get_num_threads(), "model": str(llm.model_path.name),
        "base": dataclasses.asdict(base), "fit": [s.as_json() for s in fit_samples],
        "held_out": [s.as_json() for s in held_out]}) + "\n")
    report(model, base, fit_samples, held_out, args.out)


def report(model: ModelConfig, base: Hardware, fit_samples: list[Sample], held_out: list[Sample],
           out: Path) -> None:
    hw = fit(model, base, fit_samples)
    write_hardware(out, hw)
    fit_err, held_err = errors(model, hw, fit_samples), errors(model, hw, held_out)
    log(f"fitted: compute {hw.compute_efficiency:.2f}, bandwidth {hw.bandwidth_efficiency:.2f}, "
        f"overhead {hw.iteration_overhead_seconds * 1e3:.1f} ms + {hw.row_overhead_seconds * 1e3:.2f} ms "
        f"a request; mean |error| fit {abs(fit_err).mean():.1%}, held out {abs(held_err).mean():.1%} "
        f"(mean {held_err.mean():+.1%})")


if __name__ == "__main__":
    main()
