"""The sampler alone, on the default model's vocabulary: one decode iteration's sampling at
batch 1, 32 and 256, without rules and with a repetition penalty, a logit bias and a
min_tokens rule on every row (each row 256 prompt tokens and a growing output).

    python -m benchmarks.bench_sampler [--compare REF] [--iterations N]

With `--compare REF` the same measurement runs, in the same call, against the package of git
revision REF (a temporary worktree) and the two are printed side by side with their ratio.
Figures are medians over the iterations; on a shared 2-core machine, read the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCHES = (1, 32, 256)
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 64


def _states(batch: int, rules: bool):
    import torch

    from orca_backend.core.messages import NewRequest
    from orca_backend.core.sampling_params import SamplingParams
    from orca_backend.runner.state import RunnerRequest

    params = (SamplingParams(temperature=0, repetition_penalty=1.1, logit_bias={5: 1.0, 6: -2.0, 7: 3.0},
                             min_tokens=1000, max_tokens=2000) if rules else SamplingParams(temperature=0))
    states = []
    for i in range(batch):
        state = RunnerRequest.new(NewRequest(f"r{i}", [(i * 7 + j * 13) % 40000 for j in range(PROMPT_TOKENS)],
                                             params, False), torch.device("cpu"))
        state.token_ids += [(i + j * 31) % 40000 for j in range(OUTPUT_TOKENS)]
        states.append(state)
    return states


def measure(vocab: int, iterations: int) -> dict:
    """Median milliseconds per sampling call, by (batch, rules)."""
    import torch

    import orca_backend
    from orca_backend.runner.sampler import Sampler

    torch.manual_seed(0)
    results = {"package": str(Path(orca_backend.__file__).parent), "ms": {}}
    for batch in BATCHES:
        for rules in (False, True):
            sampler = Sampler(torch.device("cpu"), 0, [2])
            states = _states(batch, rules)
            for state in states:
                if hasattr(sampler, "add"):  # requests join the runner that samples
                    sampler.add(state)
            logits = torch.randn(batch, vocab)
            times = []
            for step in range(iterations + 2):
                rows = logits.clone()  # the runner's logits are each iteration's own
                start = time.perf_counter()
                out = sampler(rows, states)
                seconds = time.perf_counter() - start
                for state, token in zip(states, out.token_ids):
                    state.token_ids.append(token)  # fed back, as the next message does
                if step >= 2:
                    times.append(seconds)
            results["ms"][f"{batch} {'rules' if rules else 'plain'}"] = statistics.median(times) * 1e3
    return results


def _at_revision(ref: str, vocab: int, iterations: int) -> dict:
    """The same measurement with the package of git revision `ref` (a temporary worktree)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), ref],
                       check=True, capture_output=True)
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--json", "--vocab", str(vocab),
                                  "--iterations", str(iterations)], env=env, check=True, capture_output=True,
                                 text=True, cwd=tmp)
            return json.loads(out.stdout)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", metavar="REF", help="also measure git revision REF and print the ratio")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=49152, help="the default model's vocabulary")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (for --compare)")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.vocab, args.iterations)))
        return
    here = measure(args.vocab, args.iterations)
    there = _at_revision(args.compare, args.vocab, args.iterations) if args.compare else None
    print(f"sampler, vocabulary {args.vocab}, median of {args.iterations} iterations (ms per call)")
    header = f"{'batch':>5} {'rows':>6} {'this tree':>10}"
    print(header + (f" {args.compare[:10]:>10} {'speedup':>8}" if there else ""))
    for key, ms in here["ms"].items():
        batch, kind = key.split()
        line = f"{batch:>5} {kind:>6} {ms:>10.2f}"
        if there:
            line += f" {there['ms'][key]:>10.2f} {there['ms'][key] / ms:>7.1f}x"
        print(line)
    if there:
        print(f"(the other tree's package: {there['package']})")


if __name__ == "__main__":
    main()
