"""Tensor parallelism on the CPU: one rank with 2 torch threads vs 2 ranks with 1 thread each.

The model: SmolLM2-135M's shapes (30 layers, hidden 576, intermediate 1536, vocabulary
49152) with 8 query and 4 K/V heads of 72 instead of 9 and 3 of 64, which 2 ranks cannot
split; random weights, written with transformers from that config (nothing is downloaded).

For each batch size B: B greedy requests of `--prompt-tokens` random token ids and
`--decode-steps` + 1 output tokens enter an idle engine at once. The first iteration is the
whole batch's prefill (the token budget holds it), the next `--decode-steps` are decodes of
B rows. Reported per configuration: prefill and decode tokens/s, and on rank 0 the share of
each iteration spent in collectives (all-reduces, the logits gather, and waiting there for
the other rank) and in handing the message to the other rank. T = 1 and T = 2 take turns,
`--repeats` times each, in one process (both engines stay loaded; the idle one's ranks wait
on their pipes); the medians are reported.

Last, round trips between two processes: how rank 0 should hand each iteration's message to
the other ranks (the encoded decode message of B = 32 over a pipe, and as a gloo broadcast of
its size, then its bytes), the same bytes over plain TCP on loopback, and gloo's allreduce
and allgather of one token's hidden state on their own.

    python benchmarks/bench_tp.py --markdown docs/benchmarks/tensor_parallel.md
    python benchmarks/bench_tp.py --smoke       # a minute: does it run?
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# `python benchmarks/bench_tp.py` puts benchmarks/ on the path, not the repo root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import log, machine_lines, table  # noqa: E402
from orca_backend import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.core.messages import encode  # noqa: E402

MODEL_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=72, max_position_embeddings=2048,
                   rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


@dataclass
class Sample:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    prefill_collective_share: float
    decode_collective_share: float
    decode_handoff_share: float
    decode_seconds: float  # per decode iteration


def write_model(folder: Path, num_layers: int) -> Path:
    """Random weights in the default model's vocabulary (its tokenizer is copied along)."""
    import shutil

    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(**(MODEL_SHAPE | {"num_hidden_layers": num_layers}))
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(prepare_default_model() / "tokenizer.json", folder / "tokenizer.json")
    return folder


class Bench:
    """One engine of T ranks; `run(B)` measures one batch from an idle engine."""

    def __init__(self, folder: Path, size: int, args) -> None:
        self.size, self.args = size, args
        self.threads = 2 // size if size <= 2 else 1
        torch.set_num_threads(2)  # T = 1's; T = 2's build sets 1 per rank
        self.engine = LLMEngine(EngineConfig(
            model=str(folder), tensor_parallel_size=size, max_batch_size=max(args.batches),
            max_num_batched_tokens=max(args.batches) * args.prompt_tokens, enable_prefix_caching=False,
            kv_cache_tokens=max(args.batches) * (args.prompt_tokens + args.decode_steps + 16)))
        self.runner = self.engine.executor.runner
        self.last_message = None
        execute = self.runner.execute

        def keep(message, hidden=None):
            self.last_message = message
            return execute(message, hidden)

        self.runner.execute = keep

    def _counters(self) -> tuple[float, float]:
        group = self.runner.group
        collectives = self.runner.collectives
        return (collectives.seconds if group else 0.0), (group.handoff_seconds if group else 0.0)

    def _step(self) -> tuple[float, float, float]:
        c0, h0 = self._counters()
        start = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - start
        c1, h1 = self._counters()
        return seconds, c1 - c0, h1 - h0

    def run(self, batch: int, seed: int) -> Sample:
        torch.set_num_threads(self.threads)
        g = torch.Generator().manual_seed(seed)
        params = SamplingParams(temperature=0, max_tokens=self.args.decode_steps + 1, ignore_eos=True)
        for i in range(batch):
            self.engine.add_request(f"{seed}-{i}", torch.randint(3, 49152, (self.args.prompt_tokens,),
                                                                generator=g).tolist(), params)
        prefill, prefill_coll, _ = self._step()
        decode = decode_coll = decode_handoff = 0.0
        for _ in range(self.args.decode_steps):
            seconds, coll, handoff = self._step()
            decode, decode_coll, decode_handoff = decode + seconds, decode_coll + coll, decode_handoff + handoff
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return Sample(batch * self.args.prompt_tokens / prefill, batch * self.args.decode_steps / decode,
                      prefill_coll / prefill, decode_coll / decode, decode_handoff / decode,
                      decode / self.args.decode_steps)


def _echo(port: int, connection, rounds: int) -> None:
    """The second process of the latency measurements: it answers what `latencies` sends."""
    import socket

    from orca_backend.runner.tensor_parallel import GroupCollectives

    torch.set_num_threads(1)
    collectives = GroupCollectives(1, 2, torch.device("cpu"))
    collectives.connect(port, 60)
    for _ in range(rounds):  # the pipe
        connection.send_bytes(connection.recv_bytes()[:1])
    for _ in range(rounds):  # a gloo broadcast of the message
        size = collectives.broadcast(torch.zeros(1, dtype=torch.int64))
        collectives.broadcast(torch.empty(int(size), dtype=torch.uint8))
        collectives.all_reduce(torch.ones(1, dtype=torch.uint8))
    hidden = torch.zeros(576)
    for _ in range(rounds):
        collectives.group.allreduce([hidden]).wait()
    shares = [torch.empty(576) for _ in range(2)]
    for _ in range(rounds):
        collectives.group.allgather([shares], [hidden]).wait()
    with socket.create_connection(("127.0.0.1", connection.recv())) as sock:  # plain TCP
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            sock.sendall(sock.recv(1 << 16)[:1])


def _median_seconds(rounds: int, once) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def latencies(message_bytes: bytes, rounds: int) -> dict[str, float]:
    """Median round trips between two processes on this machine: the message over a pipe, as
    a gloo broadcast, and over plain TCP (each answered with one byte); and gloo's allreduce
    and allgather of one token's hidden state (576 floats) on their own."""
    import datetime as dt
    import socket

    import torch.distributed as dist

    from orca_backend.runner.tensor_parallel import GroupCollectives

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=dt.timedelta(seconds=60), wait_for_workers=False)
    here, there = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_echo, args=(store.port, there, rounds))
    child.start()
    collectives = GroupCollectives(0, 2, torch.device("cpu"))
    collectives.connect(store.port, 60, store)
    out = {"message over a pipe": _median_seconds(rounds, lambda: (here.send_bytes(message_bytes),
                                                                   here.recv_bytes()))}
    payload = torch.frombuffer(bytearray(message_bytes), dtype=torch.uint8)
    out["message as a gloo broadcast"] = _median_seconds(rounds, lambda: (
        collectives.broadcast(torch.tensor([len(message_bytes)], dtype=torch.int64)),
        collectives.broadcast(payload), collectives.all_reduce(torch.ones(1, dtype=torch.uint8))))
    hidden = torch.ones(576)
    out["gloo allreduce, 2 KiB"] = _median_seconds(rounds, lambda: collectives.group.allreduce([hidden]).wait())
    shares = [torch.empty(576) for _ in range(2)]
    out["gloo allgather, 2 KiB"] = _median_seconds(
        rounds, lambda: collectives.group.allgather([shares], [hidden]).wait())
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        here.send(server.getsockname()[1])
        sock, _ = server.accept()
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out["message over TCP"] = _median_seconds(rounds, lambda: (sock.sendall(message_bytes), sock.recv(1)))
    child.join(30)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="2 layers, batches 1 and 4, 1 repeat")
    parser.add_argument("--markdown", type=Path, help="also write the report here")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.layers, args.repeats, args.decode_steps = [1, 4], 2, 1, 4
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        log(f"writing a random {args.layers}-layer model")
        folder = write_model(Path(tmp) / "model", args.layers)
        benches = {size: Bench(folder, size, args) for size in (1, 2)}
        samples: dict[tuple[int, int], list[Sample]] = {}
        for batch in args.batches:
            for r in range(args.repeats):
                for size, bench in benches.items():
                    samples.setdefault((size, batch), []).append(bench.run(batch, seed=r))
                    log(f"T={size} B={batch} repeat {r}: {samples[size, batch][-1]}")
        message = encode(benches[2].last_message)
        for bench in benches.values():
            bench.engine.shutdown()
    hops = latencies(message, 200)
    lines = report(args, samples, hops, len(message), time.time() - started)
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


def _median(samples: list[Sample], field: str) -> float:
    return statistics.median(getattr(s, field) for s in samples)


def report(args, samples, hops: dict[str, float], message_bytes: int, seconds: float) -> list[str]:
    rows = []
    for batch in args.batches:
        one, two = samples[1, batch], samples[2, batch]
        rows.append([batch,
                     f"{_median(one, 'prefill_tokens_per_s'):.0f}", f"{_median(two, 'prefill_tokens_per_s'):.0f}",
                     f"{_median(two, 'prefill_tokens_per_s') / _median(one, 'prefill_tokens_per_s'):.2f}x",
                     f"{_median(one, 'decode_tokens_per_s'):.1f}", f"{_median(two, 'decode_tokens_per_s'):.1f}",
                     f"{_median(two, 'decode_tokens_per_s') / _median(one, 'decode_tokens_per_s'):.2f}x",
                     f"{100 * _median(two, 'prefill_collective_share'):.1f}%",
                     f"{100 * _median(two, 'decode_collective_share'):.1f}%",
                     f"{100 * _median(two, 'decode_handoff_share'):.2f}%",
                     f"{1e3 * _median(one, 'decode_seconds'):.0f}",
                     f"{1e3 * _median(two, 'decode_seconds') * (1 - _median(two, 'decode_collective_share')):.0f}"])
    head = ["B", "prefill tok/s T=1", "T=2", "T=2 / T=1", "decode tok/s T=1", "T=2", "T=2 / T=1",
            "collectives, prefill (T=2)", "collectives, decode (T=2)", "hand-off, decode (T=2)",
            "decode ms, T=1", "T=2 outside collectives"]
    return [
        "# Tensor parallelism on the CPU: 1 rank x 2 threads vs 2 ranks x 1 thread",
        "",
        f"Written by `python benchmarks/bench_tp.py` ({' '.join(sys.argv[1:])}) on "
        f"{datetime.date.today()}, in {seconds / 60:.1f} minutes.",
        "",
        *machine_lines(),
        f"- model: SmolLM2-135M's shapes with 8 query / 4 K/V heads of 72, {args.layers} layers, "
        "random weights, float32",
        f"- each batch: B requests of {args.prompt_tokens} prompt tokens; the prefill is one "
        f"iteration, then {args.decode_steps} decode iterations; medians of {args.repeats} runs, "
        "T = 1 and T = 2 taking turns",
        "- shares are of rank 0's iteration time: collectives include waiting there for rank 1",
        "",
        *table(head, rows),
        "",
        f"Round trips between two processes, median of 200 (a decode message of B = "
        f"{max(args.batches)} is {message_bytes} bytes encoded; each is answered with one byte):",
        "",
        *table(["what", "round trip (us)"], [[k, f"{v * 1e6:.0f}"] for k, v in hops.items()]),
    ]


if __name__ == "__main__":
    main()
