"""How soon a newcomer gets an answer: importing our chat-template renderer (jinja2) against
transformers and rendering the default model's chat prompt with each, in fresh interpreters;
`client.generate --chat` to its first byte of answer and to its exit, and the OpenAI API from
start to ready, against a real tritonserver with `orca`.

    python -m benchmarks.bench_startup [--repeats 5]
"""
import statistics
import subprocess
import sys
import time

from benchmarks.common import Report, log, options, serving, work_dir
from benchmarks.servers import Frontend
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.serving.launch import REPO_ROOT

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
        "AutoTokenizer.from_pretrained(FOLDER).apply_chat_template(\n"
        "    MESSAGES, tokenize=False, add_generation_prompt=True)",
}


def seconds_of(program: str) -> float:
    """Wall time of a fresh interpreter that runs `program`."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", program], cwd=REPO_ROOT, check=True)
    return time.perf_counter() - start


def ready_seconds(work, grpc_url: str) -> float:
    """The OpenAI API from its start to /health/ready answering 200."""
    start = time.perf_counter()
    with Frontend(work, grpc_url, args=["--model", "orca"]):
        return time.perf_counter() - start


def cli_run(grpc_url: str) -> tuple[float, float]:
    """(seconds to the first byte of answer, seconds to exit) of one --chat run."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "client.generate", QUESTION, "--chat", "--max-tokens", "32",
                                "--temperature", "0", "--url", grpc_url], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    first, first_seconds = process.stdout.read(1), time.perf_counter() - start
    process.stdout.read()
    if process.wait() != 0 or not first:
        raise RuntimeError("client.generate --chat failed")
    return first_seconds, time.perf_counter() - start


def row(name: str, values: list[float]) -> list:
    return [name, f"{statistics.median(values) * 1000:.0f} ms",
            f"{min(values) * 1000:.0f} - {max(values) * 1000:.0f} ms"]


def main() -> None:
    p = options(__doc__, "startup.md")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    r = Report("Start-up: the chat CLI and the OpenAI API", "bench-startup")
    prelude = (f"import json\nfrom pathlib import Path\nFOLDER = Path({str(prepare_default_model())!r})\n"
               f"MESSAGES = json.loads({MESSAGES!r})\n")
    log("fresh interpreters")
    samples = {name: [] for name in IN_FRESH_INTERPRETERS}
    for _ in range(args.repeats):  # alternating, so that a slow phase of the machine hits each
        for name, code in IN_FRESH_INTERPRETERS.items():
            samples[name].append(seconds_of(prelude + code))
    rows = [row(name, values) for name, values in samples.items()]
    with work_dir() as work, serving(work, "orca") as (server, _):
        cli_run(server.grpc_url)  # warm: the model's first iteration
        log("client.generate --chat")
        runs = [cli_run(server.grpc_url) for _ in range(args.repeats)]
        rows += [row("client.generate --chat: first byte of answer", [run[0] for run in runs]),
                 row("client.generate --chat: 32 tokens, exit", [run[1] for run in runs])]
        log("the OpenAI API from start to ready")
        rows.append(row("the OpenAI API: start to /health/ready 200",
                        [ready_seconds(work, server.grpc_url) for _ in range(args.repeats)]))
    r.add(f"Medians and ranges of {args.repeats} repeats.", "").table(["what", "median", "range"], rows)
    r.setup().write(args.markdown)


if __name__ == "__main__":
    main()
