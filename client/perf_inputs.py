"""perf_analyzer --input-data files from our seeded traces, for any model with our I/O.

    python -m client.perf_inputs --dist fixed --input-tokens 64 --output-tokens 32 -n 48 -o in.json
    perf_analyzer -m orca -i grpc --streaming --input-data in.json --concurrency-range 4 ...

Each trace request becomes one entry (perf_analyzer cycles through them); the output length is
pinned with max_tokens = min_tokens, as genai-perf's --output-tokens-mean-deterministic does.
"""
from __future__ import annotations

import argparse
import json

from .trace import LengthDist, TraceRequest, load_tokenizer, make_trace


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
    p.add_argument("--dist", choices=("orca", "fixed", "lognormal"), default="fixed")
    p.add_argument("--scale", type=float, default=1.0, help="orca: multiplies the length ranges")
    p.add_argument("--input-tokens", type=int, default=64, help="fixed")
    p.add_argument("--output-tokens", type=int, default=32, help="fixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tokenizer", help="folder with tokenizer.json (default: the default model)")
    p.add_argument("-o", "--output", required=True)
    args = p.parse_args(argv)
    dist = LengthDist(kind=args.dist, scale=args.scale, input_tokens=args.input_tokens,
                      output_tokens=args.output_tokens)
    trace = make_trace(dist, args.num_requests, None, args.seed, load_tokenizer(args.tokenizer))
    with open(args.output, "w") as f:
        json.dump(input_data(trace, args.temperature), f, indent=1)


if __name__ == "__main__":
    main()
