"""Other tools on our workloads: our load generator, perf_analyzer and genai-perf on one workload
(perf.md, raw outputs in perf/), and what the OpenAI-compatible frontend adds to latency with
the model (openai.md: genai-perf in chat mode beside genai-perf over Triton's protocol; its cost
with a model that costs nothing is `make bench-host`'s). docs/benchmarks.md describes both; the
tools come from benchmarks/install_perf_tools.sh (`make perf`).

    python -m benchmarks.bench_perf --tools build/perf-tools
"""
from __future__ import annotations

import csv
import json
import math
import os
import random
import shutil
import statistics
import subprocess
from pathlib import Path

from benchmarks.common import REPORTS, Report, log, options, serving, work_dir
from benchmarks.servers import Frontend
from client.bench import run_trace, summarize, write_json
from client.generate import chat_prompt
from client.perf_inputs import input_data
from client.trace import LengthDist, load_tokenizer, make_trace
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.serving.launch import REPO_ROOT

MODEL = "orca"
# perf_analyzer's CSV splits the average latency into these parts (microseconds).
LATENCY_PARTS = ("Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input",
                 "Server Compute Infer", "Server Compute Output", "Client Recv")
ROWS = (("request_throughput", "requests/s", "{:.2f}"), ("token_throughput", "output tokens/s", "{:.1f}"),
        ("latency_avg", "request latency avg (ms)", "{:.0f}"), ("latency_p50", "request latency p50 (ms)", "{:.0f}"),
        ("latency_p99", "request latency p99 (ms)", "{:.0f}"), ("ttft_p50", "time to first token p50 (ms)", "{:.0f}"),
        ("itl_p50", "inter-token latency p50 (ms)", "{:.1f}"))
GENAI_PERF = {"request_throughput": "request_throughput_avg", "token_throughput": "output_token_throughput_avg",
              "latency_avg": "request_latency_avg", "latency_p50": "request_latency_p50",
              "latency_p99": "request_latency_p99", "ttft_p50": "time_to_first_token_p50",
              "itl_p50": "inter_token_latency_p50"}
WITH_MODEL = {"time_to_first_token_p50": "time to first token p50 (ms)",
              "time_to_first_token_p99": "time to first token p99 (ms)",
              "inter_token_latency_p50": "inter-token latency p50 (ms)",
              "inter_token_latency_p99": "inter-token latency p99 (ms)",
              "request_latency_p50": "request latency p50 (ms)", "output_token_throughput_avg": "output tokens/s"}


def portable(text: str) -> str:
    """`text` with this checkout's and this user's folders written as `.` and `~`."""
    return text.replace(str(REPO_ROOT), ".").replace(str(Path.home()), "~")


def run_tool(argv: list[str], log_path: Path, env: dict | None = None) -> str:
    """Run a tool, keep its output in `log_path`, fail loudly on a non-zero exit; returns the
    command line as a report shows it."""
    log("  $ " + " ".join(argv))
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **(env or {})}, timeout=900)
    log_path.write_text(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} exited with {proc.returncode}; output in {log_path}:\n" + proc.stdout[-3000:])
    return portable(" ".join(argv))


def perf_analyzer(tools: Path, url: str, model: str, data: dict, concurrency: int, out: Path,
                  *settings: str) -> tuple[dict[str, str], str]:
    """perf_analyzer on `model` (streaming gRPC, closed loop) with `data` as its --input-data, its
    files in `out`: the first row of its CSV, and its command line."""
    (out / "perf_analyzer_input.json").write_text(json.dumps(data, indent=1))
    command = run_tool([str(tools / "bin" / "perf_analyzer"), "-m", model, "-u", url, "-i", "grpc", "--streaming",
                        "--input-data", str(out / "perf_analyzer_input.json"), "--concurrency-range", str(concurrency),
                        *settings, "-f", str(out / "perf_analyzer.csv")], out / "perf_analyzer.log")
    with open(out / "perf_analyzer.csv") as f:
        return next(csv.DictReader(f)), command


def genai_perf(args, artifacts: Path, concurrency: int, *settings: str) -> tuple[dict, str]:
    """genai-perf on `orca`, offline, its output under `artifacts`: its statistics ("<metric>_<stat>"),
    and its command line."""
    shutil.rmtree(artifacts, ignore_errors=True)
    command = run_tool([str(args.tools / "bin" / "genai-perf"), "profile", "-m", MODEL, *settings, "--streaming",
                        "--tokenizer", str(prepare_default_model()), "--output-tokens-mean", str(args.output_tokens),
                        "--output-tokens-stddev", "0", "--random-seed", "0", "--concurrency", str(concurrency),
                        "--request-count", str(args.requests), "--warmup-request-count", str(concurrency),
                        "--stability-percentage", "50", "--artifact-dir", str(artifacts)],
                       artifacts.with_suffix(".log"), env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    found = sorted(artifacts.rglob("profile_export_genai_perf.json"))
    if not found:
        raise SystemExit(f"genai-perf wrote no profile_export_genai_perf.json under {artifacts}")
    stats = json.loads(found[0].read_text())
    flat = {f"{m}_{s}": v for m, values in stats.items() if isinstance(values, dict) for s, v in values.items()}
    return flat, command


# perf.md: three clients, one after the other, on one workload ---------------------------------

def three_clients(args, url: str, raw: Path) -> tuple[dict, list[str]]:
    """Each client's figures (per second, ms), and the tools' command lines."""
    dist = LengthDist(kind="fixed", input_tokens=args.input_tokens, output_tokens=args.output_tokens)
    trace = make_trace(dist, args.requests, None, 0, load_tokenizer())
    run_trace(url, MODEL, trace[:args.concurrency], concurrency=args.concurrency)  # warm-up
    log("client.bench ...")
    records = run_trace(url, MODEL, trace, concurrency=args.concurrency)
    s = summarize(records)
    write_json(str(raw / "client_bench.json"), s, records, {k: str(v) if isinstance(v, Path) else v
                                                            for k, v in vars(args).items()})
    if s.errors:
        raise SystemExit(f"client.bench: {s.errors} requests failed")
    results = {"client.bench": {
        "request_throughput": s.request_throughput, "token_throughput": s.token_throughput,
        "latency_avg": sum(r.end - r.sent for r in records) / len(records) * 1e3, "latency_p50": s.latency_p50 * 1e3,
        "latency_p99": s.latency_p99 * 1e3, "ttft_p50": s.ttft_p50 * 1e3, "itl_p50": s.itl_p50 * 1e3}}
    log("perf_analyzer ...")
    row, perf_command = perf_analyzer(args.tools, url, MODEL, input_data(trace), args.concurrency, raw,
                                      "--measurement-mode", "count_windows", "--measurement-request-count",
                                      str(args.requests), "--stability-percentage", "50", "--max-trials", "10",
                                      "--percentile", "50")
    results["perf_analyzer"] = {  # one response per generated token here: responses/s is output tokens/s
        "request_throughput": float(row["Inferences/Second"]), "token_throughput": float(row["Response Throughput"]),
        "latency_avg": sum(float(row[k]) for k in row if k in LATENCY_PARTS) / 1e3,
        "latency_p50": float(row["p50 latency"]) / 1e3, "latency_p99": float(row["p99 latency"]) / 1e3}
    log("genai-perf ...")
    stats, genai_command = genai_perf(args, raw / "genai_perf", args.concurrency, "--backend", "vllm",
                                      "--endpoint-type", "kserve", "-u", url, "--output-tokens-mean-deterministic",
                                      "--synthetic-input-tokens-mean", str(args.input_tokens),
                                      "--synthetic-input-tokens-stddev", "0")
    results["genai-perf"] = {key: stats.get(name, math.nan) for key, name in GENAI_PERF.items()}
    return results, [perf_command, genai_command]


def comparison(results: dict[str, dict]) -> list[list[str]]:
    rows = []
    for key, label, form in ROWS:
        cells = [results[tool].get(key) for tool in results]
        values = [c for c in cells if c is not None and math.isfinite(c)]
        spread = f"{(max(values) / min(values) - 1) * 100:.0f}%" if len(values) > 1 and min(values) > 0 else "-"
        rows.append([label, *("-" if c is None or not math.isfinite(c) else form.format(c) for c in cells), spread])
    return rows


# openai.md: genai-perf through the frontend beside genai-perf over Triton's protocol ------------

def with_model(args, server, frontend: Frontend, work: Path) -> list[list[str]]:
    """genai-perf over Triton's protocol and in chat mode through the frontend, two runs each,
    alternating; each run its own prompts (else it would hit the prefix cache of the run
    before), drawn alike for both."""
    tokenizer, folder = load_tokenizer(), prepare_default_model()
    results: dict[str, list[dict]] = {"triton": [], "chat": []}
    for i in range(2):
        for kind, runs in results.items():
            log(f"  genai-perf round {i + 1}: {kind}")
            rng = random.Random(f"{kind}-{i}")
            questions = [tokenizer.decode([rng.choice(range(1000, 20000)) for _ in range(args.input_tokens)])
                         for _ in range(args.requests + 2 * args.openai_concurrency)]
            inputs = work / f"{kind}_{i}.jsonl"
            inputs.write_text("".join(json.dumps({"text": q if kind == "chat" else chat_prompt(q, folder)}) + "\n"
                                      for q in questions))
            # Exactly `tokens` out: min_tokens = max_tokens over Triton's protocol (genai-perf's
            # "deterministic"), ignore_eos through the OpenAI API (genai-perf allows the former only there).
            endpoint = (["--endpoint-type", "chat", "-u", frontend.url, "--extra-inputs", "ignore_eos:true"]
                        if kind == "chat" else ["--backend", "vllm", "--endpoint-type", "kserve", "-u", server.grpc_url,
                                                "--output-tokens-mean-deterministic"])
            runs.append(genai_perf(args, work / f"genai_{kind}_{i}", args.openai_concurrency, *endpoint,
                                   "--input-file", str(inputs))[0])
    values = lambda kind, key: [r.get(key, math.nan) for r in results[kind]]
    return [[label, " / ".join(f"{v:.1f}" for v in values("triton", key)),
             " / ".join(f"{v:.1f}" for v in values("chat", key)),
             f"{statistics.mean(values('chat', key)) - statistics.mean(values('triton', key)):+.1f}"]
            for key, label in WITH_MODEL.items()]


def main() -> None:
    p = options(__doc__)
    p.add_argument("--tools", type=Path, default=REPO_ROOT / "build" / "perf-tools")
    p.add_argument("--out", type=Path, default=REPORTS, help="where perf.md, perf/ and openai.md go")
    p.add_argument("--concurrency", type=int, default=4, help="perf.md: requests in flight")
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=48, help="measured requests per tool and per genai-perf run")
    p.add_argument("--openai-concurrency", type=int, default=16, help="openai.md: streams at once")
    args = p.parse_args()
    raw = args.out / "perf"
    raw.mkdir(parents=True, exist_ok=True)
    perf = Report("Our figures next to perf_analyzer's and genai-perf's", "perf")
    with work_dir("orca-perf-") as work:
        with serving(work, MODEL) as (server, _):
            results, commands = three_clients(args, server.grpc_url, raw)
            openai = Report("The OpenAI frontend's added latency", "perf")
            log("genai-perf with the model ...")
            with Frontend(work, server.grpc_url, args=["--log-level", "warning"]) as frontend:
                model_rows = with_model(args, server, frontend, work)
    (raw / "results.json").write_text(json.dumps(results, indent=1))
    for path in raw.rglob("*"):  # the saved outputs name no folder of this machine
        if path.is_file() and path.suffix in (".json", ".csv", ".log", ".txt"):
            path.write_text(portable(path.read_text()))
    perf.table(["metric", *(f"`{t}`" for t in results), "max/min - 1"], comparison(results))
    perf.add("`-`: the tool does not report it; what each tool counts: "
             "[README.md](README.md#2-do-other-tools-agree-perfmd).",
             "", "Commands (the server's port varies):", "", "```", *commands, "```", "",
             "Raw outputs: [perf/](perf/) (perf_analyzer's CSV and log, genai-perf's artifacts and log, our "
             "per-request JSON).", "")
    perf.setup("- tritonserver 2.51 with `orca` only (default parameters, SmolLM2-135M-Instruct fp32 on the CPU), "
               "clients on the same machine; perf_analyzer 2.60.0, genai-perf 0.0.16",
               f"- workload: closed loop, {args.concurrency} requests in flight, prompts of {args.input_tokens} "
               f"tokens, exactly {args.output_tokens} output tokens each (ours: max_tokens with ignore_eos; the "
               f"other two: max_tokens = min_tokens), greedy, streaming gRPC; {args.requests} measured requests per "
               "tool; the three run one after the other").write(args.out / "perf.md")
    openai.section("With the model",
                   f"tritonserver with `orca` (default parameters, SmolLM2-135M-Instruct on the CPU) and the frontend; "
                   f"genai-perf 0.0.16, {args.openai_concurrency} concurrent streams, {args.requests} measured "
                   f"requests per run, prompts of {args.input_tokens} random tokens in the chat template (each run "
                   f"its own, drawn alike), {args.output_tokens} output tokens; two runs of each, alternating (values: "
                   "run 1 / run 2). What the frontend costs with a model that costs nothing: the `openai` rows of "
                   "[host.md](host.md).")
    openai.table(["metric", "Triton protocol (kserve, streaming gRPC)", "OpenAI chat (frontend)",
                  "chat - Triton (mean)"], model_rows).setup().write(args.out / "openai.md")


if __name__ == "__main__":
    main()
