"""lm-evaluation-harness against the served model: its `local-completions` model scores a small
multiple-choice task by loglikelihood (`/v1/completions` with `echo`, `logprobs` and
`max_tokens` 1), the task defined here over `benchmarks/eval/mini_mc.jsonl` (nothing is
downloaded), and the accuracy it reports written out.

The harness runs in a virtual environment of its own (`build/lmeval-venv`, made on first use
from PyPI), offline (`HF_HUB_OFFLINE`, `HF_DATASETS_OFFLINE`), with the default model's tokenizer
folder for counting context tokens; prompts go as text (`tokenized_requests=False`), which the
server tokenizes with the same tokenizer.

    python benchmarks/eval_harness.py [--markdown docs/benchmarks/eval_harness.md]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import log, machine_lines, table  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.serving.launch import REPO_ROOT, Frontend, Server  # noqa: E402

HARNESS = "lm_eval[api]==0.4.13"
VENV = REPO_ROOT / "build" / "lmeval-venv"
DATA = Path(__file__).resolve().parent / "eval" / "mini_mc.jsonl"
TASK = """task: orca_mini_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
  - {{metric: acc_norm, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
"""


def harness() -> Path:
    """The harness's command, installed in its own environment if it is not there yet."""
    binary = VENV / "bin" / "lm_eval"
    if not binary.exists():
        log(f"installing {HARNESS} into {VENV}")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", HARNESS, "transformers>=5"], check=True)
    return binary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--markdown", type=Path)
    args = p.parse_args()
    binary, tokenizer = harness(), prepare_default_model()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "tasks").mkdir()
        (tmp / "tasks" / "orca_mini_mc.yaml").write_text(TASK.format(data=DATA))
        server = Server(tmp / "triton")
        try:
            server.wait_ready()
            frontend = Frontend(tmp, server.grpc_url, args=["--model", "orca"])
            try:
                frontend.wait_ready()
                model_args = (f"model=orca,base_url={frontend.url}/v1/completions,tokenizer_backend=huggingface,"
                              f"tokenizer={tokenizer},tokenized_requests=False,num_concurrent=4,max_retries=1")
                command = [str(binary), "--model", "local-completions", "--model_args", model_args,
                           "--batch_size", "1", "--tasks", "orca_mini_mc", "--include_path", str(tmp / "tasks"),
                           "--output_path", str(tmp / "out")]
                start = time.perf_counter()
                subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                          "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"})
                seconds = time.perf_counter() - start
            finally:
                frontend.stop()
        finally:
            server.stop()
        result = json.loads(next((tmp / "out").rglob("results_*.json")).read_text())["results"]["orca_mini_mc"]
    questions = sum(1 for _ in DATA.open())
    rows = [[metric, f"{result[f'{metric},none']:.3f}", f"{result[f'{metric}_stderr,none']:.3f}"]
            for metric in ("acc", "acc_norm")]
    lines = [f"# lm-evaluation-harness against the served model ({datetime.date.today()})", "",
             f"`python benchmarks/eval_harness.py` (`make eval-harness`): {HARNESS} (its own environment, "
             f"offline), `--model local-completions` against `make serve`'s tritonserver and OpenAI API, the "
             f"default model; the task `orca_mini_mc`: {questions} four-way questions of "
             f"`benchmarks/eval/mini_mc.jsonl`, each answer scored by its loglikelihood ({4 * questions} "
             f"requests with `echo`, `logprobs: 1`, `max_tokens: 1`); {seconds:.0f} s for the harness's run.", "",
             *table(["metric", "value", "stderr"], rows), "", "Chance is 0.25.", "", *machine_lines(), ""]
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
