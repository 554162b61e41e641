"""Our load generator, perf_analyzer and genai-perf on one workload: do their figures agree?

Starts a real tritonserver with `orca` only, then runs three clients one after the other on
the same closed-loop workload over streaming gRPC (`--concurrency` requests in flight, prompts
of `--input-tokens` tokens, exactly `--output-tokens` output tokens, greedy):

1. `client.bench` (ours), with the same prompts as 2;
2. perf_analyzer, from an --input-data file holding those prompts (`client.perf_inputs`;
   max_tokens = min_tokens pins the output length), with explicit stability
   settings (a 2-core machine rarely meets the default 10% criterion);
3. genai-perf with `--backend vllm` (the vLLM backend's input format, which `orca` speaks),
   synthetic prompts of the same length, and the model's own tokenizer folder, offline.

Each tool's raw output is saved under `--out`/perf/, and perf.md gets the comparison table.
The tools come from benchmarks/install_perf_tools.sh (`make perf` runs it first).

    python benchmarks/bench_perf.py --tools build/perf-tools
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import log, machine_lines, table  # noqa: E402
from client.bench import run_trace, summarize, write_json  # noqa: E402
from client.perf_inputs import input_data  # noqa: E402
from client.trace import LengthDist, load_tokenizer, make_trace  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.serving.launch import REPO_ROOT, Server  # noqa: E402

MODEL = "orca"
# perf_analyzer's CSV splits the average latency into these parts (microseconds).
LATENCY_PARTS = ("Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input",
                 "Server Compute Infer", "Server Compute Output", "Client Recv")
COMMANDS: dict[str, str] = {}  # tool -> its command line, for the report


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tools", type=Path, default=REPO_ROOT / "build" / "perf-tools")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=48, help="measured requests per tool")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "benchmarks")
    return p.parse_args()


def portable(text: str) -> str:
    """`text` with this checkout's and this user's folders written as `.` and `~`."""
    return text.replace(str(REPO_ROOT), ".").replace(str(Path.home()), "~")


def run_tool(argv: list[str], log_path: Path, env: dict | None = None, timeout: float = 900) -> str:
    """Run a tool, keep its output in `log_path`, and fail loudly on a non-zero exit."""
    log("  $ " + " ".join(argv))
    COMMANDS[Path(argv[0]).name] = portable(" ".join(argv))
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
    log_path.write_text(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} exited with {proc.returncode}; output in {log_path}:\n"
                         + proc.stdout[-3000:])
    return proc.stdout


def ours(server: Server, trace, args, out: Path) -> dict:
    records = run_trace(server.grpc_url, MODEL, trace, concurrency=args.concurrency)
    summary = summarize(records)
    write_json(str(out / "client_bench.json"), summary, records, vars_for_json(args))
    if summary.errors:
        raise SystemExit(f"client.bench: {summary.errors} requests failed")
    ms = lambda x: x * 1e3
    return {"request_throughput": summary.request_throughput,
            "token_throughput": summary.token_throughput,
            "latency_avg": ms(sum(r.end - r.sent for r in records) / len(records)),
            "latency_p50": ms(summary.latency_p50), "latency_p99": ms(summary.latency_p99),
            "ttft_p50": ms(summary.ttft_p50), "itl_p50": ms(summary.itl_p50)}


def vars_for_json(args) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def perf_analyzer(server: Server, trace, args, out: Path) -> dict:
    input_path = out / "perf_analyzer_input.json"
    input_path.write_text(json.dumps(input_data(trace), indent=1))
    csv_path = out / "perf_analyzer.csv"
    run_tool([str(args.tools / "bin" / "perf_analyzer"), "-m", MODEL, "-u", server.grpc_url,
              "-i", "grpc", "--streaming", "--input-data", str(input_path),
              "--concurrency-range", str(args.concurrency),
              "--measurement-mode", "count_windows",
              "--measurement-request-count", str(args.requests),
              "--stability-percentage", "50", "--max-trials", "10",
              "--percentile", "50", "-f", str(csv_path)], out / "perf_analyzer.log")
    with open(csv_path) as f:
        row = next(csv.DictReader(f))
    us = lambda key: float(row[key]) / 1e3
    latency = sum(float(row[k]) for k in row if k in LATENCY_PARTS) / 1e3
    # One response per generated token here, so responses/s is output tokens/s.
    return {"request_throughput": float(row["Inferences/Second"]),
            "token_throughput": float(row["Response Throughput"]), "latency_avg": latency,
            "latency_p50": us("p50 latency"), "latency_p99": us("p99 latency")}


def genai_perf(server: Server, args, out: Path) -> dict:
    artifacts = out / "genai_perf"
    shutil.rmtree(artifacts, ignore_errors=True)
    run_tool([str(args.tools / "bin" / "genai-perf"), "profile", "-m", MODEL,
              "--backend", "vllm", "--endpoint-type", "kserve", "--streaming",
              "-u", server.grpc_url, "--tokenizer", str(prepare_default_model()),
              "--synthetic-input-tokens-mean", str(args.input_tokens),
              "--synthetic-input-tokens-stddev", "0",
              "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
              "--output-tokens-mean-deterministic", "--random-seed", "0",
              "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
              "--warmup-request-count", str(args.concurrency),
              "--stability-percentage", "50", "--artifact-dir", str(artifacts)],
             out / "genai_perf.log", env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    found = sorted(artifacts.rglob("profile_export_genai_perf.json"))
    if not found:
        raise SystemExit(f"genai-perf wrote no profile_export_genai_perf.json under {artifacts}")
    stats = json.loads(found[0].read_text())
    get = lambda metric, stat="avg": stats.get(metric, {}).get(stat, math.nan)
    return {"request_throughput": get("request_throughput"),
            "token_throughput": get("output_token_throughput"),
            "latency_avg": get("request_latency"), "latency_p50": get("request_latency", "p50"),
            "latency_p99": get("request_latency", "p99"),
            "ttft_p50": get("time_to_first_token", "p50"),
            "itl_p50": get("inter_token_latency", "p50")}


ROWS = (("request_throughput", "requests/s", "{:.2f}"), ("token_throughput", "output tokens/s", "{:.1f}"),
        ("latency_avg", "request latency avg (ms)", "{:.0f}"),
        ("latency_p50", "request latency p50 (ms)", "{:.0f}"),
        ("latency_p99", "request latency p99 (ms)", "{:.0f}"),
        ("ttft_p50", "time to first token p50 (ms)", "{:.0f}"),
        ("itl_p50", "inter-token latency p50 (ms)", "{:.1f}"))


def comparison(results: dict[str, dict]) -> list[list[str]]:
    rows = []
    for key, label, form in ROWS:
        cells = [results[tool].get(key) for tool in results]
        values = [c for c in cells if c is not None and math.isfinite(c)]
        spread = f"{(max(values) / min(values) - 1) * 100:.0f}%" if len(values) > 1 and min(values) > 0 else "-"
        rows.append([label, *("-" if c is None or not math.isfinite(c) else form.format(c)
                              for c in cells), spread])
    return rows


def main() -> None:
    args = parse_args()
    started = datetime.datetime.now()
    out = args.out / "perf"
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer()
    dist = LengthDist(kind="fixed", input_tokens=args.input_tokens, output_tokens=args.output_tokens)
    trace = make_trace(dist, args.requests, None, 0, tokenizer)
    with tempfile.TemporaryDirectory(prefix="orca-perf-") as tmp:
        server = Server(Path(tmp), extra_args=["--model-control-mode=explicit", f"--load-model={MODEL}"])
        try:
            log("starting tritonserver ...")
            server.wait_ready()
            run_trace(server.grpc_url, MODEL, trace[:args.concurrency], concurrency=args.concurrency)
            results = {}
            log("client.bench ...")
            results["client.bench"] = ours(server, trace, args, out)
            log("perf_analyzer ...")
            results["perf_analyzer"] = perf_analyzer(server, trace, args, out)
            log("genai-perf ...")
            results["genai-perf"] = genai_perf(server, args, out)
        finally:
            server.stop()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    for path in out.rglob("*"):  # the saved outputs name no folder of this machine
        if path.is_file() and path.suffix in (".json", ".csv", ".log", ".txt"):
            path.write_text(portable(path.read_text()))
    lines = report(args, results, started)
    (args.out / "perf.md").write_text("\n".join(lines))
    print("\n".join(lines))


def report(args, results: dict, started: datetime.datetime) -> list[str]:
    return [
        "# Our figures next to perf_analyzer's and genai-perf's", "",
        "Generated by `make perf` (`python benchmarks/bench_perf.py`).", "",
        f"- date: {started.isoformat(timespec='seconds')}", *machine_lines(),
        "- tritonserver 2.51 with `orca` only (default parameters, SmolLM2-135M-Instruct fp32 "
        "on the CPU), clients on the same machine; perf_analyzer 2.60.0, genai-perf 0.0.16",
        f"- workload: closed loop, {args.concurrency} requests in flight, prompts of "
        f"{args.input_tokens} tokens, exactly {args.output_tokens} output tokens each (ours: "
        "max_tokens with ignore_eos; the other two: max_tokens = min_tokens), greedy, "
        f"streaming gRPC; {args.requests} measured requests per tool; "
        "the three run one after the other", "",
        *table(["metric", *(f"`{t}`" for t in results), "max/min - 1"], comparison(results)), "",
        "`-`: the tool does not report it. perf_analyzer's tokens/s is its response "
        "throughput: `orca` streams one response per generated token. Its latency is the "
        "time from sending a request to its final response, like ours (its log says it uses "
        "the first response of a decoupled model, but its figures match end-to-end latency, "
        "not time to first token). genai-perf "
        "counts throughput over its measurement window and tokenizes the streamed text with "
        "the model's tokenizer to count tokens; we count the tokens the server reports.", "",
        "Commands (the server's port varies):", "", "```",
        *(f"{command}" for command in COMMANDS.values()), "```", "",
        "Raw outputs: [perf/](perf/) (perf_analyzer's CSV and log, genai-perf's artifacts and "
        "log, our per-request JSON).", ""]


if __name__ == "__main__":
    main()
