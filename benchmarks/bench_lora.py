"""What multi-LoRA costs a decoding iteration: batch 32 on the default model, every row with a
rank-16 adapter, 1, 4 or 8 adapters round-robin, beside the base model alone, on one engine;
then each projection's correction timed alone. How it is measured: docs/lora.md (Cost).

    python -m benchmarks.bench_lora [--rounds 3] [--steps 12]    # writes docs/benchmarks/lora.md
"""
from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.common import Report, decode_forward_ms, log, num_params, options, work_dir
from benchmarks.headline import record
from orca_backend.checkpoint.config import ModelConfig
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.engine.llm import LLM
from orca_backend.lora import LoRABatch

BATCH, RANK, MOST = 32, 16, 8
MIXES = (1, 4, MOST)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QV = ("q_proj", "v_proj")  # PEFT's default targets for Llama
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def write_adapter(folder: Path, model: ModelConfig, seed: int, targets: tuple[str, ...]) -> Path:
    """A PEFT-format adapter of rank RANK on `targets` of every layer (random, small B)."""
    g, tensors = torch.Generator().manual_seed(seed), {}
    for layer in range(model.num_layers):
        for proj, (out, inp) in model.projection_shapes().items():
            if proj in targets:
                key = f"base_model.model.model.layers.{layer}.{'mlp' if proj in ALL[4:] else 'self_attn'}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, inp, generator=g) / inp ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(targets)}))
    return folder


def decode_round(llm: LLM, adapters: list[str | None], steps: int) -> list[float]:
    """Fill the batch, run it into decode, then `steps` full decode iterations: the model
    forward's ms of each iteration of BATCH decoding rows and no prefill."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    return decode_forward_ms(engine, BATCH, lambda i: engine.add_request(
        f"{time.monotonic_ns()}-{i}", PROMPT, params, lora_name=adapters[i % len(adapters)]))


def correction_profile(llm: LLM, adapters: list[str]) -> dict[str, float]:
    """Microseconds per decode iteration spent adding the corrections, by projection (the
    prefill iteration is counted in: small beside six decode ones)."""
    spent, original = defaultdict(float), LoRABatch.add

    def timed(self, y, x, layer, projection):
        start = time.perf_counter()
        out = original(self, y, x, layer, projection)
        spent[projection] += time.perf_counter() - start
        return out
    LoRABatch.add = timed
    try:
        iterations = len(decode_round(llm, adapters, 6))
    finally:
        LoRABatch.add = original
    return {k: v / max(1, iterations) * 1e6 for k, v in spent.items()}


def main() -> None:
    p = options(__doc__, "lora.md")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    r, path = Report("Multi-LoRA: the cost of a decoding iteration", "bench-lora"), prepare_default_model()
    model = ModelConfig.from_folder(path)
    with work_dir() as tmp, LLM(str(path), enable_lora=True, max_loras=MOST, max_lora_rank=RANK, max_batch_size=BATCH,
                                kv_cache_tokens=8192, max_num_batched_tokens=1024) as llm:
        for targets, kind in ((ALL, "all"), (QV, "qv")):
            for i in range(MOST):
                llm.engine.add_lora(f"{kind}-{i}", str(write_adapter(tmp / f"{kind}-{i}", model, i, targets)))
        configs = {"base model alone": [None]}
        configs |= {f"{k} adapter{'s' * (k > 1)}": [f"all-{i}" for i in range(k)] for k in MIXES}
        configs[f"{MOST} adapters on q and v only"] = [f"qv-{i}" for i in range(MOST)]
        forward_ms = {c: [] for c in configs}
        for n in range(args.rounds):
            for c, adapters in configs.items():
                forward_ms[c] += decode_round(llm, adapters, args.steps)
                log(f"round {n + 1}: {c}: {statistics.median(forward_ms[c][-args.steps:]):.1f} ms")
        profile = correction_profile(llm, configs[f"{MOST} adapters"])
        base_params, adapter_params = num_params(path), num_params(tmp / "all-0")
    medians = {c: statistics.median(v) for c, v in forward_ms.items()}
    reference, total = medians["base model alone"], sum(profile.values())
    r.add(f"The default model, batch {BATCH}, every row decoding; adapters of rank {RANK} on all seven projections "
          "(the last row: q and v only), assigned round-robin. Model forward per decode iteration, median of every "
          f"full decode iteration of {args.rounds} rounds, configurations taking turns ([how](../lora.md#cost)).", "")
    r.table(["batch", "forward ms / iteration", "vs the base model", "tokens/s", "iterations"],
            [[c, f"{m:.1f}", f"{m / reference:.2f}x", f"{BATCH / m * 1e3:,.0f}", len(forward_ms[c])]
             for c, m in medians.items()])
    r.add(f"A decode iteration reads every weight it uses once: the model's {base_params / 1e6:.1f} M parameters, "
          f"and with {MOST} all-projection adapters {MOST} x {adapter_params / 1e6:.2f} M more, so "
          f"{1 + MOST * adapter_params / base_params:.2f}x is what they cost if every byte costs the same (these "
          "CPUs are bound by memory at this batch).", "",
          f"Where the correction goes with {MOST} adapters (a second pass timing each projection's correction, µs "
          f"per iteration; {total / 1e3:.1f} ms in all):", "")
    r.table(["projection", "µs / iteration", "share"],
            [[k, f"{v:,.0f}", f"{v / total:.0%}"] for k, v in sorted(profile.items(), key=lambda kv: -kv[1])])
    r.setup().write(args.markdown)
    record(args.markdown, "bench-lora", {"lora": (
        f"Multi-LoRA: a decode iteration at batch {BATCH} with {MOST} rank-{RANK} adapters on every projection mixed, "
        "against the base model", f"{medians[f'{MOST} adapters'] / reference:.2f}x")})


if __name__ == "__main__":
    main()
