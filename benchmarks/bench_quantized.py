"""Quantized weights on the CPU. Offline: the default model as float32 (oneDNN), bfloat16,
weight-only int8 (`quantization: int8`) and its own Q4_1 GGUF file, in one run on the same
machine; per mode the bytes its weights hold, the model forward of a decode iteration at
batch 1 and 8 (16-token prompts, best of the iterations), and greedy agreement with float32
on 8 prompts (32 tokens each). Served (unless --no-served): `orca` and llama.cpp's
`llama-server` on the same GGUF files, the default model's Q4_1 and a Q8_0 made from its F32
by llama.cpp's own `llama-quantize` (benchmarks/build_llama_cpp.sh), measured as
`make bench-cpu` measures its servers (bench_cpu.served)."""
from __future__ import annotations

import argparse
from pathlib import Path
import sys

from benchmarks.common import (LLAMA_CPP, REPORTS, Report, add_sweep_options, apply_preset, copy_model,
                               decode_forward_ms, llama_server, log, serving, work_dir)
from benchmarks.headline import record
from orca_backend import LLM, SamplingParams
from orca_backend.checkpoint.store import default_gguf, prepare_default_model
from orca_backend.simulate.sweep import describe, sustained_rate

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
           "Water boils at", "import numpy as np\n", "My favourite food is", "In 1492,"]
MODES = {"float32 (oneDNN)": dict(), "bfloat16": dict(dtype="bfloat16"), "int8 weight-only": dict(quantization="int8"),
         "GGUF Q4_1 (the file as stored)": dict(model="gguf")}


def run(name: str, options: dict, reference: list[list[int]] | None):
    model = str(default_gguf()) if options.get("model") == "gguf" else str(prepare_default_model())
    kwargs = {k: v for k, v in options.items() if k != "model"}
    with LLM(model, **kwargs) as llm:
        engine, m = llm.engine, llm.engine.executor.runner.model
        held = sum(_weights(m))
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        decode = {b: min(decode_forward_ms(engine, b, lambda i: engine.add_request(f"{name}-{b}-{i}", PROMPTS[i % 8], params)))
                  for b in (1, 8)}
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    tokens = [o.token_ids for o in outs]
    agree = None
    if reference is not None:
        lead = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), 32) for t, r in zip(tokens, reference)]
        agree = f"{sum(n == 32 for n in lead)}/8 ({', '.join(map(str, lead))})"
    log(f"{name}: {held / 1e6:.0f} MB, decode {decode}, agreement {agree}")
    return held, decode, agree, tokens


def _weights(model):
    """The bytes of each weight the model holds once: projections as packed, the table."""
    seen = {}
    for lin in model.linears():
        w = lin.weight if lin.weight is not None else lin._run
        seen[id(w)] = _nbytes(w)
    seen[id(model.embed)] = _nbytes(model.embed)
    return seen.values()


def _nbytes(w) -> int:
    if hasattr(w, "nbytes"):
        return int(w.nbytes)
    # oneDNN's reordered weight lives in its closure
    return sum(int(c.cell_contents.nbytes) for c in (w.__closure__ or []) if hasattr(c.cell_contents, "nbytes"))


def bench_served(args, r: Report) -> None:
    import subprocess

    from benchmarks.bench_cpu import PRESET, served
    from client.trace import load_tokenizer
    from orca_backend.serving.launch import REPO_ROOT

    subprocess.run(["bash", str(REPO_ROOT / "benchmarks/build_llama_cpp.sh"), str(LLAMA_CPP), sys.executable,
                    str(prepare_default_model())], check=True)
    apply_preset(args, PRESET)
    files = {"Q4_1": default_gguf(), "Q8_0": LLAMA_CPP / "gguf/model-q8_0.gguf"}
    tokenizer, results = load_tokenizer(), {}
    with work_dir() as work:
        for kind, path in files.items():
            repository = work / f"repo-{kind}"
            copy_model(repository, "orca", model=str(path))
            with serving(work, repository=repository, openai=[]) as (_, frontend):
                results[f"orca {kind}"] = served(args, frontend.url, "orca", f"orca {kind}", tokenizer)
            with llama_server(work, slots=args.slots, path=path) as url:
                results[f"llama-server {kind}"] = served(args, url, "model", f"llama-server {kind}", tokenizer)
    rows = [["decode, one request (ms/token)", *(f"{one['decode'] * 1e3:.1f}" for one, _ in results.values())]]
    rows += [[f"1-token request, {k}-token prompt (ms)", *(f"{one[k] * 1e3:.0f}" for one, _ in results.values())]
             for k in (8, 128, 512)]
    rows.append([f"sustained rate, median normalized latency <= {args.bound_ms:g} ms/token",
                 *(describe(*sustained_rate(points, "normalized_latency_p50", args.bound_ms / 1e3)) + " req/s"
                   for _, points in results.values())])
    r.section("Served, side by side, the same GGUF files",
              f"One server at a time on the same cores, the same OpenAI `/v1/completions` streaming client and trace "
              f"as `make bench-cpu` (ORCA's lengths x {args.scale:g}, rates {args.rates}, {args.duration:g} s each); "
              f"llama-server: {args.slots} slots, every core.")
    r.table(["", *results], rows)
    ours, theirs = results["orca Q4_1"], results["llama-server Q4_1"]
    rate = {name: describe(*sustained_rate(points, "normalized_latency_p50", args.bound_ms / 1e3))
            for name, (_, points) in results.items()}
    args.headline = {"quantized": (
        "The default model's Q4_1 GGUF served by `orca` against llama.cpp's `llama-server` on the same file: one "
        f"stream's decode time per token; sustained rate under {args.bound_ms:g} ms/token",
        f"{ours[0]['decode'] * 1e3:.1f} against {theirs[0]['decode'] * 1e3:.1f} ms (goal: at or below); "
        f"{rate['orca Q4_1']} against {rate['llama-server Q4_1']} req/s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--markdown", default=str(REPORTS / "quantized.md"))
    p.add_argument("--no-served", action="store_true", help="the offline table only")
    p.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots")
    p.add_argument("--bound-ms", type=float, default=250.0, help="median normalized latency bound")
    p.add_argument("--seed", type=int, default=0)
    add_sweep_options(p)
    args = p.parse_args()
    r = Report("Quantized weights on the CPU", "bench-quantized")
    rows, reference = [], None
    for name, options in MODES.items():
        held, decode, agree, tokens = run(name, options, reference)
        reference = reference or tokens
        rows.append([name, f"{held / 1e6:.0f} MB", f"{decode[1]:.1f} ms", f"{decode[8]:.1f} ms", agree or "(the reference)"])
    r.section("Decode and agreement",
              "The model forward of one decode iteration (best over a 24-token decode, 16-token prompts), "
              "the bytes of the projections' weights and the embedding table as held, and the prompts whose "
              "32 greedy tokens all equal float32's, with each prompt's leading equal tokens. The GGUF file's "
              "reference is float32 on the file's own weights dequantized, which its first row is.")
    r.table(["weights", "held", "decode, batch 1", "batch 8", "greedy agreement with float32"], rows)
    args.headline = {}
    if not args.no_served:
        bench_served(args, r)
    r.setup()
    r.write(Path(args.markdown))
    record(Path(args.markdown), "bench-quantized", args.headline)


if __name__ == "__main__":
    sys.exit(main())
