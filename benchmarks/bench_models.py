"""What each model family costs a decode iteration, and what a sliding window saves in K/V.

Every family of the model zoo (tools/model_zoo.py, the configurations the tests check
against transformers), one engine each in turn over rounds: the model forward of
full decode iterations at batch 1 and 32, beside the parameters it reads, so that nothing
family-specific costs more than its share of the work. Then a 4,096-token request on a
Mistral-shaped model with and without a 512-token window: the K/V blocks it holds while it
decodes, and at most.

    python -m benchmarks.bench_models [--rounds 3] [--steps 10]   # writes docs/benchmarks/models.md
"""
from __future__ import annotations

import statistics
import time

from benchmarks.common import Report, decode_forward_ms, log, num_params, off_main_thread, options, work_dir
from benchmarks.headline import record
from orca_backend.checkpoint.config import ModelConfig
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.engine.llm import LLM
from tools.model_zoo import FAMILIES, save_family

BATCHES = (1, 32)
LONG, WINDOW, BLOCK = 4096, 512, 16


def decode_ms(llm: LLM, batch: int, steps: int) -> list[float]:
    """The model forward's ms of each iteration in which all `batch` requests decode."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    return decode_forward_ms(engine, batch, lambda i: engine.add_request(
        f"{time.monotonic_ns()}-{i}", [3 + (i + j) % 500 for j in range(16)], params))


def family_costs(args, r: Report, tokenizer) -> None:
    with work_dir() as tmp:
        folders = {kind: off_main_thread(save_family, kind, tmp / kind, tokenizer) for kind in FAMILIES}
        times = {(k, b): [] for k in folders for b in BATCHES}
        for n in range(args.rounds):
            for kind, folder in folders.items():
                with LLM(str(folder), kv_cache_tokens=8192, max_batch_size=max(BATCHES)) as llm:
                    for batch in BATCHES:
                        times[(kind, batch)] += decode_ms(llm, batch, args.steps)
            log(f"round {n + 1} of {args.rounds}")
        params = {kind: num_params(folder) for kind, folder in folders.items()}
        layers = {kind: ModelConfig.from_folder(folder).num_layers for kind, folder in folders.items()}
    med = {key: statistics.median(v) for key, v in times.items()}
    base = "llama-3.1"
    r.section("Decode cost per family", "The zoo's configurations (2 to 4 layers, hidden 64, 4 heads; Phi-3 "
              "hidden 96), fp32 on the CPU, prompts of 16 tokens; model forward per full decode iteration, median over "
              f"{args.rounds} rounds of {args.steps} steps, families taking turns; `per layer vs {base}`: the time "
              f"per layer against {base}'s at the same batch. At this size an iteration is mostly the fixed cost of each op, not its "
              "FLOPs (their parameters are listed for the work's share), so the ratios show what each family adds in "
              "ops: norms after the branches, q/k norms, soft caps, windows.")
    rows = []
    for kind in folders:
        per_layer = [med[(kind, b)] / layers[kind] / (med[(base, b)] / layers[base]) for b in BATCHES]
        rows.append([kind, FAMILIES[kind][0], layers[kind], f"{params[kind] / 1e3:.0f} k"] + [
            f"{med[(kind, b)]:.2f}" for b in BATCHES] + [f"{x:.2f}x" for x in per_layer])
    r.table(["family", "architecture", "layers", "parameters", *[f"ms, batch {b}" for b in BATCHES],
             *[f"per layer vs {base}, batch {b}" for b in BATCHES]], rows)


def window_blocks(args, r: Report, tokenizer) -> dict[str, tuple[int, int]]:
    """Blocks held by one LONG-token request while it decodes (the most, and the last), with
    and without a WINDOW-token window on every layer."""
    held = {}
    with work_dir() as tmp:
        for name, window in (("no window", None), (f"window {WINDOW}", WINDOW)):
            folder = off_main_thread(save_family, "mistral", tmp / name.replace(" ", "-"), tokenizer,
                                     sliding_window=window, max_position_embeddings=2 * LONG)
            with LLM(str(folder), kv_cache_tokens=2 * LONG, block_size=BLOCK, max_num_batched_tokens=512) as llm:
                engine = llm.engine
                engine.add_request("long", [3 + i % 500 for i in range(LONG - 64)],
                                   SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
                peak = decoding = tokens = 0
                while engine.has_unfinished_requests():
                    tokens += sum(len(d.token_ids) for d in engine.step())
                    blocks = len(engine.kv.held_blocks("long"))
                    peak = max(peak, blocks)
                    if tokens > 2:  # decoding: the last prompt chunk's blocks are behind it
                        decoding = max(decoding, blocks)
                held[name] = (decoding, peak)
            log(f"{name}: {held[name]}")
    r.section("K/V blocks of a long request", f"A Mistral-shaped model (the zoo's), one request of {LONG - 64} prompt "
              f"tokens and 64 decoded, blocks of {BLOCK} tokens, prompts in chunks of 512: the blocks it holds at "
              "most while it decodes, and at most at any time (a chunk of the prompt beside the window).")
    r.table(["model", "blocks held while decoding", "at most", "tokens of K/V while decoding"],
            [[name, d, p, d * BLOCK] for name, (d, p) in held.items()])
    return held


def main() -> None:
    p = options(__doc__, "models.md")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    tokenizer = prepare_default_model() / "tokenizer.json"
    r = Report("Model families: decode cost, and the K/V a window saves", "bench-models")
    family_costs(args, r, tokenizer)
    held = window_blocks(args, r, tokenizer)
    r.setup().write(args.markdown)
    full, windowed = held["no window"][0], held[f"window {WINDOW}"][0]
    record(args.markdown, "bench-models", {"models": (
        f"Sliding windows: K/V blocks a {LONG}-token request holds while decoding, a {WINDOW}-token window on every "
        "layer against none", f"{windowed} against {full} blocks ({full / windowed:.1f}x less)")})


if __name__ == "__main__":
    main()
