"""Quantized weights on the CPU, offline: the default model as float32 (oneDNN), bfloat16,
weight-only int8 (`quantization: int8`) and its own Q4_1 GGUF file, in one run on the same
machine. Per mode: the bytes its weights hold, the model forward of a decode iteration at
batch 1 and 8 (16-token prompts, best of the iterations), and greedy agreement with float32
on 8 prompts (32 tokens each)."""
from __future__ import annotations

import argparse
from pathlib import Path
import sys

from benchmarks.common import REPORTS, Report, decode_forward_ms, log
from orca_backend import LLM, SamplingParams
from orca_backend.checkpoint.store import default_gguf, prepare_default_model

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--markdown", default=str(REPORTS / "quantized.md"))
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
    r.setup()
    r.write(Path(args.markdown))


if __name__ == "__main__":
    sys.exit(main())
