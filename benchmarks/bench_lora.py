"""What multi-LoRA costs a decoding iteration: batch 32 on the default model, every row with an
adapter (rank 16 on all seven projections, the costliest kind), spread over 1, 4 and 8
adapters round-robin (so an adapter's rows are never side by side: the gathered path), beside
the base model alone (the same engine, no adapter in the batch: an iteration without adapters
runs exactly the code of LoRA off).

One engine serves every configuration (two engines in one process contend for the cores:
their thread pools slow each other's small products by a factor); rounds alternate between
the configurations, so a slow phase of this noisy machine hits each. The figure is the model forward of full decode
iterations (32 rows, no prefill), as the runner times it, median over every round; then a
second pass times the correction alone, by projection (what the rows' adapters add).

    python benchmarks/bench_lora.py [--rounds 3] [--steps 12] [--markdown docs/benchmarks/lora.md]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import log, machine_lines, table  # noqa: E402
from orca_backend.checkpoint.config import ModelConfig  # noqa: E402
from orca_backend.checkpoint.store import prepare_default_model  # noqa: E402
from orca_backend.core.sampling_params import SamplingParams  # noqa: E402
from orca_backend.engine.llm import LLM  # noqa: E402
from orca_backend.lora import LoRABatch  # noqa: E402
from orca_backend.lora.adapter import _projection_shapes  # noqa: E402

BATCH, RANK = 32, 16
MIXES = (0, 1, 4, 8)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QV = ("q_proj", "v_proj")  # PEFT's default targets for Llama
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def write_adapter(folder: Path, model: ModelConfig, seed: int, targets: tuple[str, ...] = ALL) -> Path:
    """A PEFT-format adapter of rank RANK on `targets` of every layer (random, small B)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for proj, (out, inp) in _projection_shapes(model).items():
            if proj not in targets:
                continue
            part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, inp, generator=g) / inp ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(targets)}))
    return folder


class Config:
    def __init__(self, label: str, llm: LLM, adapters: list[str | None]) -> None:
        self.label, self.llm, self.adapters, self.forward_ms = label, llm, adapters, []

    def round(self, steps: int) -> None:
        """Fill the batch, run it into decode, then time `steps` full decode iterations."""
        engine = self.llm.engine
        params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
        for i in range(BATCH):
            engine.add_request(f"{self.label}-{time.monotonic_ns()}-{i}", PROMPT, params,
                               lora_name=self.adapters[i % len(self.adapters)])
        while engine.has_unfinished_requests():
            before = engine.stats.forward_seconds
            its = engine.step().iterations
            if its and all(it.num_decode_requests == BATCH and it.num_prefill_requests == 0 for it in its):
                self.forward_ms.append((engine.stats.forward_seconds - before) / len(its) * 1e3)
        assert engine.kv.num_used_blocks == 0


def correction_profile(config: Config) -> dict[str, float]:
    """Microseconds per decode iteration spent adding the corrections, by projection."""
    spent: dict[str, float] = defaultdict(float)
    calls = [0]
    original = LoRABatch.add

    def timed(self, y, x, layer, projection):
        start = time.perf_counter()
        out = original(self, y, x, layer, projection)
        spent[projection] += time.perf_counter() - start
        calls[0] += 1
        return out

    LoRABatch.add = timed
    try:
        n = len(config.forward_ms)
        config.round(6)
        iterations = len(config.forward_ms) - n
    finally:
        LoRABatch.add = original
        del config.forward_ms[n:]
    # the prefill iteration's share is small beside six decode ones; it is counted in
    return {k: v / max(1, iterations) * 1e6 for k, v in spent.items()}


def num_params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                total += torch.Size(f.get_slice(key).get_shape()).numel()
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    path = prepare_default_model()
    model = ModelConfig.from_folder(path)
    options = dict(max_batch_size=BATCH, kv_cache_tokens=8192, max_num_batched_tokens=1024, async_scheduling=args.async_scheduling)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"r16-{i}" for i in range(max(MIXES))]
        folders = {n: write_adapter(Path(tmp) / n, model, i) for i, n in enumerate(names)}
        qv_names = [f"r16-qv-{i}" for i in range(max(MIXES))]
        folders |= {n: write_adapter(Path(tmp) / n, model, i, QV) for i, n in enumerate(qv_names)}
        lora = LLM(str(path), enable_lora=True, max_loras=max(MIXES), max_lora_rank=RANK, **options)
        for n, folder in folders.items():
            lora.engine.add_lora(n, str(folder))
        configs = [Config(f"{k} adapter{'s' if k != 1 else ''}" if k else "base model alone", lora, names[:k] or [None])
                   for k in MIXES] + [Config(f"{max(MIXES)} adapters on q and v only", lora, qv_names)]
        for r in range(args.rounds):
            for c in configs:
                c.round(args.steps)
                log(f"round {r + 1}: {c.label}: {statistics.median(c.forward_ms[-args.steps:]):.1f} ms")
        profile = correction_profile(configs[len(MIXES) - 1])
        base_params, adapter_params = num_params(path), num_params(folders[names[0]])
        lora.shutdown()
    reference = statistics.median(configs[0].forward_ms)
    rows = [[c.label, f"{statistics.median(c.forward_ms):.1f}", f"{statistics.median(c.forward_ms) / reference:.2f}x",
             f"{BATCH / statistics.median(c.forward_ms) * 1e3:,.0f}", len(c.forward_ms)] for c in configs]
    total = sum(profile.values())
    bound = 1 + max(MIXES) * adapter_params / base_params
    lines = [f"# Multi-LoRA: the cost of a decoding iteration ({datetime.date.today()})", "",
             f"`python benchmarks/bench_lora.py --rounds {args.rounds} --steps {args.steps}` (`make bench-lora`): "
             f"the default model, batch {BATCH}, every row decoding; adapters of rank {RANK} on all seven "
             "projections of every layer (the last row: on q and v only, PEFT's default for Llama), assigned round-robin (an adapter's rows never side by side). Model "
             "forward per decode iteration as the runner times it, median of every iteration measured; "
             "configurations alternate round by round.", "",
             *table(["batch", "forward ms / iteration", "vs the base model", "tokens/s", "iterations"], rows), "",
             f"A decode iteration reads every weight it uses once: the model's {base_params / 1e6:.1f} M parameters, "
             f"and with {max(MIXES)} all-projection adapters {max(MIXES)} x {adapter_params / 1e6:.2f} M more, so "
             f"{bound:.2f}x is what they cost if every byte costs the same (these CPUs are bound by memory at "
             "this batch).", "",
             f"Where the correction goes with {max(MIXES)} adapters (a second pass timing each projection's "
             f"correction, µs per iteration; {total / 1e3:.1f} ms in all):", "",
             *table(["projection", "µs / iteration", "share"],
                    [[k, f"{v:,.0f}", f"{v / total:.0%}"] for k, v in sorted(profile.items(), key=lambda kv: -kv[1])]),
             "", *machine_lines(), ""]
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
