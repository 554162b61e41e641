"""9. sampler: the batched logits processors (`orca_backend.runner.logits_processors`) on the
device against the same processors on the CPU (themselves checked against a row-by-row
reference in tests/test_logits_processors.py), over iterations whose outputs grow; then the
sampler's time per call at decode batch sizes, without rules and with a repetition penalty, a
logit bias and a min_tokens rule on every row, on Llama 3's vocabulary."""
from __future__ import annotations

import time

from tools.gpu_check.report import Context, attempt, say, sync

PROMPT_TOKENS = 256


def _states(device, batch: int, vocab: int, rules: bool):
    import torch

    from orca_backend.core.messages import NewRequest
    from orca_backend.core.sampling_params import SamplingParams
    from orca_backend.runner.state import RunnerRequest

    params = (SamplingParams(temperature=0, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1,
                             logit_bias={5: 1.0, 6: -2.0, 7: 3.0}, min_tokens=1000, max_tokens=2000,
                             bad_words_token_ids=[[11], [12, 13]])
              if rules else SamplingParams(temperature=0))
    g = torch.Generator().manual_seed(batch)
    return [RunnerRequest.new(NewRequest(f"r{i}", torch.randint(0, vocab, (PROMPT_TOKENS,), generator=g).tolist(),
                                         params, False), torch.device(device)) for i in range(batch)]


def sampler(ctx: Context, rec: dict) -> None:
    vocab, batches = (128256, (1, 32, 256)) if ctx.cuda else (512, (4,))
    rec["tables"]["processors on the device against the CPU"] = []
    rec["tables"]["median milliseconds per sampling call"] = []
    attempt(ctx, rec, "numerics", numerics, ctx, rec, vocab)
    for batch in batches:
        attempt(ctx, rec, f"time/{batch}", timing, ctx, rec, vocab, batch)
    ctx.report.save()
    rec["notes"].append("pass: the device's processed logits equal the CPU's (same -inf, values within 1e-5)")


def numerics(ctx: Context, rec: dict, vocab: int) -> None:
    import torch

    from orca_backend.runner.logits_processors import LogitsProcessors

    here, there = _states("cpu", 16, vocab, True), _states(ctx.device, 16, vocab, True)
    cpu, dev = LogitsProcessors(torch.device("cpu"), [2]), LogitsProcessors(torch.device(ctx.device), [2])
    for a, b in zip(here, there):
        cpu.add(a)
        dev.add(b)
    g = torch.Generator().manual_seed(0)
    worst, ok = 0.0, True
    for step in range(8):
        logits = torch.randn(16, vocab, generator=g)
        want, got = logits.clone(), logits.to(ctx.device)
        cpu.apply(want, here)
        dev.apply(got, there)
        got = got.cpu()
        same_inf = bool(torch.equal(got.isinf(), want.isinf()))
        finite = ~want.isinf()
        worst = max(worst, (got[finite] - want[finite]).abs().max().item())
        ok = ok and same_inf
        tokens = torch.randint(0, 64, (16,), generator=g).tolist()  # fed back: repeats some
        for a, b, token in zip(here, there, tokens):
            a.token_ids.append(token)
            b.token_ids.append(token)
    ok = ok and worst <= 1e-5
    rec["checks"]["device equals cpu"] = ok
    rec["tables"]["processors on the device against the CPU"].append(
        {"rows": 16, "vocab": vocab, "iterations": 8, "max_abs_difference": worst, "pass": ok})
    say(f"sampler: device against cpu: {worst:.3g}")


def timing(ctx: Context, rec: dict, vocab: int, batch: int) -> None:
    import torch

    from orca_backend.runner.sampler import Sampler

    row = {"batch": batch}
    for rules in (False, True):
        states = _states(ctx.device, batch, vocab, rules)
        sampler_ = Sampler(torch.device(ctx.device), 0, [2])
        for state in states:
            sampler_.add(state)
        logits = torch.randn(batch, vocab, device=ctx.device)
        times = []
        for step in range(ctx.sizes.reps + 2):
            rows = logits.clone()
            sync(ctx)
            start = time.perf_counter()
            out = sampler_(rows, states)
            sync(ctx)
            if step >= 2:
                times.append(time.perf_counter() - start)
            for state, token in zip(states, out.token_ids):
                state.token_ids.append(token)
        row["rules_ms" if rules else "plain_ms"] = sorted(times)[len(times) // 2] * 1e3
    rec["tables"]["median milliseconds per sampling call"].append(row)
    say(f"sampler: batch {batch}: {row}")
