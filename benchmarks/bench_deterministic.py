"""What deterministic mode costs: the default model offline (`LLM`), the mode on against off,
tokens per second at batch 1 and 32 and a 512-token prefill, alternating.

    python -m benchmarks.bench_deterministic [--rounds 2] [--tokens 32]
"""
from __future__ import annotations

import statistics
import time

from benchmarks.common import Report, log, options
from orca_backend import LLM, SamplingParams
from orca_backend.checkpoint.store import prepare_default_model

PROMPT = "The library keeps its books on shelves by subject, and each shelf has a card that lists the titles."


def rate(llm: LLM, batch: int, tokens: int, prompt: str) -> float:
    """Generated tokens per second (prompt and output) of `batch` copies at once, greedy."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = [f"{i}: {prompt}" for i in range(batch)]
    start = time.perf_counter()
    llm.generate(prompts, [params] * batch)
    return batch * tokens / (time.perf_counter() - start)


def main() -> None:
    p = options(__doc__, "deterministic.md")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    model = str(prepare_default_model())
    long_prompt = " ".join([PROMPT] * 24)  # about 512 tokens: prefill dominates
    loads = {"batch 1": (1, args.tokens, PROMPT), "batch 32": (32, args.tokens, PROMPT),
             "512-token prompt, 4 tokens": (1, 4, long_prompt)}
    figures: dict[tuple[str, bool], list[float]] = {}
    for mode in (False, True) * args.rounds:
        with LLM(model, kv_cache_tokens=32768, enable_prefix_caching=False, deterministic=mode) as llm:
            rate(llm, 4, 4, PROMPT)  # warm-up
            for name, (batch, tokens, prompt) in loads.items():
                log(f"deterministic {mode}: {name}")
                figures.setdefault((name, mode), []).append(rate(llm, batch, tokens, prompt))
    rows = []
    for name in loads:
        off, on = (statistics.median(figures[(name, mode)]) for mode in (False, True))
        rows.append([name, f"{off:,.1f}", f"{on:,.1f}", f"{on / off:.2f}"])
    report = Report("Deterministic mode's cost", "bench-deterministic")
    report.add(f"The default model (SmolLM2-135M, fp32) offline on this machine's 2 cores, {args.tokens} tokens a "
               f"request (4 after the long prompt), greedy; the mode off and on alternating over {args.rounds} "
               "rounds, the median tokens/s of each (prompt tokens of the long prompt not counted).", "")
    report.table(["load", "off tokens/s", "on tokens/s", "on / off"], rows)
    report.setup().write(args.markdown)


if __name__ == "__main__":
    main()
