"""Prefix-aware routing over K/V cache events against round robin: two replicas of the default
model, a multi-tenant chat trace, the prefix-cache hit rate and time to first token.

    python -m benchmarks.bench_router [--tenants 6] [--users 3] [--turns 4] [--clients 4]

Two tritonservers on this machine, each with the default model, a pool of `--pool-tokens` and
its K/V cache events on; the trace's chats (each tenant a long system prompt, each user a
growing conversation, interleaved at random) go through `client/kv_router.py`'s router,
prefix-aware or round robin, from `--clients` closed-loop clients. Fresh tenants for each way
(what one left in the caches is of no use to the other), the ways alternating over `--rounds`.
The hit rate is the servers' own count: cached prompt tokens over prompt tokens.
"""
from __future__ import annotations

import json
import random
import statistics
import threading
import time

from benchmarks.common import Report, copy_model, log, options, work_dir
from benchmarks.servers import Server, free_ports
from client.kv_router import PrefixRouter
from client.triton_client import StreamingClient

WORDS = ("harbour ledger comet orchard violin glacier lantern copper meadow falcon quartz tundra "
         "saffron beacon canyon ember").split()


def chat_trace(seed: int, tenants: int = 4, users: int = 2, turns: int = 3,
               system_words: int = 70) -> list[list[dict]]:
    """Each tenant's long system prompt, each user's growing conversation; the users' turns
    interleaved at random (each user's in order)."""
    rng = random.Random(seed)
    conversations = []
    for t in range(tenants):
        system = f"You are assistant {seed}-{t} of a firm that sells " + " ".join(rng.choices(WORDS, k=system_words))
        for u in range(users):
            history, requests = [{"role": "system", "content": system + "."}], []
            for turn in range(turns):
                question = f"Question {turn} of user {u}: " + " ".join(rng.choices(WORDS, k=6)) + "?"
                history = history + [{"role": "user", "content": question}]
                requests.append(history)
                history = history + [{"role": "assistant", "content": " ".join(rng.choices(WORDS, k=8)) + "."}]
            conversations.append(requests)
    trace = []
    while any(conversations):
        trace.append(rng.choice([c for c in conversations if c]).pop(0))
    return trace


def replica_repository(folder, events_port: int, pool_tokens: int):
    """`orca` with this pool and its K/V cache events on `events_port`."""
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events_port}"})
    copy_model(folder, "orca", kv_cache_tokens=str(pool_tokens), kv_events_config=events.replace('"', '\\"'))
    return folder


def run(router: PrefixRouter, trace: list[list[dict]], clients: int, max_tokens: int) -> dict:
    """The trace from `clients` closed-loop clients; hit rate and TTFTs (s)."""
    work, lock = list(trace), threading.Lock()
    counts, ttfts, errors = {"cached": 0, "prompt": 0}, [], []

    def client() -> None:
        while True:
            with lock:
                if not work:
                    return
                messages = work.pop(0)
            prompt, ids = router.prompt(messages)
            replica = router.choose(ids)
            with StreamingClient(router.urls[replica]) as c:
                sent = time.monotonic()
                result = c.generate(prompt, stream=True, sampling={"max_tokens": max_tokens, "temperature": 0},
                                    flags={"return_num_cached_tokens": True, "return_num_input_tokens": True})
            with lock:
                if result.error is not None:
                    errors.append(result.error)
                    continue
                counts["cached"] += result.responses[-1]["num_cached_tokens"]
                counts["prompt"] += result.responses[-1]["num_input_tokens"]
                ttfts.append(result.times[0] - sent)
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"hit_rate": counts["cached"] / max(1, counts["prompt"]), "ttfts": ttfts, "errors": errors}


def main() -> None:
    p = options(__doc__, "router.md")
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--users", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--pool-tokens", type=int, default=768, help="each replica's K/V pool")
    args = p.parse_args()
    report = Report("Prefix-aware routing over K/V cache events", "bench-router")
    results: dict[str, list[dict]] = {"prefix-aware": [], "round robin": []}
    with work_dir("orca-router-") as work:
        ports = free_ports(2)
        servers = [Server(work / f"triton{i}", replica_repository(work / f"repo{i}", port, args.pool_tokens))
                   for i, port in enumerate(ports)]
        try:
            for server in servers:
                server.wait_ready(600)
            replicas = [(s.grpc_url, f"tcp://127.0.0.1:{port}") for s, port in zip(servers, ports)]
            seed = args.seed
            for round_number in range(args.rounds):
                for way in results:
                    seed += 1
                    log(f"round {round_number + 1}: {way}")
                    router = PrefixRouter(replicas, prefix_aware=way == "prefix-aware")
                    time.sleep(0.5)  # the subscriptions take hold
                    try:
                        trace = chat_trace(seed, args.tenants, args.users, args.turns)
                        results[way].append(run(router, trace, args.clients, args.max_tokens))
                    finally:
                        router.close()
        finally:
            for server in servers:
                server.stop()
    rows = []
    for way, runs in results.items():
        ttfts = sorted(t for r in runs for t in r["ttfts"])
        rows.append([way, " / ".join(f"{r['hit_rate']:.3f}" for r in runs),
                     f"{statistics.median(ttfts) * 1e3:.0f}", f"{ttfts[int(0.9 * (len(ttfts) - 1))] * 1e3:.0f}",
                     str(sum(len(r["errors"]) for r in runs))])
    report.add(f"Two replicas of the default model (SmolLM2-135M, fp32) on this machine's 2 cores, each a pool of "
               f"{args.pool_tokens} tokens (blocks of 16) with K/V cache events on; {args.tenants} tenants (system "
               f"prompts of about 80 tokens) x {args.users} users x {args.turns} turns, {args.max_tokens} tokens an "
               f"answer, {args.clients} closed-loop clients through `client/kv_router.py`; fresh tenants for each "
               f"run, the ways alternating over {args.rounds} rounds. Hit rate: the servers' cached prompt tokens "
               "over prompt tokens; TTFT at the client, over every round.", "")
    report.table(["routing", "hit rate by round", "TTFT p50 ms", "TTFT p90 ms", "errors"], rows)
    report.setup().write(args.markdown)


if __name__ == "__main__":
    main()
