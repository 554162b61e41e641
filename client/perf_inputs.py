"""perf_analyzer --input-data files from our seeded traces, for any model with our I/O.

    python -m client.perf_inputs --dist fixed --input-tokens 64 --output-tokens 32 -n 48 -o in.json
    python -m client.perf_inputs --dist orca --scale 0.25 -n 100 -o orca.json
    perf_analyzer -m orca -i grpc --streaming --input-data in.json --concurrency-range 4 ...

Each trace request becomes one entry (perf_analyzer cycles through them); the output length is
pinned with max_tokens = min_tokens, as genai-perf's --output-tokens-mean-deterministic does.
"""
from __future__ import annotations

import argparse
import json

from .trace import TraceRequest, add_trace_arguments, trace_from_arguments


def pinned_sampling(output_tokens: int, temperature: float = 0.0) -> dict:
    """Sampling parameters that make a request generate exactly `output_tokens` tokens."""
    return {"max_tokens": output_tokens, "min_tokens": output_tokens, "temperature": temperature}


def input_data(trace: list[TraceRequest], temperature: float = 0.0, stream: bool = True) -> dict:
    """The --input-data document: one entry per request, with the vLLM-backend inputs."""
    return {"data": [{"text_input": [r.prompt], "stream": [stream],
                      "sampling_parameters": [json.dumps(pinned_sampling(r.output_tokens, temperature))],
                      "exclude_input_in_output": [True]} for r in trace]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--num-requests", type=int, default=48)
    add_trace_arguments(p)
    p.set_defaults(dist="fixed", input_tokens=64, output_tokens=32)  # bench_perf's workload
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    trace = trace_from_arguments(args, args.num_requests, None)
    with open(args.output, "w") as f:
        json.dump(input_data(trace, args.temperature), f, indent=1)


if __name__ == "__main__":
    main()
