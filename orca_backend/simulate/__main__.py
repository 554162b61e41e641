"""Simulate a deployment under Poisson load: our scheduler in virtual time over a cost model.

    python -m orca_backend.simulate --model llama-3-70b --hardware h200 --tp 8 --bound-ms 50
    python -m orca_backend.simulate --model gpt3-175b --hardware a100-40gb --tp 8 --pp 2 \\
        --max-inflight 2 --policy reserve --rates 1,2,4,8 --bound-ms 200
    python -m orca_backend.simulate --model gpt3-175b --hardware a100-40gb --tp 8 --pp 2 \\
        --batching request --padding --policy reserve --max-batch-size 8 --max-num-batched-tokens 4096 \
        --rates 0.25,0.5,1 --bound-ms 200

`--model` is a folder with a config.json or one of the bundled shapes (gpt3-175b, llama-3-70b,
llama-3-8b); `--hardware` a preset (a100-40gb, h100, h200) or `cpu` with `--calibration`, the
file the CPU profile writes. The trace options are `client.bench`'s, drawn by the same code:
with `--dist orca`, each rate gets exactly the requests `make bench` sends at it. Prints one row per rate and the
highest rate sustained under the bounds; `--json` writes them too, `--iterations` every
simulated iteration (its start and end, requests, tokens and padding). Bad input (an unknown
preset, a config.json without a field the model needs, a layout whose weights do not fit, a
K/V pool too small for one request) is refused before anything runs, with exit status 2.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
from pathlib import Path

from ..checkpoint.config import ModelConfig
from ..core.config import BATCHING_MODES, POLICIES, SchedulerConfig
from ..core.errors import ConfigError
from .cost_model import DTYPE_BYTES, CostModel, Layout
from .hardware import PRESETS, load_hardware
from .loop import Simulation, SimulatedIteration
from .sweep import Deployment, describe, sweep, sustained_rate
from .traces import swept_traces
from .workload import add_trace_arguments

MODELS_DIR = Path(__file__).resolve().parent / "models"


def load_model(name: str) -> ModelConfig:
    """A bundled shape by name, else a folder with a config.json."""
    folder = MODELS_DIR / name if (MODELS_DIR / name / "config.json").exists() else Path(name)
    if not folder.is_dir():
        known = sorted(p.name for p in MODELS_DIR.iterdir() if p.is_dir())
        raise ConfigError(f"model {name!r} is neither a folder nor a bundled shape ({', '.join(known)})")
    return ModelConfig.from_folder(folder)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m orca_backend.simulate", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b", help="a folder with config.json, or a bundled shape")
    p.add_argument("--hardware", default="h200", help=f"{', '.join(PRESETS)} or cpu")
    p.add_argument("--calibration", type=Path, help="cpu: the calibration file the profile wrote")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPE_BYTES))
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--policy", default="paged", choices=POLICIES)
    p.add_argument("--batching", default="iteration", choices=BATCHING_MODES)
    p.add_argument("--padding", action="store_true",
                   help="request-level batches padded as FasterTransformer runs them (--batching request)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="--padding: each batch split into this many through the pipeline stages")
    p.add_argument("--max-inflight", type=int, default=1, help="iterations in flight (pipeline stages)")
    p.add_argument("--kv-tokens", type=int, help="the K/V pool in tokens (default: what fits beside the weights)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on, except with --padding (FasterTransformer has no prefix cache)")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="comma-separated request rates")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    p.add_argument("--min-requests", type=int, default=50)
    p.add_argument("--num-requests", type=int, help="requests per rate (default: rate x duration)")
    p.add_argument("--bound-ms", type=float, default=math.inf, help="median normalized latency bound, ms/token")
    p.add_argument("--ttft-bound-ms", type=float, default=math.inf, help="median time-to-first-token bound, ms")
    p.add_argument("--json", type=Path, help="write every rate's summary here")
    p.add_argument("--iterations", type=Path, help="write every simulated iteration here (CSV, one row each)")
    add_trace_arguments(p)
    return p


def deployment(args: argparse.Namespace) -> Deployment:
    """Everything the options describe, checked: the first refusal names what is wrong."""
    hardware = load_hardware(args.hardware, args.calibration)
    cost = CostModel(load_model(args.model), hardware, Layout(args.tp, args.pp), args.dtype)
    scheduler = SchedulerConfig(max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
                                policy=args.policy, batching=args.batching, max_inflight=args.max_inflight)
    for name in ("block_size", "min_requests", "duration", "num_requests"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.kv_tokens is not None and args.kv_tokens < args.block_size:
        raise ConfigError(f"--kv-tokens {args.kv_tokens} is less than one block of {args.block_size}")
    num_blocks = args.kv_tokens // args.block_size if args.kv_tokens is not None else None
    caching = not args.padding if args.prefix_caching is None else args.prefix_caching
    dep = Deployment(cost, scheduler, num_blocks, args.block_size, caching, args.padding, args.micro_batches)
    Simulation(cost, scheduler, dep.num_blocks, dep.block_size, caching, args.padding, args.micro_batches)  # refusals
    return dep


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        rates = sorted(float(r) for r in args.rates.split(","))
        if not rates or rates[0] <= 0:
            raise ValueError
    except ValueError:
        print(f"error: --rates must be positive numbers, comma-separated, got {args.rates!r}", file=sys.stderr)
        return 2
    try:
        dep = deployment(args)
        traces = swept_traces(args, rates, args.duration, args.min_requests, args.num_requests)
        points = sweep(args.model, dep, traces, args.bound_ms / 1e3)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cost = dep.cost
    print(f"{args.model} on {cost.layout.num_devices} x {cost.hw.name} (tensor parallel {args.tp}, "
          f"{args.pp} stage(s)), {dep.num_blocks * dep.block_size} tokens of K/V"
          f"{'' if cost.hw.calibrated else '; efficiency factors uncalibrated'}")
    header = ("rate", "req/s", "tok/s", "norm p50 ms", "norm p99 ms", "TTFT p50 ms", "batch", "preempt")
    print("  ".join(f"{h:>11}" for h in header))
    for p in points:
        s = p.summary
        cells = (f"{p.rate:g}", f"{s.request_throughput:.2f}", f"{s.token_throughput:.0f}",
                 f"{s.normalized_latency_p50 * 1e3:.1f}", f"{s.normalized_latency_p99 * 1e3:.1f}",
                 f"{s.ttft_p50 * 1e3:.0f}", f"{s.mean_batch:.1f}", f"{s.num_preemptions}")
        print("  ".join(f"{c:>11}" for c in cells))
    headline = {}
    for metric, bound in (("normalized_latency_p50", args.bound_ms), ("ttft_p50", args.ttft_bound_ms)):
        if math.isfinite(bound):
            headline[metric] = sustained_rate(points, metric, bound / 1e3)
            print(f"sustained with median {metric.removesuffix('_p50').replace('_', ' ')} under "
                  f"{bound:g} ms: {describe(*headline[metric])} req/s")
    if args.iterations:
        with open(args.iterations, "w", newline="") as f:
            fields = [f.name for f in dataclasses.fields(SimulatedIteration)]
            writer = csv.writer(f)
            writer.writerow(["rate", *fields])
            for p in points:
                writer.writerows([p.rate, *(getattr(i, name) for name in fields)] for i in p.iterations)
    if args.json:
        args.json.write_text(json.dumps({"rates": [{"rate": p.rate, **dataclasses.asdict(p.summary)}
                                                   for p in points], "sustained": headline}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
