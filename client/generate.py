"""Stream a completion from the ORCA model as it is generated.

    python -m client.generate "Tell me a story" --max-tokens 64
"""
from __future__ import annotations

import argparse
import sys

from .triton_client import StreamingClient


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--url", default="localhost:8001", help="gRPC address of tritonserver")
    p.add_argument("--model", default="orca")
    p.add_argument("--no-stream", action="store_true", help="one response at the end")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    args = p.parse_args(argv)
    sampling = {"max_tokens": args.max_tokens}
    for key in ("temperature", "top_p", "top_k", "seed", "stop"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    with StreamingClient(args.url, args.model) as client:
        request_id = client.send(args.prompt, sampling=sampling, stream=not args.no_stream,
                                 flags={"return_finish_reason": True})
        done = False
        while not done:
            rid, item = client.events.get()
            if isinstance(item, str):
                print(f"\nerror: {item}", file=sys.stderr)
                return 1
            print(item["text_output"], end="", flush=True)
            done = item.get("finish_reason", "None") != "None"
        print(f"\n[finish_reason: {client.wait(request_id).responses[-1]['finish_reason']}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
