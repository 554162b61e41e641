"""Tensor parallelism on the CPU, one rank with 2 torch threads against 2 ranks with 1 each, on
SmolLM2-135M's shapes with 8/4 heads (random weights); round trips between two processes for the
iteration's message and gloo's collectives; then the `grpc` stage hop against `bls` on loopback.

    python -m benchmarks.bench_tp             # writes docs/benchmarks/tensor_parallel.md
    python -m benchmarks.bench_tp --smoke     # a few minutes: does it run?
"""
from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import shutil
import socket
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from benchmarks.common import Report, log, options, seconds, work_dir
from benchmarks.headline import record
from benchmarks.servers import Server, free_ports
from client.triton_client import StreamingClient
from orca_backend import EngineConfig, LLMEngine, SamplingParams
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.core.messages import encode
from orca_backend.runner.tensor_parallel import GroupCollectives
from orca_backend.serving.stages.repository import PipelineLayout, write_repository

MODEL_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=72, max_position_embeddings=2048, rms_norm_eps=1e-5,
                   rope_theta=100000.0, tie_word_embeddings=True)
PROMPT = "The history of computing is a story of abstractions built on top of one another."


@dataclass(slots=True)
class Sample:
    """One batch's run; the shares are of rank 0's time (waiting there for rank 1 included)."""

    prefill_rate: float  # tokens/s
    decode_rate: float
    prefill_collectives: float  # share in collectives
    decode_collectives: float
    decode_handoff: float  # share handing the message to the other ranks
    decode_seconds: float  # per decode iteration

    @staticmethod
    def median(samples: list[Sample]) -> Sample:
        return Sample(*(statistics.median(getattr(s, f.name) for s in samples) for f in dataclasses.fields(Sample)))


class Bench:
    """One engine of `size` ranks; `run(B)` measures one batch from an idle engine."""

    def __init__(self, folder: Path, size: int, args) -> None:
        self.size, self.args, most = size, args, max(args.batches)
        torch.set_num_threads(2)  # T = 1's; T = 2's build sets 1 per rank
        self.engine = LLMEngine(EngineConfig(
            model=str(folder), tensor_parallel_size=size, max_batch_size=most, enable_prefix_caching=False,
            max_num_batched_tokens=most * args.prompt_tokens,
            kv_cache_tokens=most * (args.prompt_tokens + args.decode_steps + 16)))
        self.runner, self.last_message = self.engine.executor.runner, None
        execute = self.runner.execute

        def keep(message, hidden=None):
            self.last_message = message
            return execute(message, hidden)
        self.runner.execute = keep

    def _step(self) -> tuple[float, float, float]:
        """Seconds of one engine step, and of them in collectives and in the message hand-off."""
        group = self.runner.group
        counters = lambda: (self.runner.collectives.seconds, group.handoff_seconds) if group else (0.0, 0.0)
        c0, h0 = counters()
        took = seconds(self.engine.step)
        c1, h1 = counters()
        return took, c1 - c0, h1 - h0

    def run(self, batch: int, seed: int) -> Sample:
        torch.set_num_threads(2 // self.size)
        g, a = torch.Generator().manual_seed(seed), self.args
        params = SamplingParams(temperature=0, max_tokens=a.decode_steps + 1, ignore_eos=True)
        for i in range(batch):
            self.engine.add_request(f"{seed}-{i}", torch.randint(3, 49152, (a.prompt_tokens,), generator=g).tolist(),
                                    params)
        prefill, prefill_coll, _ = self._step()
        decode = [sum(x) for x in zip(*(self._step() for _ in range(a.decode_steps)))]
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return Sample(batch * a.prompt_tokens / prefill, batch * a.decode_steps / decode[0], prefill_coll / prefill,
                      decode[1] / decode[0], decode[2] / decode[0], decode[0] / a.decode_steps)


def _echo(port: int, connection, rounds: int) -> None:
    """The second process of `latencies`: it answers what rank 0 sends, in the same order."""
    torch.set_num_threads(1)
    collectives = GroupCollectives(1, 2, torch.device("cpu"))
    collectives.connect(port, 60)
    for _ in range(rounds):  # the pipe
        connection.send_bytes(connection.recv_bytes()[:1])
    for _ in range(rounds):  # a gloo broadcast of the message
        size = collectives.broadcast(torch.zeros(1, dtype=torch.int64))
        collectives.broadcast(torch.empty(int(size), dtype=torch.uint8))
        collectives.all_reduce(torch.ones(1, dtype=torch.uint8))
    hidden, shares = torch.zeros(576), [torch.empty(576) for _ in range(2)]
    for _ in range(rounds):
        collectives.group.allreduce([hidden]).wait()
    for _ in range(rounds):
        collectives.group.allgather([shares], [hidden]).wait()
    with socket.create_connection(("127.0.0.1", connection.recv())) as sock:  # plain TCP
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            sock.sendall(sock.recv(1 << 16)[:1])


def latencies(message: bytes, rounds: int) -> dict[str, float]:
    """Median round trips between two processes: the message over a pipe, as a gloo broadcast
    and over plain TCP (each answered with one byte); gloo's allreduce and allgather of one
    token's hidden state (576 floats) on their own."""
    median = lambda once: statistics.median(seconds(once) for _ in range(rounds))
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    spawn = multiprocessing.get_context("spawn")
    here, there = spawn.Pipe()
    child = spawn.Process(target=_echo, args=(store.port, there, rounds))
    child.start()
    collectives = GroupCollectives(0, 2, torch.device("cpu"))
    collectives.connect(store.port, 60, store)
    out = {"message over a pipe": median(lambda: (here.send_bytes(message), here.recv_bytes()))}
    payload = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    hidden, shares = torch.ones(576), [torch.empty(576) for _ in range(2)]
    out["message as a gloo broadcast"] = median(lambda: (
        collectives.broadcast(torch.tensor([len(message)], dtype=torch.int64)), collectives.broadcast(payload),
        collectives.all_reduce(torch.ones(1, dtype=torch.uint8))))
    out["gloo allreduce, 2 KiB"] = median(lambda: collectives.group.allreduce([hidden]).wait())
    out["gloo allgather, 2 KiB"] = median(lambda: collectives.group.allgather([shares], [hidden]).wait())
    with socket.create_server(("127.0.0.1", 0)) as server:
        here.send(server.getsockname()[1])
        sock, _ = server.accept()
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out["message over TCP"] = median(lambda: (sock.sendall(message), sock.recv(1)))
    child.join(30)
    return out


def stage_hop(args) -> dict[str, list[float]]:
    """The gaps between streamed tokens (decode iterations) of one request at a time, through
    the 2-stage pipeline `pbls` (both stages in one server) and `pgrpc` (stage 1 in another)."""
    gaps = {"bls": [], "grpc": []}
    with work_dir() as tmp:
        ports, settings = free_ports(6), dict(threads_per_stage=1, orca_parameters={"max_inflight": "1"})
        write_repository(PipelineLayout(2, "pbls", **settings), tmp / "host0")
        write_repository(PipelineLayout(2, "pgrpc", hosts=[f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[4]}"],
                                        **settings), tmp / "grpc")
        for folder in (tmp / "grpc" / "host0").iterdir():  # both pipelines' first server is one
            folder.rename(tmp / "host0" / folder.name)
        (tmp / "work0").mkdir(), (tmp / "work1").mkdir()
        with Server(tmp / "work1", tmp / "grpc" / "host1", ports=tuple(ports[3:])), \
                Server(tmp / "work0", tmp / "host0", ports=tuple(ports[:3])) as server:
            for n in range(args.rounds):
                for transport in gaps:
                    with StreamingClient(server.grpc_url, f"p{transport}") as c:
                        result = c.generate(PROMPT, timeout=300, sampling={
                            "temperature": "0", "max_tokens": str(args.max_tokens), "ignore_eos": "true"})
                    if result.error is not None:
                        raise RuntimeError(result.error)
                    gaps[transport] += [b - a for a, b in zip(result.times[1:], result.times[2:])]
                    log(f"round {n} {transport}: median {statistics.median(gaps[transport]) * 1e3:.2f} ms")
    return gaps


def main() -> None:
    p = options(__doc__, "tensor_parallel.md")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens a request, the stage hop")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the stage hop")
    p.add_argument("--smoke", action="store_true", help="2 layers, batches 1 and 4, 1 repeat, 8 tokens, 1 round")
    args = p.parse_args()
    if args.smoke:
        args.batches, args.layers, args.repeats, args.decode_steps, args.max_tokens, args.rounds = [1, 4], 2, 1, 4, 8, 1
    r = Report("Tensor parallelism on the CPU: 1 rank x 2 threads vs 2 ranks x 1 thread", "bench-tp")
    samples: dict[tuple[int, int], list[Sample]] = {}
    with work_dir() as tmp:
        log(f"writing a random {args.layers}-layer model, in the default model's vocabulary")
        torch.manual_seed(0)
        folder = tmp / "model"
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL_SHAPE, num_hidden_layers=args.layers)) \
            .save_pretrained(folder)
        shutil.copy(prepare_default_model() / "tokenizer.json", folder / "tokenizer.json")
        benches = {size: Bench(folder, size, args) for size in (1, 2)}
        for batch in args.batches:
            for n in range(args.repeats):
                for size, bench in benches.items():
                    samples.setdefault((size, batch), []).append(bench.run(batch, seed=n))
                    log(f"T={size} B={batch} repeat {n}: {samples[size, batch][-1]}")
        message = encode(benches[2].last_message)
        for bench in benches.values():
            bench.engine.shutdown()
    hops, gaps = latencies(message, 200), stage_hop(args)
    rows = []
    for b in args.batches:
        one, two = Sample.median(samples[1, b]), Sample.median(samples[2, b])
        rows.append([b, f"{one.prefill_rate:.0f}", f"{two.prefill_rate:.0f}",
                     f"{two.prefill_rate / one.prefill_rate:.2f}x", f"{one.decode_rate:.1f}", f"{two.decode_rate:.1f}",
                     f"{two.decode_rate / one.decode_rate:.2f}x",
                     f"{100 * two.prefill_collectives:.1f}%", f"{100 * two.decode_collectives:.1f}%",
                     f"{100 * two.decode_handoff:.2f}%", f"{1e3 * one.decode_seconds:.0f}",
                     f"{1e3 * two.decode_seconds * (1 - two.decode_collectives):.0f}"])
    r.add(f"SmolLM2-135M's shapes with 8 query / 4 K/V heads of 72, {args.layers} layers, random weights, float32. "
          f"Each batch: B requests of {args.prompt_tokens} prompt tokens; the prefill is one iteration, then "
          f"{args.decode_steps} decode iterations; medians of {args.repeats} runs, T = 1 and T = 2 taking turns. "
          "Shares are of rank 0's iteration time: collectives include waiting there for rank 1.", "")
    r.table(["B", "prefill tok/s T=1", "T=2", "T=2 / T=1", "decode tok/s T=1", "T=2", "T=2 / T=1",
             "collectives, prefill (T=2)", "collectives, decode (T=2)", "hand-off, decode (T=2)", "decode ms, T=1",
             "T=2 outside collectives"], rows)
    r.add(f"Round trips between two processes, median of 200 (a decode message of B = {max(args.batches)} is "
          f"{len(message)} bytes encoded; each is answered with one byte):", "")
    r.table(["what", "round trip (us)"], [[k, f"{v * 1e6:.0f}"] for k, v in hops.items()])
    medians = {k: statistics.median(v) * 1e3 for k, v in gaps.items()}
    r.section("The `grpc` stage hop against `bls`, on loopback",
              f"The default model as 2 stages (1 torch thread each), one request at a time, {args.max_tokens} greedy "
              f"tokens, {args.rounds} rounds taking turns; the gap between streamed tokens is one iteration through "
              "both stages.")
    r.table(["transport", "iteration (median ms)", "iterations measured"],
            [[k, f"{medians[k]:.2f}", len(gaps[k])] for k in gaps])
    r.add(f"The gRPC hop adds {medians['grpc'] - medians['bls']:.2f} ms per iteration "
          f"({100 * (medians['grpc'] / medians['bls'] - 1):.1f}%).", "")
    r.setup().write(args.markdown)
    top = max(args.batches)
    one, two = Sample.median(samples[1, top]), Sample.median(samples[2, top])
    record(args.markdown, "bench-tp", {"tensor_parallel": (
        f"Tensor parallelism: 2 ranks against 1 on the same 2 cores, decode at batch {top}",
        f"{two.decode_rate / one.decode_rate:.2f}x")})


if __name__ == "__main__":
    main()
