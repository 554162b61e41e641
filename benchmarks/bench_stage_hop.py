"""What a pipeline stage on another server costs per iteration: the `grpc` stage hop against
`bls`, on loopback.

Two layouts of the same 2-stage pipeline of the default model (one torch thread per stage):
`bls` (both stages in orca's tritonserver) and `grpc` (stage 1 in a second tritonserver on
another loopback port, as `--hosts` writes it). One request at a time, greedy, of
`--max-tokens` tokens: the gap between streamed tokens is one iteration through both stages,
so the difference of the medians is the per-iteration cost of the gRPC hop (the hidden
states of one token's row out, and back the sampled token). The layouts take turns,
`--rounds` times.

    python benchmarks/bench_stage_hop.py --markdown-append docs/benchmarks/tensor_parallel.md
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import log, table  # noqa: E402
from client.triton_client import StreamingClient  # noqa: E402
from orca_backend.serving.launch import Server, free_ports  # noqa: E402
from orca_backend.serving.stages.repository import PipelineLayout, write_repository  # noqa: E402

PROMPT = "The history of computing is a story of abstractions built on top of one another."


def token_gaps(server: Server, model: str, max_tokens: int) -> list[float]:
    with StreamingClient(server.grpc_url, model) as c:
        result = c.generate(PROMPT, sampling={"temperature": "0", "max_tokens": str(max_tokens),
                                              "ignore_eos": "true"}, timeout=300)
    assert result.error is None, result.error
    return [b - a for a, b in zip(result.times[1:], result.times[2:])]  # decode iterations only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--markdown-append", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ports = free_ports(6)
        write_repository(PipelineLayout(2, "pbls", threads_per_stage=1, orca_parameters={"max_inflight": "1"}),
                         tmp / "host0")
        write_repository(PipelineLayout(2, "pgrpc", threads_per_stage=1, orca_parameters={"max_inflight": "1"},
                                        hosts=[f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[4]}"]), tmp / "grpc")
        for folder in (tmp / "grpc" / "host0").iterdir():  # both pipelines' first server is one
            folder.rename(tmp / "host0" / folder.name)
        (tmp / "work0").mkdir()
        (tmp / "work1").mkdir()
        servers = [Server(tmp / "work1", tmp / "grpc" / "host1", ports=tuple(ports[3:]))]
        servers[0].wait_ready(600)
        servers.insert(0, Server(tmp / "work0", tmp / "host0", ports=tuple(ports[:3])))
        try:
            servers[0].wait_ready(600)
            gaps = {"bls": [], "grpc": []}
            for r in range(args.rounds):
                for transport, model in (("bls", "pbls"), ("grpc", "pgrpc")):
                    gaps[transport] += token_gaps(servers[0], model, args.max_tokens)
                    log(f"round {r} {transport}: median {statistics.median(gaps[transport]) * 1e3:.2f} ms")
        finally:
            for s in servers:
                s.stop()
    medians = {k: statistics.median(v) * 1e3 for k, v in gaps.items()}
    lines = ["", "## The `grpc` stage hop against `bls`, on loopback", "",
             f"Written by `python benchmarks/bench_stage_hop.py` ({' '.join(sys.argv[1:])}): the "
             "default model as 2 stages (1 torch thread each), one request at a time, "
             f"{args.max_tokens} greedy tokens, {args.rounds} rounds taking turns; the gap between "
             "streamed tokens is one iteration through both stages.", "",
             *table(["transport", "iteration (median ms)", "iterations measured"],
                    [[k, f"{medians[k]:.2f}", len(gaps[k])] for k in gaps]), "",
             f"The gRPC hop adds {medians['grpc'] - medians['bls']:.2f} ms per iteration "
             f"({100 * (medians['grpc'] / medians['bls'] - 1):.1f}%)."]
    print("\n".join(lines))
    if args.markdown_append:
        with args.markdown_append.open("a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
