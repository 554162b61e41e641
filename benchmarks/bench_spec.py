"""What speculative decoding buys on this machine: decode speed with and without n-gram prompt
lookup, on prompts whose answer repeats their input (editing, code) and on prompts whose answer
does not, at batch 1 to 32; where the adaptive switch (`max_batch_size`) should sit; a draft
model at batch 1 (the default model drafting for itself: every proposal holds, at a draft as
dear as the model; and its first layers alone, untrained: a cheap draft that guesses badly);
and llama.cpp's llama-server (no speculation, F32 GGUF of the same weights) on the same prompts.

One engine per configuration, all built first; rounds alternate between them. Figures are
generated tokens per second of wall time (`LLM.generate`, greedy, `ignore_eos`, 64 tokens a
request), best of the rounds; a batch of B repeats the kind's prompts round-robin.

    python benchmarks/bench_spec.py [--rounds 2] [--markdown docs/benchmarks/speculative.md]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import log, machine_lines, table  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.core.sampling_params import SamplingParams  # noqa: E402
from orca_backend.engine.llm import LLM  # noqa: E402
from orca_backend.serving.launch import REPO_ROOT, free_ports  # noqa: E402

MAX_TOKENS = 64
TEXT = ("Speculative decoding proposes several tokens and checks them in one pass over the weights, so a "
        "step that reads every weight can yield more than one token when the proposals hold.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal += item.price * item.quantity\n    return subtotal * (1 + tax_rate)\n")
PROMPTS = {
    "repeats its input": [
        f"Fix the spelling and return the whole text unchanged otherwise.\nText: {TEXT}\nFixed text: {TEXT[:40]}",
        f"Rename subtotal to running_total in this code and return all of it.\n{CODE}\nRenamed:\n{CODE[:30]}",
        f"Copy this paragraph exactly.\n{TEXT}\nCopy: {TEXT[:25]}"],
    "does not": ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
                 "List ten ideas for a weekend in the mountains, with a sentence on each.",
                 "Explain to a child why the sky is blue."]}
BATCHES = (1, 2, 4, 8, 16, 32)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 4}


DRAFT_LAYERS = 8  # of the default model's 30, for the cheap draft


def first_layers(model: Path, num_layers: int, folder: Path) -> Path:
    """A checkpoint of `model`'s embeddings, first `num_layers` layers, final norm and head."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, folder / f.name)
    config = json.loads((model / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
    weights = load_file(model / "model.safetensors")
    save_file({k: v for k, v in weights.items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers},
              folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def tokens_per_second(llm: LLM, prompts: list[str], batch: int) -> float:
    requests = [prompts[i % len(prompts)] for i in range(batch)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(requests, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def llama_single(prompts: list[str]) -> float | None:
    """llama-server's decode tokens/s at one stream, as its own timings say; None if not built
    (`make bench-cpu` builds it)."""
    root = REPO_ROOT / "build" / "llama.cpp"
    binary, gguf = root / "cmake-build/bin/llama-server", root / "gguf/model-f32.gguf"
    if not binary.exists() or not gguf.exists():
        return None
    port = free_ports(1)[0]
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
                             "-c", "2048", "-t", str(os.cpu_count()), "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        per_token = []
        for prompt in prompts:
            body = json.dumps({"prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                               "cache_prompt": False}).encode()
            request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as r:
                per_token.append(json.loads(r.read())["timings"]["predicted_per_token_ms"])
        return 1000 / (sum(per_token) / len(per_token))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args()
    options = dict(kv_cache_tokens=16384, max_batch_size=32)
    model = prepare_default_model()
    engines = {"off": LLM(**options),
               "ngram, always": LLM(speculative_config={**NGRAM, "max_batch_size": 64}, **options),
               "ngram, adaptive (max_batch_size 2, the default)": LLM(speculative_config=NGRAM, **options)}
    cheap = first_layers(model, DRAFT_LAYERS, REPO_ROOT / "build" / f"draft-{DRAFT_LAYERS}-layers")
    drafts = {"the model itself, k 4": LLM(speculative_config={"method": "draft_model", "model": str(model)},
                                           **options),
              f"its first {DRAFT_LAYERS} layers, k 2": LLM(speculative_config={
                  "method": "draft_model", "model": str(cheap), "num_speculative_tokens": 2}, **options)}
    best: dict[tuple, float] = {}
    for r in range(args.rounds):
        for kind, prompts in PROMPTS.items():
            for batch in BATCHES:
                runs = {**engines, **(drafts if batch == 1 else {})}
                for name, llm in runs.items():
                    rate = tokens_per_second(llm, prompts, batch)
                    best[(kind, batch, name)] = max(best.get((kind, batch, name), 0.0), rate)
                log(f"round {r + 1}, {kind}, batch {batch}: " + ", ".join(
                    f"{name} {best[(kind, batch, name)]:.0f}" for name in runs))
    accepted = {name: llm.engine.stats.speculation for name, llm in {**engines, **drafts}.items()}
    for llm in (*engines.values(), *drafts.values()):
        llm.shutdown()
    llama = {kind: llama_single(prompts) for kind, prompts in PROMPTS.items()}

    def versus_off(kind: str, batch: int, name: str) -> str:
        rate = best[(kind, batch, name)]
        return f"{rate:.0f} ({rate / best[(kind, batch, 'off')]:.2f}x)"

    rows = [[kind, batch, f"{best[(kind, batch, 'off')]:.0f}", *(versus_off(kind, batch, n) for n in list(engines)[1:])]
            for kind in PROMPTS for batch in BATCHES]
    draft_rows = [[kind, f"{best[(kind, 1, 'off')]:.0f}", *(versus_off(kind, 1, n) for n in drafts)] for kind in PROMPTS]
    spec = accepted["ngram, always"]
    lines = [f"# Speculative decoding on the CPU ({datetime.date.today()})", "",
             f"`python benchmarks/bench_spec.py --rounds {args.rounds}` (`make bench-spec`): the default model, "
             f"greedy, {MAX_TOKENS} tokens a request (`ignore_eos`), n-gram proposals of up to "
             f"{NGRAM['num_speculative_tokens']} tokens (n-grams of {NGRAM['prompt_lookup_min']} to "
             f"{NGRAM['prompt_lookup_max']}); generated tokens per second, best of the rounds. \"always\" "
             "speculates at any batch; \"adaptive\" only while at most 2 requests run.", "",
             *table(["prompts", "batch", "off tok/s", *list(engines)[1:]], rows), "",
             f"Proposals accepted (always on, every run): {spec.num_accepted_tokens:,} of "
             f"{spec.num_draft_tokens:,} tokens ({spec.num_accepted_tokens / max(1, spec.num_draft_tokens):.0%}), "
             f"by position {spec.accepted_per_position}.", "",
             "A draft model at batch 1 (`method: draft_model`; the adaptive switch at its default): the default "
             f"model drafting for itself, and a checkpoint of its first {DRAFT_LAYERS} of 30 layers with its "
             "head (`first_layers` here, no training):", "",
             *table(["prompts", "off tok/s", *drafts], draft_rows), "",
             *(f"Proposals accepted, {name}: {s.num_accepted_tokens:,} of {s.num_draft_tokens:,} "
               f"({s.num_accepted_tokens / max(1, s.num_draft_tokens):.0%})."
               for name, s in ((n, accepted[n]) for n in drafts)), ""]
    for kind, rate in llama.items():
        if rate is not None:
            lines.append(f"llama-server (F32 GGUF, one slot, no speculation), prompts whose answer {kind}: "
                         f"{rate:.0f} tokens/s at batch 1.")
    lines += ["", *machine_lines(), ""]
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
