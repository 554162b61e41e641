"""Section 3, pipeline: the tiny random Llama split into two pipeline stages (both on GPU 0,
bf16) against the single-stage engine, greedy token for token; then what handing the
hidden states from one stage to the next costs per iteration, next to each stage's forward.

Two ways to run the stages:
- the in-process `pipeline` executor (`EngineConfig(executor="pipeline")`), one thread per
  stage. With one iteration in flight it runs exactly the reference's iterations, so the
  split alone is compared; with two (its default) the iterations batch differently, so its
  agreement is for information;
- two `StageWorker`s, the Python entry points of the `orca_stage_<i>` Triton models, called in
  turn with each message of the engine's scheduler as msgpack bytes and the previous stage's
  hidden tensor, as the serving model's stage threads would call them (there is no
  tritonserver here). Their own timings give each stage's forward.

Equal tokens are a goal, not a check: a mismatch is reported (first divergence per request,
the largest |logit difference| up to it) without failing the run. What must hold is checked:
every request gets its tokens, and the stage workers pass [num_tokens, hidden] tensors in the
model's dtype on the device.
"""
from __future__ import annotations

import math
import random
import statistics
import tempfile
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

from orca_backend.executors.base import Executor, IterationFailedError
from tools.gpu_check.checkpoints import new_engine, save_tiny
from tools.gpu_check.engine_sections import first_difference, run_staggered
from tools.gpu_check.kernel_sections import median_microseconds
from tools.gpu_check.report import Context, attempt, cpu_skip, free_memory, say

NUM_STAGES = 2
# Per request in the forward timing: the tiny checkpoint has 512 positions, one is for the output.
MAX_PROMPT_TOKENS = 256
# name -> (engine options over the common ones, whether it runs the reference's iterations)
EXECUTOR_VARIANTS = {
    "pipeline executor, 1 in flight": (dict(executor="pipeline", pipeline_stages=NUM_STAGES, max_inflight=1),
                                       True),
    "pipeline executor, 2 in flight": (dict(executor="pipeline", pipeline_stages=NUM_STAGES), False),
}
STAGE_WORKERS = "stage workers by hand, 1 in flight"
GOALS = {"pipeline executor, 1 in flight": "pipeline_tokens_equal_single_stage",
         STAGE_WORKERS: "stage_workers_tokens_equal_single_stage"}


def pipeline(ctx: Context, rec: dict) -> None:
    from orca_backend.checkpoint.config import ModelConfig

    dtype = "bfloat16" if ctx.cuda else "float32"
    if not ctx.cuda:
        rec["notes"].append("CPU run: float32 instead of bf16, the Triton interpreter for the kernel; "
                            "the timings mean nothing")
    cpu_skip(ctx, rec, "bf16, GPU->CPU->GPU round trips and CUDA events (CPU tensor copies timed by the "
             "wall clock instead)")
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in ctx.sizes.pipeline_prompts]
    max_tokens = [ctx.sizes.pipeline_max_tokens] * len(prompts)
    # No CUDA graphs in the reference either: a pipeline stage never captures them, so both
    # sides run the same eager kernels.
    options = dict(device="cuda:0" if ctx.cuda else "cpu", dtype=dtype, attention="triton",
                   cuda_graphs=False, keep_logits=True, kv_cache_tokens=4096, max_num_batched_tokens=1024)
    rec["summary"].update(dtype=dtype, prompts=len(prompts), tokens_per_prompt=ctx.sizes.pipeline_max_tokens,
                          stages=NUM_STAGES)
    rec["tables"]["greedy tokens against the single-stage engine"] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_pipeline_") as tmp:
        folder = save_tiny("llama", Path(tmp) / "llama")
        model_hidden = ModelConfig.from_folder(folder).hidden_size
        reference = attempt(ctx, rec, "single stage", run_engine, lambda: new_engine(folder, **options),
                            prompts, max_tokens)
        if reference is None:
            return
        _record_run(rec, "single stage (reference)", reference, max_tokens)
        _compare_executor(ctx, rec, "pipeline executor, 1 in flight", folder, options, prompts, max_tokens,
                          reference)
        forwards = attempt(ctx, rec, STAGE_WORKERS, stage_workers, ctx, rec, folder, options, prompts,
                           max_tokens, reference)
        attempt(ctx, rec, "hidden-state transfers", transfers, ctx, rec, dtype, model_hidden, forwards or {})
        _compare_executor(ctx, rec, "pipeline executor, 2 in flight", folder, options, prompts, max_tokens,
                          reference)
    rec["notes"].append("greedy tokens: the reference is the inline engine without CUDA graphs (a pipeline "
                        "stage never captures them); tokens_equal counts each request's tokens before its "
                        "first divergence; max_abs_logit_diff is over the rows up to and including it; '2 in "
                        "flight' batches its iterations differently from the reference, so its row is for "
                        "information")
    matched = [rec["goals"][g]["met"] for g in GOALS.values() if g in rec["goals"]]
    rec["summary"]["tokens_vs_single_stage"] = (
        "pass: every token equal" if matched and all(matched)
        else "MISMATCH: see the table" if matched else "not compared")


# -- token parity ------------------------------------------------------------------------------
@dataclass(slots=True)
class Run:
    tokens: dict[int, list[int]]
    logits: dict[int, list]  # per request, one float32 row per token
    mixed_iterations: int


def run_engine(make_engine, prompts, max_tokens) -> Run:
    engine = make_engine()
    try:
        return drive(engine, prompts, max_tokens)
    finally:
        engine.shutdown()
        del engine
        free_memory()


def drive(engine, prompts, max_tokens) -> Run:
    logits: dict[int, list] = {}
    tokens, num_mixed = run_staggered(engine, prompts, max_tokens, logits)
    return Run(tokens, logits, num_mixed)


def _compare_executor(ctx: Context, rec: dict, name: str, folder: Path, options: dict, prompts, max_tokens,
                      reference: Run) -> None:
    extra, same_iterations = EXECUTOR_VARIANTS[name]
    run = attempt(ctx, rec, name, run_engine, lambda: new_engine(folder, **options, **extra), prompts,
                  max_tokens)
    if run is not None:
        _record_comparison(rec, name, run, reference, max_tokens, same_iterations)
    ctx.report.save()


def _record_run(rec: dict, name: str, run: Run, max_tokens: list[int]) -> None:
    complete = all(len(run.tokens[i]) == n for i, n in enumerate(max_tokens))
    rec["checks"][f"{name}: every request got its {max_tokens[0]} tokens"] = complete


def _record_comparison(rec: dict, name: str, run: Run, reference: Run, max_tokens: list[int],
                       same_iterations: bool) -> dict:
    _record_run(rec, name, run, max_tokens)
    row = compare(run, reference)
    rec["tables"]["greedy tokens against the single-stage engine"].append(
        {"variant": name, "same_iterations_as_reference": same_iterations, **row,
         "mixed_iterations": run.mixed_iterations})
    if name in GOALS:
        equal, total = row["tokens_equal"], row["tokens"]
        rec["goals"][GOALS[name]] = {"value": equal / total, "target": "1 (every token equal)",
                                     "met": equal == total}
    say(f"pipeline: {name}: {row['tokens_equal']}/{row['tokens']} tokens equal, "
        f"diverged {row['diverged (request@token)']}, max |logit diff| {row['max_abs_logit_diff']:.3g}")
    return row


def compare(run: Run, reference: Run) -> dict:
    """Tokens equal up to each request's first divergence; the largest |logit difference|
    over the rows up to and including it (after it the two see different contexts)."""
    equal, total, diverged, max_diff = 0, 0, [], 0.0
    for i, ref in reference.tokens.items():
        got = run.tokens.get(i, [])
        first = first_difference(got, ref)
        equal, total = equal + first, total + len(ref)
        if got != ref:
            diverged.append(f"r{i}@{first}")
        rows = min(first + 1, len(got), len(ref))
        for a, b in zip(run.logits.get(i, [])[:rows], reference.logits.get(i, [])[:rows]):
            max_diff = max(max_diff, (a - b).abs().max().item())
    return {"requests_equal": f"{len(reference.tokens) - len(diverged)}/{len(reference.tokens)}",
            "tokens_equal": equal, "tokens": total, "diverged (request@token)": " ".join(diverged) or "-",
            "max_abs_logit_diff": max_diff}


# -- the stage workers, driven by hand -------------------------------------------------------
@dataclass(slots=True)
class Iteration:
    num_tokens: int
    forward_seconds: list[float]  # per stage, as the stage reports it (StageReply.stats)


class HandDrivenStages(Executor):
    """StageWorkers run in turn on each message, as the serving model's stage threads call
    the `orca_stage_<i>` models: the message as msgpack bytes, the previous stage's hidden
    tensor (handed over as it is: one process, one device), an upstream error in-band."""

    name = "the stage workers driven by hand"

    def __init__(self, workers: list) -> None:
        self.workers = workers
        self.iterations: list[Iteration] = []
        self.hidden_problems: list[str] = []

    def configured(self, spec) -> HandDrivenStages:
        """Every stage builds its runner from the engine's spec (the engine's executor factory)."""
        from orca_backend.executors.stages import check_layer_split

        replies = [w.configure(asdict(spec)) for w in self.workers]
        check_layer_split([tuple(r["layers"]) for r in replies], replies[-1]["num_layers"])
        return self

    def submit(self, message) -> Future:
        import msgpack
        import torch

        from orca_backend.core.messages import decode_runner_output

        future: Future = Future()
        data = msgpack.packb(message.to_wire())
        hidden, error, forwards = None, "", []
        for worker in self.workers:
            reply = worker.run(data, hidden, error)
            hidden, error = reply.hidden, reply.error
            forwards.append(reply.stats.forward_seconds)
            if hidden is not None and message.num_tokens and not error:
                want = (message.num_tokens, worker.model.config.hidden_size)
                if (tuple(hidden.shape) != want or hidden.dtype != worker.model_dtype
                        or hidden.device != torch.device(worker.device)):
                    self.hidden_problems.append(f"iteration {message.iteration_id}: {worker.name} gave "
                                                f"{tuple(hidden.shape)} {hidden.dtype} on {hidden.device}, "
                                                f"expected {want} {worker.model_dtype} on {worker.device}")
        self.iterations.append(Iteration(message.num_tokens, forwards))
        if error:
            future.set_exception(IterationFailedError(error))
        else:
            future.set_result(decode_runner_output(reply.output))
        return future

    def check_health(self) -> None:
        pass


def hand_driven_stages(folder: Path, options: dict) -> HandDrivenStages:
    """StageWorkers of evenly split layers, not configured yet."""
    from orca_backend.checkpoint.config import ModelConfig
    from orca_backend.executors.stages import split_layers
    from orca_backend.serving.stages.worker import StageWorker

    ranges = split_layers(ModelConfig.from_folder(folder).num_layers, NUM_STAGES)
    return HandDrivenStages([StageWorker(i, r, str(folder), options["dtype"], options["device"])
                             for i, r in enumerate(ranges)])


def stage_worker_engine(folder: Path, options: dict, stages: HandDrivenStages | None = None):
    """An engine (scheduler, K/V bookkeeping) whose iterations go to StageWorkers (by default
    `hand_driven_stages`), each configured with the engine's RunnerSpec."""
    from orca_backend import EngineConfig, LLMEngine

    stages = stages or hand_driven_stages(folder, options)
    # Stages: the first does not sample, so it cannot fill async scheduling's placeholders.
    config = EngineConfig(model=str(folder), async_scheduling=False, **options)
    return LLMEngine(config, stages.configured), stages


def stage_workers(ctx: Context, rec: dict, folder: Path, options: dict, prompts, max_tokens,
                  reference: Run) -> dict[int, list[float]]:
    """Tokens through the stage workers against the reference; then each stage's forward
    seconds (median) for iterations of exactly n tokens, n in sizes.transfer_tokens."""
    engine, stages = stage_worker_engine(folder, options)
    try:
        run = drive(engine, prompts, max_tokens)
        _record_comparison(rec, STAGE_WORKERS, run, reference, max_tokens, True)
        check = "stage workers: hidden states [num_tokens, hidden] in the model dtype on the device"
        rec["checks"][check] = not stages.hidden_problems
        for problem in stages.hidden_problems[:5]:
            rec["notes"].append(f"stage workers: {problem}")
        ctx.report.save()
        return time_stage_forwards(ctx, engine, stages)
    finally:
        engine.shutdown()
        del engine, stages
        free_memory()


def time_stage_forwards(ctx: Context, engine, stages: HandDrivenStages) -> dict[int, list[float]]:
    from orca_backend import SamplingParams

    rng, vocab = random.Random(3), engine.rules.model_config.vocab_size
    warmup, reps = (2, max(1, ctx.sizes.reps // 3)) if ctx.cuda else (1, 1)
    medians = {}
    for n in ctx.sizes.transfer_tokens:
        times = []
        for rep in range(warmup + reps):
            stages.iterations.clear()
            for j, length in enumerate(_split(n, MAX_PROMPT_TOKENS)):
                engine.add_request(f"fwd{n}-{rep}-{j}", [rng.randrange(3, vocab) for _ in range(length)],
                                   SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    if delta.error:
                        raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
            ran = [it for it in stages.iterations if it.num_tokens]
            if [it.num_tokens for it in ran] != [n]:
                raise RuntimeError(f"{n} prompt tokens ran as iterations of "
                                   f"{[it.num_tokens for it in ran]} tokens")
            if rep >= warmup:
                times.append(ran[0].forward_seconds)
        medians[n] = [statistics.median(t[s] for t in times) for s in range(NUM_STAGES)]
        say(f"pipeline: stage forwards at {n} tokens: "
            + ", ".join(f"stage {s} {1e6 * m:.0f} us" for s, m in enumerate(medians[n])))
    return medians


def _split(n: int, cap: int) -> list[int]:
    """n tokens as the fewest prompts of at most `cap` tokens, near equal."""
    k = math.ceil(n / cap)
    return [n // k + (i < n % k) for i in range(k)]


# -- hidden-state transfers ------------------------------------------------------------------
def transfers(ctx: Context, rec: dict, dtype_name: str, model_hidden: int,
              forwards: dict[int, list[float]]) -> None:
    """[num_tokens, hidden] in the run's dtype: a copy within the device (what passing the
    hidden states between stage processes on one GPU costs at least), and a round trip
    through CPU memory, pinned and pageable (what a transfer through host memory costs).
    Rows at the tiny model's hidden size sit next to its measured stage forwards; rows at the
    8B shape's for scale."""
    import torch

    dtype = getattr(torch, dtype_name)
    rows = rec["tables"]["hidden-state transfer per iteration (median microseconds)"] = []
    for hidden in dict.fromkeys((model_hidden, ctx.sizes.big_model["hidden_size"])):
        for n in ctx.sizes.transfer_tokens:
            row = time_transfer(ctx, n, hidden, dtype)
            stage = forwards.get(n) if hidden == model_hidden else None
            if stage:
                mean_forward_us = 1e6 * statistics.fmean(stage)
                row.update({f"stage{s}_forward_us": 1e6 * f for s, f in enumerate(stage)})
                row["copy_over_stage_forward"] = row["device_copy_us"] / mean_forward_us
                if row.get("via_cpu_pinned_us") is not None:
                    row["via_cpu_pinned_over_stage_forward"] = row["via_cpu_pinned_us"] / mean_forward_us
            rows.append(row)
            say(f"pipeline: transfer [{n}, {hidden}] {dtype_name}: device copy "
                f"{row['device_copy_us']:.1f} us, via CPU pinned {_us(row.get('via_cpu_pinned_us'))}, "
                f"pageable {_us(row.get('via_cpu_pageable_us'))}")
        ctx.report.save()
    rec["notes"].append("transfers: device_copy = one copy within GPU 0 (the in-process pipeline hands the "
                        "tensor over without one); via_cpu = GPU->CPU->GPU into a pinned host buffer "
                        "(non-blocking) or through pageable memory (.cpu() then back); CUDA events, median. "
                        "stage<i>_forward_us: the stage worker's own forward time for an iteration of that "
                        "many prompt tokens (stage 0 from the message's arrival, stage 1 including the LM "
                        "head on the sampled rows), median")


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} us"


def time_transfer(ctx: Context, n: int, hidden: int, dtype) -> dict:
    import torch

    reps = ctx.sizes.reps
    src = torch.randn(n, hidden, device=ctx.device, dtype=dtype)
    dst = torch.empty_like(src)
    row = {"hidden": hidden, "tokens": n, "kib": src.numel() * src.element_size() / 1024,
           "device_copy_us": median_microseconds(ctx, lambda: dst.copy_(src), reps)}
    if ctx.cuda:
        host = torch.empty(src.shape, dtype=dtype, pin_memory=True)

        def pinned():
            host.copy_(src, non_blocking=True)
            dst.copy_(host, non_blocking=True)

        def pageable():
            dst.copy_(src.cpu())
        row["via_cpu_pinned_us"] = median_microseconds(ctx, pinned, reps)
        row["via_cpu_pageable_us"] = median_microseconds(ctx, pageable, reps)
    return row
