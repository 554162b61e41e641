"""lm-evaluation-harness against the served model: its `local-completions` model scores a small
multiple-choice task (`benchmarks/eval/mini_mc.jsonl`, nothing downloaded) by loglikelihood over
`/v1/completions`. The harness runs offline in an environment of its own (`build/lmeval-venv`,
made on first use); prompts go as text, which the server tokenizes with the model's tokenizer.

    python -m benchmarks.eval_harness    # writes docs/benchmarks/eval_harness.md
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import Report, log, options, serving, work_dir
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.serving.launch import REPO_ROOT

HARNESS = "lm_eval[api]==0.4.13"
VENV = REPO_ROOT / "build" / "lmeval-venv"
DATA = REPO_ROOT / "benchmarks" / "eval" / "mini_mc.jsonl"
TASK = {"task": "orca_mini_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(DATA)}},
        "output_type": "multiple_choice", "test_split": "test", "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}", "doc_to_target": "answer", "metadata": {"version": 1.0},
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")]}


def harness() -> Path:
    """The harness's command, installed in VENV if it is not there yet."""
    if not (VENV / "bin" / "lm_eval").exists():
        log(f"installing {HARNESS} into {VENV}")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", HARNESS, "transformers>=5"], check=True)
    return VENV / "bin" / "lm_eval"


def main() -> None:
    args = options(__doc__, "eval_harness.md").parse_args()
    r = Report("lm-evaluation-harness against the served model", "eval-harness")
    binary, tokenizer = harness(), prepare_default_model()
    with work_dir() as work, serving(work, openai=["--model", "orca"]) as (_, frontend):
        (work / "tasks").mkdir()
        (work / "tasks" / "orca_mini_mc.yaml").write_text(json.dumps(TASK))  # JSON is YAML
        model_args = (f"model=orca,base_url={frontend.url}/v1/completions,tokenizer_backend=huggingface,"
                      f"tokenizer={tokenizer},tokenized_requests=False,num_concurrent=4,max_retries=1")
        start = time.perf_counter()
        subprocess.run([str(binary), "--model", "local-completions", "--model_args", model_args, "--batch_size", "1",
                        "--tasks", "orca_mini_mc", "--include_path", str(work / "tasks"), "--output_path",
                        str(work / "out")], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                            "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"})
        seconds = time.perf_counter() - start
        result = json.loads(next((work / "out").rglob("results_*.json")).read_text())["results"]["orca_mini_mc"]
    questions = sum(1 for _ in DATA.open())
    r.add(f"{HARNESS} (its own environment, offline), `--model local-completions` against `make serve`'s "
          f"tritonserver and OpenAI API, the default model; the task `orca_mini_mc`: {questions} four-way "
          f"questions of `benchmarks/eval/mini_mc.jsonl`, each answer scored by its loglikelihood "
          f"({4 * questions} requests with `echo`, `logprobs: 1`, `max_tokens: 1`); {seconds:.0f} s for the "
          "harness's run.", "")
    r.table(["metric", "value", "stderr"], [[m, f"{result[f'{m},none']:.3f}", f"{result[f'{m}_stderr,none']:.3f}"]
                                            for m in ("acc", "acc_norm")])
    r.add("Chance is 0.25.", "")
    r.setup().write(args.markdown)


if __name__ == "__main__":
    main()
