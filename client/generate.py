"""Stream a completion from the ORCA model as it is generated.

    python -m client.generate "Tell me a story" --max-tokens 64
    python -m client.generate "What is the capital of France?" --chat --max-tokens 32

The default model is an instruct model: a raw question often ends at once with no text, so
--chat sends the prompt as one user message in the model's chat template.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orca_backend.checkpoint.chat_template import ChatTemplateError, load_chat_template
from orca_backend.checkpoint.store import default_model_path
from orca_backend.core.errors import ConfigError

from .triton_client import StreamingClient


def chat_prompt(text: str, folder: str | Path, system: str | None = None) -> str:
    """`text` as a user message (after a system message, if one is given), rendered with the
    chat template of the tokenizer in `folder`; raises ValueError if there is none."""
    template = load_chat_template(Path(folder))
    if template is None:
        raise ConfigError(f"{folder} has no chat template")
    messages = [{"role": "system", "content": system}] if system is not None else []
    return template.render([*messages, {"role": "user", "content": text}])


def _prompt(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The text to send: the prompt as given, or with --chat in the chat template."""
    if not args.chat:
        if args.system is not None:
            parser.error("--system needs --chat")
        return args.prompt
    folder = default_model_path() if args.tokenizer is None else Path(args.tokenizer)
    if not folder.is_dir():
        parser.error(f"--chat: no tokenizer folder at {folder}; pass --tokenizer FOLDER or run `make model`")
    try:
        return chat_prompt(args.prompt, folder, args.system)
    except (ConfigError, ChatTemplateError) as e:  # no template, or one that cannot be read or used
        parser.error(f"--chat: cannot render the chat template of {folder}: {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="send the prompt in the model's chat template")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the prompt")
    p.add_argument("--tokenizer", metavar="FOLDER",
                   help="tokenizer folder whose chat template --chat uses (default: the default model's)")
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
    prompt = _prompt(args, p)
    sampling = {"max_tokens": args.max_tokens}
    for key in ("temperature", "top_p", "top_k", "seed", "stop"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    if args.ignore_eos:
        sampling["ignore_eos"] = True
    with StreamingClient(args.url, args.model) as client:
        # With --chat, print the answer only, never the template around the question.
        request_id = client.send(prompt, sampling=sampling, stream=not args.no_stream,
                                 exclude_input=True if args.chat else None,
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
