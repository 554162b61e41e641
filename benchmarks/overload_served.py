"""The served half of `make bench-overload`: the default model on this machine's CPU behind a real
tritonserver and the OpenAI API, plain FCFS without a cap against our mechanisms, on the same
stepped Poisson load (as a share of the capacity measured first). Every request is its own
streamed HTTP request (`/v1/completions`), so a refusal (429) is timed from the client's send.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import numpy as np

from benchmarks.common import copy_model, log, work_dir
from benchmarks.servers import Frontend, Server
from client.trace import LengthDist, load_tokenizer, make_trace

DIST = LengthDist("lognormal", input_mean=96.0, output_mean=24.0)
STEPS = [(0.5, 20), (1.0, 20), (2.0, 20), (3.0, 5)]  # (load x capacity, seconds)
HIGH_SHARE = 0.3
BUDGET = 256  # max_num_batched_tokens of both models


@dataclass
class Outcome:
    arrival: float  # seconds from the run's start
    priority: int
    status: int = 0  # HTTP status; 0: the connection failed
    ttft: float | None = None
    tpot: float | None = None
    answered: float | None = None  # a refusal's seconds from send to answer
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, body: dict, out: Outcome) -> None:
    sent = time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                out.answered, out.error = time.monotonic() - sent, r.text[:200]
                return
            first, tokens = None, 0
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = event["error"]["message"]
                elif event.get("choices") and event["choices"][0].get("text") and first is None:
                    first = time.monotonic()
                elif event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            end = time.monotonic()
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
        return
    if first is not None:
        out.ttft, out.tpot = first - sent, (end - first) / max(1, tokens - 1)


async def _replay(url: str, model: str, requests: list, slo: tuple[float, float] | None) -> list[Outcome]:
    outcomes, tasks = [], []
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.monotonic()
        for offset, r, priority in requests:
            delay = t0 + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"model": model, "prompt": r.prompt, "max_tokens": r.output_tokens, "ignore_eos": True,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "priority": priority}
            if slo:
                body.update(slo_ttft_ms=slo[0], slo_tpot_ms=slo[1])
            out = Outcome(offset, priority)
            outcomes.append(out)
            tasks.append(asyncio.create_task(_one(client, url, body, out)))
        await asyncio.gather(*tasks)
    return outcomes


def stepped(steps: list[tuple[float, float]], seed: int) -> list:
    """(offset, trace request, priority) at each (rate, seconds) in turn."""
    tokenizer, rng, out, start = load_tokenizer(), np.random.default_rng(seed), [], 0.0
    for i, (rate, seconds) in enumerate(steps):
        n = max(1, rng.poisson(rate * seconds))
        for r in make_trace(DIST, n, rate, seed * 100 + i, tokenizer):
            if r.offset < seconds:
                out.append((start + r.offset, r, 0 if rng.random() < HIGH_SHARE else 1))
        start += seconds
    return out


def replay(url: str, model: str, requests: list, slo=None) -> list[Outcome]:
    return asyncio.run(_replay(url, model, requests, slo))


def run(seed: int) -> dict:
    """Capacity, the unloaded latencies, then both models on the stepped load."""
    with work_dir("orca-overload-") as work:
        repository = work / "models"
        copy_model(repository, "orca", "orca_fcfs", scheduling_policy="fcfs", preemption_victim="newest",
                   max_num_batched_tokens=str(BUDGET), max_batch_size="32")
        server = Server(work, repository, ["--model-control-mode=explicit", "--load-model=orca_fcfs"])
        with server:
            server.wait_ready()
            with Frontend(work, server.grpc_url) as frontend:
                frontend.wait_ready()
                return _measure(server, frontend, repository, seed)


def _measure(server: Server, frontend: Frontend, repository: Path, seed: int) -> dict:
    url = frontend.url
    replay(url, "orca_fcfs", stepped([(4.0, 2.0)], seed + 9))  # warm up
    burst = [(0.0, r, 1) for _, r, _ in stepped([(1000.0, 0.064)], seed)]
    t = time.monotonic()
    replay(url, "orca_fcfs", burst)
    peak = len(burst) / (time.monotonic() - t)
    log(f"served capacity: {peak:.2f} requests/s ({len(burst)} at once)")
    light = stepped([(0.1 * peak, 30)], seed + 1)
    quiet = [(o, r) for o, (_, r, _) in zip(replay(url, "orca_fcfs", light), light) if o.ttft is not None]
    quiet_ttft = float(np.percentile([o.ttft for o, _ in quiet], 99))
    quiet_tpot = float(np.percentile([o.tpot for o, _ in quiet], 99))
    slo = (2000 * quiet_ttft, 1500 * quiet_tpot)
    prefill_rate = float(np.median([r.input_tokens / o.ttft for o, r in quiet]))
    cap = max(BUDGET, int(0.5 * slo[0] / 1000 * prefill_rate))
    copy_model(repository, "orca", "orca_all", scheduling_policy="deadline", preemption_victim="least_waste",
               max_num_batched_tokens=str(BUDGET), max_batch_size="32", long_prefill_token_threshold="128",
               max_num_queued_tokens=str(cap), reject_infeasible="true")
    status, text = server.http("/v2/repository/models/orca_all/load", b"{}")
    if status != 200:
        raise SystemExit(f"loading orca_all failed: {text}")
    steps = [(load * peak, seconds) for load, seconds in STEPS]
    requests = stepped(steps, seed + 2)
    results = {}
    for model in ("orca_fcfs", "orca_all"):
        replay(url, model, stepped([(4.0, 1.0)], seed + 9))  # warm (the new model's first iterations)
        results[model] = replay(url, model, requests, slo)
        log(f"{model}: {sum(o.status == 429 for o in results[model])} refused of {len(requests)}")
    return {"peak": peak, "quiet_ttft": quiet_ttft, "quiet_tpot": quiet_tpot, "slo": slo, "cap": cap,
            "prefill_rate": prefill_rate, "results": results, "num_requests": len(requests)}


def step_rows(outcomes: list[Outcome], slo) -> list[dict]:
    rows, start = [], 0.0
    for load, seconds in STEPS:
        mine = [o for o in outcomes if start <= o.arrival < start + seconds]
        served = [o for o in mine if o.ttft is not None and o.error is None]
        good = [o for o in served if o.ttft * 1000 <= slo[0] and o.tpot * 1000 <= slo[1]]
        rows.append({"load": load, "goodput": len(good) / seconds,
                     "p99_ttft": float(np.percentile([o.ttft for o in served], 99)) if served else float("nan"),
                     "refused": sum(o.status == 429 for o in mine), "n": len(mine),
                     "late_ttft": sum(o.ttft * 1000 > slo[0] for o in served),
                     "late_tpot": sum(o.tpot * 1000 > slo[1] for o in served),
                     "failed": sum(o.status not in (200, 429) or (o.status == 200 and o.error is not None)
                                   for o in mine)})
        start += seconds
    return rows


def goal_lines(run: dict) -> list[str]:
    """The issue's goals, as this run measured them."""
    slo, lines = run["slo"], []
    for model, outcomes in run["results"].items():
        rows = step_rows(outcomes, slo)
        best = max(r["goodput"] for r in rows)
        lines.append(f"- {model}: goodput at 2x {rows[2]['goodput']:.2f} requests/s, {rows[2]['goodput'] / best:.0%} "
                     f"of its best ({best:.2f}; goal >= 90%); admitted p99 TTFT at 2x "
                     f"{rows[2]['p99_ttft'] / run['quiet_ttft']:.1f}x the unloaded p99 (goal <= 2x)")
        saturated = [o for o in outcomes if STEPS[0][1] <= o.arrival < STEPS[0][1] + STEPS[1][1] + STEPS[2][1]
                     and o.ttft is not None]
        high, low = (np.median([o.ttft for o in saturated if o.priority == p] or [np.nan]) for p in (0, 1))
        refused = [o.answered * 1000 for o in outcomes if o.status == 429]
        lines.append(f"- {model}, 1x to 2x: median TTFT of priority 0 {high * 1000:.0f} ms, of priority 1 "
                     f"{low * 1000:.0f} ms: {low / high:.1f}x lower (goal >= 3x); refusals answered within 5 ms of "
                     f"the client's send: " + (f"{np.mean(np.array(refused) <= 5):.0%}" if refused else "none refused"))
    return lines
