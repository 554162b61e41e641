"""The simulator's traces are the load generator's: `workload` draws them for `client.bench`
and `make bench` too, so a simulated `--dist orca` run at a rate gets exactly the requests
(lengths, arrival offsets) `make bench` sends at it (`client.bench` sends the same requests
at offsets not stretched to the rate). Shared-prefix workloads keep their
prompts' token ids, so that prefix caching finds what it would find on a real server."""
from __future__ import annotations

import argparse

from .loop import TraceRequest
from .workload import LengthDist, SharedPrefixes, exact_rate, load_tokenizer, make_trace


def from_client_trace(trace: list, tokenizer=None) -> list[TraceRequest]:
    """`client.trace.TraceRequest`s as the simulator's. With a tokenizer, each prompt's token
    ids come along (for prefix caching); a later turn of a conversation is not simulated."""
    if any(r.after is not None for r in trace):
        raise ValueError("a conversation's later turns (the chat workload) are not simulated; "
                         "use --dist system for shared prefixes")
    out = []
    for r in trace:
        ids = tuple(tokenizer.encode(r.prompt, add_special_tokens=False).ids) if tokenizer else None
        out.append(TraceRequest(r.offset, len(ids) if ids else r.input_tokens, r.output_tokens, ids or None))
    return out


def swept_traces(args: argparse.Namespace, rates: list[float], duration: float,
                 min_requests: int, num_requests: int | None = None) -> dict[float, list[TraceRequest]]:
    """One trace per rate, as `make bench` draws them: max(min_requests, rate x duration)
    requests (or `num_requests`), Poisson offsets stretched to the exact rate. `args` holds
    `client.trace.add_trace_arguments`' options."""
    tokenizer = load_tokenizer(args.tokenizer)
    out = {}
    for rate in rates:
        n = num_requests or max(min_requests, round(rate * duration))
        if args.dist == "system":
            shared = SharedPrefixes("system", 400 if args.system_tokens is None else args.system_tokens,
                                    args.question_tokens, args.answer_tokens)
            out[rate] = from_client_trace(exact_rate(shared.trace(n, rate, args.seed, tokenizer), rate),
                                          tokenizer)
            continue
        if args.dist == "chat":
            raise ValueError("the chat workload (turns after answers) is not simulated; use --dist system")
        dist = LengthDist(kind=args.dist, scale=args.scale, input_tokens=args.input_tokens,
                          output_tokens=args.output_tokens, input_mean=args.input_mean,
                          output_mean=args.output_mean, sigma=args.sigma)
        out[rate] = from_client_trace(exact_rate(make_trace(dist, n, rate, args.seed, tokenizer), rate))
    return out
