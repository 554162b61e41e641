"""What speculative decoding buys on the CPU: decode speed with and without n-gram prompt lookup
at batch 1 to 32, on prompts whose answer repeats their input and on prompts whose answer does
not; a draft model at batch 1; llama-server without speculation on the same prompts (if `make
bench-cpu` built it). How it is measured: docs/speculative.md (Cost).

    python -m benchmarks.bench_spec [--rounds 2]    # writes docs/benchmarks/speculative.md
"""
from __future__ import annotations

import json
import shutil
import time
import urllib.request
from pathlib import Path

from benchmarks.common import LLAMA_CPP, Report, llama_server, log, options, work_dir
from benchmarks.headline import record
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.engine.llm import LLM

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

    shutil.copytree(model, folder, ignore=shutil.ignore_patterns("model.safetensors", "config.json"))
    config = json.loads((model / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
    save_file({k: v for k, v in load_file(model / "model.safetensors").items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers},
              folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def tokens_per_second(llm: LLM, prompts: list[str], batch: int) -> float:
    start = time.perf_counter()
    outs = llm.generate([prompts[i % len(prompts)] for i in range(batch)],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def llama_single(url: str, prompts: list[str]) -> float:
    """llama-server's decode tokens/s at one stream, as its own timings say."""
    per_token = []
    for prompt in prompts:
        body = json.dumps({"prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            per_token.append(json.loads(response.read())["timings"]["predicted_per_token_ms"])
    return 1000 / (sum(per_token) / len(per_token))


def accepted(s) -> str:
    share = s.num_accepted_tokens / max(1, s.num_draft_tokens)
    return f"{s.num_accepted_tokens:,} of {s.num_draft_tokens:,} tokens ({share:.0%})"


def main() -> None:
    p = options(__doc__, "speculative.md")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    r, model = Report("Speculative decoding on the CPU", "bench-spec"), prepare_default_model()
    settings = dict(kv_cache_tokens=16384, max_batch_size=32)
    with work_dir() as work:
        engines = {"off": LLM(**settings),
                   "ngram, always": LLM(speculative_config={**NGRAM, "max_batch_size": 64}, **settings),
                   "ngram, adaptive (max_batch_size 2, the default)": LLM(speculative_config=NGRAM, **settings)}
        cheap = first_layers(model, DRAFT_LAYERS, work / "draft")
        drafts = {"the model itself, k 4": LLM(speculative_config={"method": "draft_model", "model": str(model)},
                                               **settings),
                  f"its first {DRAFT_LAYERS} layers, k 2": LLM(speculative_config={
                      "method": "draft_model", "model": str(cheap), "num_speculative_tokens": 2}, **settings)}
        best: dict[tuple, float] = {}
        for n in range(args.rounds):
            for kind, prompts in PROMPTS.items():
                for batch in BATCHES:
                    runs = {**engines, **(drafts if batch == 1 else {})}
                    for name, llm in runs.items():
                        best[kind, batch, name] = max(best.get((kind, batch, name), 0.0),
                                                      tokens_per_second(llm, prompts, batch))
                    log(f"round {n + 1}, {kind}, batch {batch}: "
                        + ", ".join(f"{name} {best[kind, batch, name]:.0f}" for name in runs))
        speculation = {name: llm.engine.stats.speculation for name, llm in {**engines, **drafts}.items()}
        for llm in (*engines.values(), *drafts.values()):
            llm.shutdown()
        llama = {}
        if (LLAMA_CPP / "gguf/model-f32.gguf").exists():
            with llama_server(work) as url:
                llama = {kind: llama_single(url, prompts) for kind, prompts in PROMPTS.items()}

    def versus_off(kind: str, batch: int, name: str) -> str:
        return f"{best[kind, batch, name]:.0f} ({best[kind, batch, name] / best[kind, batch, 'off']:.2f}x)"
    spec = speculation["ngram, always"]
    r.add(f"The default model, greedy, {MAX_TOKENS} tokens a request, n-gram proposals of up to "
          f"{NGRAM['num_speculative_tokens']} tokens (n-grams of {NGRAM['prompt_lookup_min']} to "
          f"{NGRAM['prompt_lookup_max']}); tokens/s, best of {args.rounds} rounds. \"always\" speculates at any batch; "
          "\"adaptive\" only while at most 2 requests run ([how](../speculative.md#cost)).", "")
    r.table(["prompts", "batch", "off tok/s", *list(engines)[1:]],
            [[kind, b, f"{best[kind, b, 'off']:.0f}", *(versus_off(kind, b, n) for n in list(engines)[1:])]
             for kind in PROMPTS for b in BATCHES])
    r.add(f"Proposals accepted (always on, every run): {accepted(spec)}, by position "
          f"{spec.accepted_per_position}.", "",
          "A draft model at batch 1 (`method: draft_model`): the default model drafting for itself, and its first "
          f"{DRAFT_LAYERS} of 30 layers with its head, untrained:", "")
    r.table(["prompts", "off tok/s", *drafts],
            [[kind, f"{best[kind, 1, 'off']:.0f}", *(versus_off(kind, 1, n) for n in drafts)] for kind in PROMPTS])
    r.add(*(f"Proposals accepted, {name}: {accepted(speculation[name])}." for name in drafts), "",
          *(f"llama-server (F32 GGUF, one slot, no speculation), prompts whose answer {kind}: {rate:.0f} tokens/s "
            "at batch 1." for kind, rate in llama.items()), "")
    r.setup().write(args.markdown)
    adaptive = list(engines)[2]
    record(args.markdown, "bench-spec", {"speculative": (
        "Speculative decoding by n-gram lookup at batch 1, answers that repeat the prompt",
        f"{best['repeats its input', 1, adaptive] / best['repeats its input', 1, 'off']:.2f}x (goal 2x)")})


if __name__ == "__main__":
    main()
