"""How soon a newcomer gets an answer: the chat CLI's time to first token and the OpenAI API's
start to ready, with chat templates rendered by jinja2 alone, beside what transformers costs
for the same prompt (what `client.generate --chat` imported before).

1. In fresh interpreters: importing our renderer against importing transformers, and the
   default model's template rendered by each (import, load, render).
2. Against a real tritonserver (`orca` only): `python -m client.generate QUESTION --chat
   --max-tokens 32 --temperature 0` from process start to its first byte of answer and to its
   exit; then the OpenAI API's child process from start to `/health/ready` answering 200.

    python benchmarks/bench_startup.py [--repeats 5] [--markdown docs/benchmarks/startup.md]
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import log, machine_lines, table  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.serving.launch import REPO_ROOT, Frontend, Server  # noqa: E402

QUESTION = "What is the capital of France?"
MESSAGES = f'[{{"role": "user", "content": "{QUESTION}"}}]'
IN_FRESH_INTERPRETERS = {
    "import the renderer (jinja2)": "import orca_backend.checkpoint.chat_template",
    "import transformers' AutoTokenizer": "from transformers import AutoTokenizer",
    "render the chat prompt with the renderer":
        "from orca_backend.checkpoint.chat_template import load_chat_template\n"
        "load_chat_template(FOLDER).render(MESSAGES)",
    "render the chat prompt with transformers":
        "from transformers import AutoTokenizer\n"
        "AutoTokenizer.from_pretrained(FOLDER).apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)",
}


def seconds_of(code: str, folder: Path) -> float:
    """Wall time of a fresh interpreter that runs `code` (FOLDER: the default model's folder)."""
    program = (f"import json\nfrom pathlib import Path\nFOLDER = Path({str(folder)!r})\n"
               f"MESSAGES = json.loads({MESSAGES!r})\n{code}")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", program], cwd=REPO_ROOT, check=True)
    return time.perf_counter() - start


def cli_run(grpc_url: str) -> tuple[float, float]:
    """(seconds to the first byte of answer, seconds to exit) of one --chat run."""
    argv = [sys.executable, "-m", "client.generate", QUESTION, "--chat", "--max-tokens", "32",
            "--temperature", "0", "--url", grpc_url]
    start = time.perf_counter()
    process = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    first = process.stdout.read(1)
    first_seconds = time.perf_counter() - start
    process.stdout.read()
    if process.wait() != 0 or not first:
        raise RuntimeError("client.generate --chat failed")
    return first_seconds, time.perf_counter() - start


def frontend_ready_seconds(work: Path, grpc_url: str, i: int) -> float:
    folder = work / f"frontend{i}"
    folder.mkdir()
    start = time.perf_counter()
    f = Frontend(folder, grpc_url, args=["--model", "orca"])
    try:
        f.wait_ready()
        return time.perf_counter() - start
    finally:
        f.stop()


def _median_row(name: str, values: list[float]) -> list:
    return [name, f"{statistics.median(values) * 1000:.0f} ms",
            f"{min(values) * 1000:.0f} - {max(values) * 1000:.0f} ms"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--markdown", type=Path, help="write the report here")
    args = p.parse_args()
    folder = prepare_default_model()
    log("fresh interpreters")
    samples = {name: [] for name in IN_FRESH_INTERPRETERS}
    for _ in range(args.repeats):  # alternating, so that a slow phase of the machine hits each
        for name, code in IN_FRESH_INTERPRETERS.items():
            samples[name].append(seconds_of(code, folder))
    rows = [_median_row(name, values) for name, values in samples.items()]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server = Server(work, extra_args=["--model-control-mode=explicit", "--load-model=orca"])
        try:
            server.wait_ready()
            cli_run(server.grpc_url)  # warm: the model's first iteration
            log("client.generate --chat")
            runs = [cli_run(server.grpc_url) for _ in range(args.repeats)]
            rows.append(_median_row("client.generate --chat: first byte of answer", [r[0] for r in runs]))
            rows.append(_median_row("client.generate --chat: 32 tokens, exit", [r[1] for r in runs]))
            log("the OpenAI API from start to ready")
            ready = [frontend_ready_seconds(work, server.grpc_url, i) for i in range(args.repeats)]
            rows.append(_median_row("the OpenAI API: start to /health/ready 200", ready))
        finally:
            server.stop()
    lines = [f"# Start-up: the chat CLI and the OpenAI API ({datetime.date.today()})", "",
             f"`python benchmarks/bench_startup.py --repeats {args.repeats}` (`make bench-startup`): "
             "medians and ranges of the repeats.", "",
             *table(["what", "median", "range"], rows), "", *machine_lines(), ""]
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
