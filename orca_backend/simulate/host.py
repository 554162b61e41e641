"""Where the host becomes the limit: decode iterations of a batch on a device (the cost model)
against what the serving process spends on them, as `make bench-host` measured it.

    python -m orca_backend.simulate.host [--model llama-3-8b --hardware h200 --context 1024]

The host's costs, per iteration: a fixed part and a part per request on the engine thread
(schedule, message, update, finish rules, detokenize), and the sender's part per token
(responses, metrics). Both share the stub's one GIL, so they add up on one core. Without
async scheduling the engine thread's part runs in series with the device's; with it, the two
overlap, and an iteration takes the longer of the two. `BEFORE` is the serving path as it was
(a response per token, five metric calls and a send each, nothing overlapped), `AFTER` as it
is; each names the run its figures come from.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .cost_model import CostModel, Layout, Rows
from .hardware import PRESETS


@dataclass(frozen=True, slots=True)
class HostCosts:
    name: str
    iteration_seconds: float  # the engine thread's, per iteration
    request_seconds: float  # the engine thread's, per request in it
    token_seconds: float  # the sender's (and the metrics'), per token delivered
    overlapped: bool  # async scheduling: the engine's work overlaps the device's
    source: str

    def host_seconds(self, batch: int) -> float:
        """One core's time for one iteration of `batch` decoding requests."""
        return self.iteration_seconds + batch * (self.request_seconds + self.token_seconds)

    def period_seconds(self, batch: int, device_seconds: float) -> float:
        engine = self.iteration_seconds + batch * self.request_seconds
        if self.overlapped:
            return max(device_seconds, self.host_seconds(batch))
        # In series with the device; the sender's share runs beside it, on the same core.
        return max(device_seconds + engine, self.host_seconds(batch))


# CPU per delivered token from `make bench-host` (2 cores of an AMD EPYC), 256 streams:
BEFORE = HostCosts("before", 0.2e-3, 14e-6, 360e-6, False,
                   "the stub's sender thread, 256 streams with an instant runner, before these changes "
                   "(362 us a token); the engine thread's 13-15 us a request an iteration, offline")
AFTER = HostCosts("after", 0.2e-3, 15e-6, 11e-6, True,
                  "the stub's engine (15 us) and sender plus metrics threads (11 us) a token, "
                  "256 streams with a 10 ms step (docs/benchmarks/host.md)")


def decode_device_seconds(model: CostModel, batch: int, context: int) -> float:
    """The device's time for one decode iteration of `batch` requests, each after `context`
    tokens (no host overhead: the presets carry none)."""
    rows = [Rows(context, 1)] * batch
    return sum(model.stage_seconds(s, rows, batch) for s in range(model.layout.pipeline_stages))


def table(model: CostModel, batches: list[int], context: int, costs=(BEFORE, AFTER)) -> list[list]:
    """Per batch: device ms, and per host model its host ms, iteration ms and tokens/s."""
    rows = []
    for batch in batches:
        device = decode_device_seconds(model, batch, context)
        row = [batch, f"{device * 1e3:.2f}", f"{batch / device:,.0f}"]
        for c in costs:
            period = c.period_seconds(batch, device)
            row += [f"{c.host_seconds(batch) * 1e3:.2f}", f"{batch / period:,.0f}",
                    "host" if c.host_seconds(batch) > device else "device"]
        rows.append(row)
    return rows


def host_limit(model: CostModel, costs: HostCosts, context: int, largest: int = 4096) -> int | None:
    """The smallest batch whose host time passes the device's, None up to `largest`."""
    for batch in range(1, largest + 1):
        if costs.host_seconds(batch) > decode_device_seconds(model, batch, context):
            return batch
    return None


def main(argv: list[str] | None = None) -> None:
    from .__main__ import load_model

    p = argparse.ArgumentParser(prog="python -m orca_backend.simulate.host", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--hardware", default="h200", choices=sorted(PRESETS))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--context", type=int, default=1024, help="tokens before each decoded one")
    p.add_argument("--batches", default="1,8,16,32,64,128,256,512")
    args = p.parse_args(argv)
    model = CostModel(load_model(args.model), PRESETS[args.hardware], Layout(args.tp))
    batches = [int(b) for b in args.batches.split(",")]
    heads = ["batch", "device ms", "device tok/s"]
    for c in (BEFORE, AFTER):
        heads += [f"{c.name}: host ms", f"{c.name}: tok/s", f"{c.name}: limit"]
    widths = [max(len(str(x)) for x in col) for col in zip(heads, *table(model, batches, args.context))]
    for r in [heads, *table(model, batches, args.context)]:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths)))
    for c in (BEFORE, AFTER):
        limit = host_limit(model, c, args.context)
        print(f"{c.name}: the host passes the device at batch {limit if limit else '> 4096'} ({c.source})")


if __name__ == "__main__":
    main()
