"""Everything worth checking while a GPU is lent, in one command that writes a report.

Sections, run in order (`--sections` picks some):

1. kernel_numerics: `trt_plugins.paged_attention` against a float64 PyTorch reference on
   random decode, prefill and mixed batches (cached prefixes, shuffled block tables), per
   dtype and head shape; the K/V cache writes must be exact.
2. engine_parity: tiny random Llama and Qwen2 checkpoints; our engine (attention "triton",
   CUDA graphs on and off, chunked prefill) against transformers' greedy `generate`, token
   for token, with staggered arrivals so iterations mix prefill and decode. bf16 agreement
   is reported for information.
3. decode_throughput: a Llama-3-8B-shaped random model (bf16). Decode tokens/s per batch
   size next to the HBM bound, CUDA graphs on and off, and a trace of varied output lengths
   through our engine (continuous batching) and transformers (static batches).
4. kernel_vs_sdpa: our kernel against dense flash SDPA on prefill and decode shapes.

Each section runs in a process of its own, so that a crash or a poisoned CUDA context costs
that section only; a failure is recorded with its traceback and the next section runs. A
global time budget (an alarm inside each section, a kill past it) skips what would overrun.
gpu_check.json, gpu_check.md and gpu_check.log in --out are rewritten as results come in.
`--smoke` is a CPU dry run at tiny sizes (TRITON_INTERPRET=1) that walks every code path
except the CUDA-only calls, and says which those were.

Usage: bash tools/gpu_check.sh [--smoke] [--sections a,b] [--budget-seconds 450] [--layers 32]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("kernel_numerics", "engine_parity", "decode_throughput", "kernel_vs_sdpa")
# A section starts only with this much budget left, and leaves as much to the ones after it.
MIN_SECONDS = {"kernel_numerics": 20, "engine_parity": 30, "decode_throughput": 90, "kernel_vs_sdpa": 25}
# Error against float64 allowed per element: tolerance * (1 + |reference|).
TOLERANCES = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}
NUMERICS_CASES = ("decode", "decode_shuffled", "prefill", "mixed", "mixed_shuffled")
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, vocab_size=512, rope_theta=500000.0,
                  max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False)
# (prompt tokens, max_tokens) of the parity prompts: one token, several blocks, one output.
PARITY_SHAPES = [(3, 16), (48, 8), (19, 24), (1, 12), (130, 6), (27, 18), (11, 2), (36, 14)]
SMOKE_PARITY_SHAPES = [(3, 4), (20, 2), (1, 3), (9, 2)]


@dataclass(slots=True)
class Sizes:
    """Every size the sections use: full on a GPU, tiny for the CPU dry run."""

    dtypes: tuple[str, ...]
    heads: tuple[tuple[int, int, int], ...]  # (query heads, K/V heads, head_dim)
    num_requests: int  # per numerics batch
    max_context: int  # cached tokens before a decode or a prefill chunk, drawn up to this
    max_query: int  # prefill tokens, drawn up to this
    parity_shapes: list[tuple[int, int]]
    big_model: dict
    batch_sizes: tuple[int, ...]
    no_graph_batch_sizes: tuple[int, ...]
    prompt_tokens: int
    warmup_steps: int
    timed_steps: int
    trace_requests: int
    trace_max_output: int
    trace_batch_size: int
    prefill: tuple[int, int]  # (requests, tokens each) for kernel_vs_sdpa
    decode_requests: int
    decode_contexts: tuple[int, ...]
    attention_heads: tuple[int, int, int]
    reps: int


FULL = Sizes(
    dtypes=("bfloat16", "float16", "float32"), heads=((32, 8, 128), (9, 3, 64)), num_requests=16,
    max_context=2048, max_query=512, parity_shapes=PARITY_SHAPES, big_model=LLAMA_8B,
    batch_sizes=(1, 16, 64, 256), no_graph_batch_sizes=(1, 16), prompt_tokens=128, warmup_steps=5,
    timed_steps=40, trace_requests=64, trace_max_output=128, trace_batch_size=16, prefill=(4, 1024),
    decode_requests=64, decode_contexts=(1024, 4096), attention_heads=(32, 8, 128), reps=30)
SMOKE = Sizes(
    dtypes=("bfloat16", "float32"), heads=((9, 3, 64),), num_requests=3, max_context=40, max_query=20,
    parity_shapes=SMOKE_PARITY_SHAPES, big_model=TINY_LLAMA, batch_sizes=(1, 3), no_graph_batch_sizes=(1,),
    prompt_tokens=8, warmup_steps=1, timed_steps=2, trace_requests=4, trace_max_output=4,
    trace_batch_size=2, prefill=(2, 24), decode_requests=3, decode_contexts=(40,),
    attention_heads=(4, 2, 16), reps=2)


class BudgetExceeded(BaseException):
    """Raised by the alarm inside a section that ran past its share of the budget."""


def say(message: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')} +{time.time() - _START:6.1f}s] {message}"
    print(line, flush=True)
    if _LOG is not None:
        with open(_LOG, "a") as f:
            f.write(line + "\n")


# Seconds since the parent started, in every section's process alike.
_START = float(os.environ.setdefault("GPU_CHECK_START", str(time.time())))
_LOG: Path | None = None


# -- the report ------------------------------------------------------------------------------
class Report:
    """Results so far; `save()` rewrites gpu_check.json and gpu_check.md from them."""

    def __init__(self, out: Path, environment: dict, args: dict) -> None:
        self.out = out
        self.data = {"environment": environment, "args": args, "sections": {}}

    @classmethod
    def load(cls, out: Path) -> Report:
        data = json.loads((out / "gpu_check.json").read_text())
        report = cls(out, data["environment"], data["args"])
        report.data["sections"] = data["sections"]
        return report

    def all_passed(self) -> bool:
        """Every section ran (or was skipped for time) and every check in it passed."""
        return all(s["status"] in ("ok", "skipped") and all(s["checks"].values())
                   for s in self.data["sections"].values())

    def section(self, name: str) -> dict:
        return self.data["sections"].setdefault(name, {
            "status": "pending", "seconds": None, "error": None, "notes": [], "checks": {},
            "goals": {}, "summary": {}, "tables": {}, "tracebacks": []})

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in (("gpu_check.json", json.dumps(self.data, indent=2, default=str)),
                           ("gpu_check.md", self.markdown())):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text)
            tmp.replace(self.out / name)  # a kill mid-write leaves the previous version

    def markdown(self) -> str:
        lines = ["# GPU check", "", "## Environment", ""]
        lines += _table(["item", "value"], [[k, v] for k, v in self.data["environment"].items()])
        lines += ["", f"Arguments: `{json.dumps(self.data['args'])}`", "", "## Sections", ""]
        lines += _table(["section", "status", "checks passed", "seconds"],
                        [[n, s["status"], _passed(s), _fmt(s["seconds"])]
                         for n, s in self.data["sections"].items()])
        lines += ["", "Overall: " + ("every section ran and every check passed" if self.all_passed()
                                     else "**a section failed, timed out or has a failing check**")]
        for name, s in self.data["sections"].items():
            lines += ["", f"## {name}: {s['status']}", ""]
            lines += [f"- note: {n}" for n in s["notes"]]
            lines += [f"- {k}: {_fmt(v)}" for k, v in s["summary"].items()]
            lines += [f"- goal {k}: {_fmt(g['value'])} (target {g['target']}): "
                      f"{'met' if g['met'] else 'NOT met'}" for k, g in s["goals"].items()]
            failed = [k for k, ok in s["checks"].items() if not ok]
            if s["checks"]:
                lines.append(f"- checks: {len(s['checks']) - len(failed)}/{len(s['checks'])} passed"
                             + (f"; failed: {', '.join(failed)}" if failed else ""))
            for title, rows in s["tables"].items():
                if not rows:
                    continue
                headers = list(dict.fromkeys(k for row in rows for k in row))
                lines += ["", f"### {title}", ""]
                lines += _table(headers, [[_fmt(row.get(h)) for h in headers] for row in rows])
            for text in s["tracebacks"] + ([s["error"]] if s["error"] else []):
                lines += ["", "```", text.rstrip(), "```"]
        return "\n".join(lines) + "\n"


def _passed(section: dict) -> str:
    checks = section["checks"]
    return f"{sum(checks.values())}/{len(checks)}" if checks else "-"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def _table(headers: list[str], rows: list[list]) -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(row) + " |" for row in cells)]


# -- running the sections ----------------------------------------------------------------------
@dataclass(slots=True)
class Context:
    """What every section gets: sizes, where to run, and the report to fill."""

    args: argparse.Namespace
    sizes: Sizes
    device: str
    cuda: bool
    report: Report
    deadline: float  # time.monotonic() when the whole budget is spent

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run_sections(ctx: Context, names: list[str]) -> None:
    """Run `names` in order; each records ok, error (with its traceback), timeout or skipped."""
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for i, name in enumerate(names):
            _run_section(ctx, name, reserve=sum(MIN_SECONDS[n] for n in names[i + 1:]))
    finally:
        signal.signal(signal.SIGALRM, previous)


def _run_section(ctx: Context, name: str, reserve: float) -> None:
    import torch

    rec = ctx.report.section(name)
    if ctx.left() < MIN_SECONDS[name]:
        rec["status"] = "skipped"
        rec["notes"].append(f"skipped: {ctx.left():.0f} s of budget left, it needs {MIN_SECONDS[name]} s")
        say(f"{name}: skipped (budget)")
        ctx.report.save()
        return
    say(f"{name}: start ({ctx.left():.0f} s of budget left)")
    rec["status"] = "running"  # what a crash leaves behind
    ctx.report.save()
    start = time.monotonic()
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    signal.setitimer(signal.ITIMER_REAL, max(1.0, ctx.left() - reserve))
    try:
        SECTION_FUNCTIONS[name](ctx, rec)
        rec["status"] = "ok"
    except BudgetExceeded:
        rec["status"] = "timeout"
        rec["error"] = "ran past its share of the time budget; partial results above"
    except Exception:
        rec["status"] = "error"
        rec["error"] = traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    rec["seconds"] = round(time.monotonic() - start, 2)
    if ctx.cuda:
        rec["summary"]["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    say(f"{name}: {rec['status']} in {rec['seconds']} s, checks {_passed(rec)}")
    if rec["error"]:
        print(rec["error"], flush=True)
    _free_memory()
    ctx.report.save()


def _on_alarm(signum, frame) -> None:
    raise BudgetExceeded()


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(ctx: Context) -> None:
    import torch

    if ctx.cuda:
        torch.cuda.synchronize()


def _cpu_skip(ctx: Context, rec: dict, what: str) -> bool:
    """True (and a note) when `what` needs CUDA and this is a CPU run."""
    if ctx.cuda:
        return False
    rec["notes"].append(f"skipped on CPU: {what}")
    return True


def attempt(ctx: Context, rec: dict, part: str, fn, *args):
    """Run one part of a section. If it raises, that part fails alone (a check "<part> ran",
    a row in "failed parts", its traceback below) and the section goes on to the next part."""
    try:
        return fn(*args)
    except Exception as e:
        rec["checks"][f"{part} ran"] = False
        message = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")[:300]
        rec["tables"].setdefault("failed parts", []).append({"part": part, "error": message})
        rec["tracebacks"].append(f"{part}:\n{traceback.format_exc()}")
        say(f"{part}: failed: {message}")
        ctx.report.save()
        return None


# -- 1. kernel numerics ------------------------------------------------------------------------
def load_kernel():
    import importlib

    return importlib.import_module("trt_plugins.paged_attention").paged_attention


@dataclass(slots=True)
class PagedBatch:
    """One attention call's inputs in the kernel's layout, and what its writes should be."""

    q: object  # [T, Hq * D]
    k: object  # [T, Hkv * D]
    v: object
    k_cache: object  # [num_blocks, block_size, Hkv, D]
    v_cache: object
    cu_seqlens_q: object  # int32 [B + 1]
    seq_lens: object  # int32 [B]
    block_tables: object  # int32 [B, max_blocks]
    slot_mapping: object  # [T] where each new token's K/V belongs
    query_lens: list[int]
    heads: tuple[int, int, int]

    def call(self, kernel, scale: float):
        return kernel(self.q, self.k, self.v, self.k_cache, self.v_cache, self.cu_seqlens_q,
                      self.seq_lens, self.block_tables, scale, max_query_len=max(self.query_lens))


def make_batch(query_lens: list[int], context_lens: list[int], heads: tuple[int, int, int], dtype,
               device: str, shuffle: bool, seed: int, block_size: int = 16) -> PagedBatch:
    """Random q/k/v and caches; the slots the new tokens go to hold NaN until written."""
    import torch

    num_q_heads, num_kv_heads, head_dim = heads
    g = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    blocks_per_request = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_request) + 2  # a couple nobody owns
    order = (torch.randperm(num_blocks, generator=g, device=device).tolist() if shuffle
             else list(range(num_blocks)))
    tables = torch.zeros(len(seq_lens), max(blocks_per_request), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_request):
        tables[i, :n] = torch.tensor(order[used:used + n])
        used += n
    slots = torch.cat([tables[i, torch.arange(c, s) // block_size].long() * block_size
                       + torch.arange(c, s) % block_size
                       for i, (c, s) in enumerate(zip(context_lens, seq_lens))]).to(device)
    T = sum(query_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    caches = [randn(num_blocks, block_size, num_kv_heads, head_dim) for _ in range(2)]
    for cache in caches:
        cache.view(-1, num_kv_heads, head_dim)[slots] = float("nan")
    cu = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return PagedBatch(randn(T, num_q_heads * head_dim), randn(T, num_kv_heads * head_dim),
                      randn(T, num_kv_heads * head_dim), *caches, cu.to(device),
                      torch.tensor(seq_lens, dtype=torch.int32, device=device), tables.to(device),
                      slots, list(query_lens), heads)


def expected_cache(batch: PagedBatch, cache_before, new):
    """The cache as it must be after the call: `new` [T, Hkv * D] in the new tokens' slots."""
    _, num_kv_heads, head_dim = batch.heads
    cache = cache_before.clone()
    cache.view(-1, num_kv_heads, head_dim)[batch.slot_mapping] = new.view(-1, num_kv_heads, head_dim)
    return cache


def reference_attention(batch: PagedBatch, k_cache, v_cache, scale: float):
    """float64 attention from whole caches: per request, gather its K/V, mask lower-right
    causally (query i of n sits at position seq_len - n + i), repeat K/V heads for GQA."""
    import torch

    num_q_heads, num_kv_heads, head_dim = batch.heads
    group = num_q_heads // num_kv_heads
    out = torch.empty(batch.q.shape[0], num_q_heads, head_dim, dtype=torch.float64, device=batch.q.device)
    row = 0
    for i, (n, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens.tolist())):
        blocks = batch.block_tables[i, :-(-seq_len // k_cache.shape[1])].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = v_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(group, dim=1)
        q = batch.q[row:row + n].view(n, num_q_heads, head_dim).double()
        scores = torch.einsum("nhd,lhd->hnl", q, keys) * scale  # [Hq, n, L]
        visible = torch.arange(seq_len, device=q.device)[None, :] <= (
            seq_len - n + torch.arange(n, device=q.device))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[row:row + n] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values)
        row += n
    return out.flatten(1)


def case_lengths(kind: str, sizes: Sizes, seed: int) -> tuple[list[int], list[int]]:
    """(query lengths, cached lengths) of a numerics case."""
    rng = random.Random(seed)
    queries, contexts = [], []
    for _ in range(sizes.num_requests):
        what = kind.removesuffix("_shuffled")
        if what == "mixed":
            what = rng.choice(["decode", "prefill", "chunk"])
        if what == "decode":
            queries.append(1)
            contexts.append(rng.randint(0, sizes.max_context))
        else:
            queries.append(rng.randint(1, sizes.max_query))
            contexts.append(rng.randint(1, sizes.max_context) if what == "chunk" else 0)
    return queries, contexts


def kernel_numerics(ctx: Context, rec: dict) -> None:
    kernel = load_kernel()
    rec["tables"]["max abs error against float64"] = []
    for dtype_name in ctx.sizes.dtypes:
        for heads in ctx.sizes.heads:
            for seed, kind in enumerate(NUMERICS_CASES):
                name = f"{dtype_name}/{'-'.join(map(str, heads))}/{kind}"
                attempt(ctx, rec, name, numerics_case, ctx, rec, kernel, name, dtype_name, heads, kind, seed)
        ctx.report.save()
    rec["notes"].append("pass: every |error| <= tolerance * (1 + |reference|) (atol = rtol = tolerance), "
                        "and the cache equal to the expected one bit for bit")
    skipped = [d for d in FULL.dtypes if d not in ctx.sizes.dtypes]
    if skipped:
        rec["notes"].append(f"not run at smoke sizes: dtypes {', '.join(skipped)}; shapes {FULL.heads}")


def numerics_case(ctx: Context, rec: dict, kernel, name: str, dtype_name: str, heads, kind: str,
                  seed: int) -> None:
    import torch

    queries, contexts = case_lengths(kind, ctx.sizes, seed)
    batch = make_batch(queries, contexts, heads, getattr(torch, dtype_name), ctx.device,
                       kind.endswith("shuffled"), seed)
    k_before, v_before = batch.k_cache.clone(), batch.v_cache.clone()
    scale = heads[2] ** -0.5
    out = batch.call(kernel, scale)
    _sync(ctx)
    k_want = expected_cache(batch, k_before, batch.k)
    v_want = expected_cache(batch, v_before, batch.v)
    wrong = (batch.k_cache != k_want) | (batch.v_cache != v_want)  # NaN: never written
    wrong_slots = int(wrong.flatten(2).any(-1).sum())
    ref = reference_attention(batch, k_want, v_want, scale)
    diff, tol = (out.double() - ref).abs(), TOLERANCES[dtype_name]
    error = diff.max().item()
    # Relative as well as absolute: rounding an output of 4 to bf16 alone is off by 0.016.
    ok = bool((diff <= tol * (1 + ref.abs())).all()) and wrong_slots == 0  # NaN fails
    rec["checks"][name] = ok
    rec["tables"]["max abs error against float64"].append({
        "dtype": dtype_name, "Hq/Hkv/D": "/".join(map(str, heads)), "case": kind, "tokens": sum(queries),
        "max_context": max(contexts), "max_abs_error": error, "max_abs_reference": ref.abs().max().item(),
        "tolerance": tol, "wrong_cache_slots": wrong_slots, "pass": ok})
    say(f"kernel_numerics: {name}: error {error:.3g}, wrong cache slots {wrong_slots}")


# -- checkpoints ---------------------------------------------------------------------------------
def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the whole vocabulary ("t0" .. "t{n-1}"): the engine only
    needs one to load and to detokenize; these checks send token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def save_tiny(kind: str, folder: Path) -> Path:
    """A small random Llama or Qwen2 checkpoint (fp32, head_dim 32) with biases and norm
    weights perturbed, so that a dropped one would change the tokens."""
    import torch
    import transformers as tf

    arch = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=0.2, tie_word_embeddings=kind == "qwen2")
    config = (tf.Qwen2Config if kind == "qwen2" else tf.LlamaConfig)(**arch)
    torch.manual_seed(0)
    model = (tf.Qwen2ForCausalLM if kind == "qwen2" else tf.LlamaForCausalLM)(config).float()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    write_tokenizer(folder, arch["vocab_size"])
    return folder


def new_engine(folder: Path, **options):
    from orca_backend import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(folder), **options))


# -- 2. engine parity ------------------------------------------------------------------------------
def run_staggered(engine, prompts: list[list[int]], max_tokens: list[int]) -> tuple[dict, int]:
    """Add two requests, then one per iteration; greedy tokens per request, and how many
    iterations mixed prefill with decode."""
    from orca_backend import SamplingParams

    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    num_mixed = 0
    while pending or engine.has_unfinished_requests():
        for i in pending[:2 if len(pending) == len(prompts) else 1]:
            engine.add_request(str(i), prompts[i], SamplingParams(temperature=0, max_tokens=max_tokens[i],
                                                                  ignore_eos=True))
            pending.remove(i)
        for delta in engine.step():
            if delta.error:
                raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
            tokens[int(delta.request_id)] += delta.token_ids
        shape = engine.stats.last_iteration
        num_mixed += bool(shape and shape.num_prefill_requests and shape.num_decode_requests)
    if engine.kv.num_used_blocks:
        raise RuntimeError(f"{engine.kv.num_used_blocks} K/V blocks still in use after all requests ended")
    return tokens, num_mixed


def hf_greedy(folder: Path, dtype_name: str, device: str, prompts, max_tokens) -> list[list[int]]:
    """transformers' generate on each prompt alone."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype_name)).to(device).eval()
    outs = []
    for ids, n in zip(prompts, max_tokens):
        seq = model.generate(torch.tensor([ids], device=device), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        outs.append(seq[0, len(ids):].tolist())
    return outs


def engine_parity(ctx: Context, rec: dict) -> None:
    shapes = ctx.sizes.parity_shapes
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n, _ in shapes]
    max_tokens = [m for _, m in shapes]
    variants = {"cuda_graphs": dict(cuda_graphs=True), "no_cuda_graphs": dict(cuda_graphs=False),
                "chunked_prefill": dict(cuda_graphs=True, max_num_batched_tokens=16)}
    _cpu_skip(ctx, rec, "capturing CUDA graphs (cuda_graphs=True runs the padded decode path eagerly) "
              "and the bf16 agreement")
    rows = rec["tables"]["float32 greedy tokens vs transformers"] = []
    agreement = rec["tables"]["bfloat16 agreement with transformers bf16 (informational)"] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_parity_") as tmp:
        for kind in ("llama", "qwen2"):
            folder = save_tiny(kind, Path(tmp) / kind)
            reference = hf_greedy(folder, "float32", ctx.device, prompts, max_tokens)
            for variant, options in variants.items():
                name = f"{kind}/{variant}"
                row = attempt(ctx, rec, name, parity_variant, ctx, folder, options, prompts, max_tokens,
                              reference)
                rec["checks"][name] = bool(row and row.pop("ok"))
                if row:
                    rows.append({"model": kind, "variant": variant, **row})
                    say(f"engine_parity: {name}: {row['requests_equal']} equal, "
                        f"{row['mixed_iterations']} mixed iterations")
                ctx.report.save()
            if ctx.cuda:
                row = attempt(ctx, rec, f"{kind}/bf16", _bf16_agreement, ctx, folder, kind, prompts,
                              max_tokens)
                agreement += [row] if row else []


def parity_variant(ctx: Context, folder: Path, options: dict, prompts, max_tokens, reference) -> dict:
    engine = new_engine(folder, device=ctx.device, dtype="float32", attention="triton", kv_cache_tokens=4096,
                        **options)
    try:
        tokens, num_mixed = run_staggered(engine, prompts, max_tokens)
    finally:
        engine.shutdown()
    diverged = [f"r{i}@{_first_difference(tokens[i], ref)}" for i, ref in enumerate(reference)
                if tokens[i] != ref]
    return {"requests_equal": f"{len(prompts) - len(diverged)}/{len(prompts)}",
            "diverged (request@token)": " ".join(diverged) or "-", "mixed_iterations": num_mixed,
            "ok": not diverged and num_mixed > 0}


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _bf16_agreement(ctx: Context, folder: Path, kind: str, prompts, max_tokens) -> dict:
    reference = hf_greedy(folder, "bfloat16", ctx.device, prompts, max_tokens)
    engine = new_engine(folder, device=ctx.device, dtype="bfloat16", attention="triton", kv_cache_tokens=4096)
    try:
        tokens, _ = run_staggered(engine, prompts, max_tokens)
    finally:
        engine.shutdown()
    same_prefix = sum(_first_difference(tokens[i], ref) for i, ref in enumerate(reference))
    return {"model": kind, "requests_equal": sum(tokens[i] == ref for i, ref in enumerate(reference)),
            "requests": len(prompts), "tokens_before_first_divergence": same_prefix,
            "tokens": sum(max_tokens), "agreement": same_prefix / sum(max_tokens)}


# -- 3. decode throughput -----------------------------------------------------------------------------
class LiveWeights:
    """Stands in for `orca_backend.models.weights.Weights`: hands out the tensors of a model
    already in memory, so the 8B-shaped checkpoint never goes through the disk."""

    def __init__(self, state: dict, dtype, device) -> None:
        self._tensors = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
        self.dtype, self.device = dtype, device

    def take_optional(self, name: str):
        t = self._tensors.pop(name, None)
        return None if t is None else t.to(device=self.device, dtype=self.dtype)

    def take(self, name: str):
        t = self.take_optional(name)
        if t is None:
            raise KeyError(f"the live model has no tensor {name!r}")
        return t

    def leftover(self) -> list[str]:
        return sorted(self._tensors)


def engine_on_live_model(folder: Path, state: dict, **options):
    """Our engine over `state`'s tensors (the folder holds config.json and tokenizer.json)."""
    import orca_backend.models as models

    def weights(_folder, dtype, device, strip_prefix=""):
        return LiveWeights(state, dtype, device)

    with mock.patch.object(models, "Weights", weights):
        return new_engine(folder, **options)


def big_model(ctx: Context, folder: Path, dtype_name: str):
    """transformers' random model from the config, made on the device; config and tokenizer saved."""
    import torch
    import transformers as tf

    shape = dict(ctx.sizes.big_model)
    if ctx.args.layers is not None:
        shape["num_hidden_layers"] = ctx.args.layers
    config = tf.LlamaConfig(**shape, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                            architectures=["LlamaForCausalLM"])
    with torch.device(ctx.device):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name),
                                                    attn_implementation="sdpa").eval()
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    write_tokenizer(folder, config.vocab_size)
    return model


def model_bytes(model) -> tuple[int, int]:
    """(weight bytes a decode step reads: all but the embedding table unless tied, K/V bytes per token)."""
    c = model.config
    params = {id(p): p for n, p in model.named_parameters()
              if n != "model.embed_tokens.weight" or c.tie_word_embeddings}
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    element = next(model.parameters()).element_size()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return weight_bytes, 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * element


def time_decode(engine, batch_size: int, sizes: Sizes, vocab: int, tag: str) -> dict:
    """Run `batch_size` equal requests; time only iterations where all of them decode."""
    from orca_backend import SamplingParams

    rng = random.Random(batch_size)
    max_tokens = sizes.warmup_steps + sizes.timed_steps + 1  # the first token comes from prefill
    for i in range(batch_size):
        prompt = [rng.randrange(3, vocab) for _ in range(sizes.prompt_tokens)]
        engine.add_request(f"{tag}-{batch_size}-{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    times, num_decode_only, replays = [], 0, _graph_replays(engine)
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start  # step() waits for the sampled tokens
        shape = engine.stats.last_iteration
        if shape.num_prefill_requests == 0 and shape.num_decode_requests == batch_size:
            num_decode_only += 1
            if num_decode_only > sizes.warmup_steps:
                times.append(elapsed)
    if not times:
        raise RuntimeError(f"batch {batch_size}: no decode-only iteration of the whole batch to time")
    return {"batch": batch_size, "timed_steps": len(times), "ms_per_step": 1e3 * statistics.median(times),
            "tokens_per_s": batch_size * len(times) / sum(times),
            "mean_seq_len": sizes.prompt_tokens + sizes.warmup_steps + (len(times) + 1) / 2,
            "graph_replays": None if replays is None else _graph_replays(engine) - replays}


def _graph_replays(engine) -> int | None:
    """Decode iterations run from the padded graph buffers so far (None: graphs off), to
    show that the timed steps took that path."""
    graphs = getattr(getattr(engine.executor, "runner", None), "decode_graphs", None)
    return None if graphs is None else graphs.num_replays


def decode_throughput(ctx: Context, rec: dict) -> None:
    sizes, dtype = ctx.sizes, "bfloat16" if ctx.cuda else "float32"
    if not ctx.cuda:
        rec["notes"].append("CPU run: a tiny Llama in float32 instead of the 8B shape in bf16; "
                            "the figures and goals mean nothing")
    _cpu_skip(ctx, rec, "capturing CUDA graphs (cuda_graphs=True runs the padded decode path eagerly)")
    with tempfile.TemporaryDirectory(prefix="gpu_check_8b_") as tmp:
        start = time.monotonic()
        hf = big_model(ctx, Path(tmp), dtype)
        weight_bytes, kv_bytes_per_token = model_bytes(hf)
        rec["summary"].update(model_layers=hf.config.num_hidden_layers, weight_gb=weight_bytes / 1e9,
                              kv_kb_per_token=kv_bytes_per_token / 1e3,
                              model_build_seconds=round(time.monotonic() - start, 1))
        say(f"decode_throughput: model made in {rec['summary']['model_build_seconds']} s, "
            f"{weight_bytes / 1e9:.2f} GB of weights")
        max_batch = max(sizes.batch_sizes)
        live = LiveModel(Path(tmp), hf.state_dict(), dict(
            device=ctx.device, dtype=dtype, attention="triton",
            max_num_batched_tokens=max(2048, max_batch * sizes.prompt_tokens),
            kv_cache_tokens=max_batch * (sizes.prompt_tokens + sizes.warmup_steps + sizes.timed_steps + 32)))

        def sweep(graphs: bool, batch_sizes) -> list[dict]:
            return decode_sweep(ctx, rec, live, graphs, batch_sizes, hf.config.vocab_size, weight_bytes,
                                kv_bytes_per_token)
        # The goals first, so that a short budget still measures them.
        rows = attempt(ctx, rec, "decode with CUDA graphs", sweep, True, sizes.batch_sizes)
        if rows:
            first = rows[0]["fraction_of_bound"]
            rec["goals"]["batch1_fraction_of_hbm_bound"] = {"value": first, "target": ">= 0.6",
                                                            "met": first >= 0.6}
        attempt(ctx, rec, "trace", trace_comparison, ctx, rec, hf, live)
        attempt(ctx, rec, "decode without CUDA graphs", sweep, False, sizes.no_graph_batch_sizes)


@dataclass(slots=True)
class LiveModel:
    """Where our engines get the in-memory model: its folder (config and tokenizer), its
    tensors, and the engine options every run shares."""

    folder: Path
    state: dict
    options: dict

    def engine(self, **options):
        return engine_on_live_model(self.folder, self.state, **self.options, **options)


def decode_sweep(ctx: Context, rec: dict, live: LiveModel, graphs: bool, batch_sizes, vocab: int,
                 weight_bytes: int, kv_bytes_per_token: int) -> list[dict]:
    """One engine, each batch size in turn; rows next to the HBM bound (weights read once per
    iteration plus every request's K/V)."""
    rows = rec["tables"].setdefault("decode tokens/s (decode-only iterations)", [])
    bandwidth = ctx.args.hbm_tbps * 1e12
    engine = live.engine(cuda_graphs=graphs, max_batch_size=max(batch_sizes))
    new_rows = []
    try:
        for b in batch_sizes:
            row = time_decode(engine, b, ctx.sizes, vocab, f"g{int(graphs)}")
            bound = b * bandwidth / (weight_bytes + b * row["mean_seq_len"] * kv_bytes_per_token)
            new_rows.append({"cuda_graphs": graphs, **row, "hbm_bound_tokens_per_s": bound,
                             "fraction_of_bound": row["tokens_per_s"] / bound})
            rows.append(new_rows[-1])
            say(f"decode_throughput: graphs={graphs} batch {b}: {row['tokens_per_s']:.1f} tok/s, "
                f"{row['tokens_per_s'] / bound:.1%} of the HBM bound")
            ctx.report.save()
    finally:
        engine.shutdown()
        del engine
        _free_memory()
    return new_rows


def trace_comparison(ctx: Context, rec: dict, hf, live: LiveModel) -> None:
    """Varied output lengths: our engine with continuous batching against transformers'
    static batches, each batch run to its longest request; useful tokens only."""
    import torch
    from orca_backend import SamplingParams

    sizes = ctx.sizes
    rng = random.Random(7)
    vocab = hf.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(sizes.prompt_tokens)]
               for _ in range(sizes.trace_requests)]
    lengths = [rng.randint(1, sizes.trace_max_output) for _ in prompts]
    useful = sum(lengths)
    batch = sizes.trace_batch_size
    with torch.inference_mode():
        hf.generate(torch.tensor(prompts[:batch], device=ctx.device), max_new_tokens=2, do_sample=False,
                    pad_token_id=0)  # warm-up
        _sync(ctx)
        start = time.perf_counter()
        for s in range(0, len(prompts), batch):
            n = max(lengths[s:s + batch])
            hf.generate(torch.tensor(prompts[s:s + batch], device=ctx.device), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=0)
        _sync(ctx)
        hf_seconds = time.perf_counter() - start
    say(f"decode_throughput: transformers trace {hf_seconds:.2f} s")
    engine = live.engine(cuda_graphs=True, max_batch_size=batch)
    try:
        for i in range(batch):  # warm-up: graphs and kernels for this batch limit
            engine.add_request(f"w{i}", prompts[i],
                               SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            engine.add_request(f"t{i}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        iterations, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            iterations += 1
        ours_seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    ratio = hf_seconds / ours_seconds
    rec["tables"]["trace: varied output lengths, useful tokens/s"] = [
        {"system": "transformers generate, static batches", "batch": batch, "requests": len(prompts),
         "useful_tokens": useful, "seconds": hf_seconds, "useful_tokens_per_s": useful / hf_seconds},
        {"system": "ours, continuous batching", "batch": batch, "requests": len(prompts),
         "useful_tokens": useful, "seconds": ours_seconds, "useful_tokens_per_s": useful / ours_seconds,
         "iterations": iterations}]
    rec["goals"]["trace_speedup_over_transformers"] = {"value": ratio, "target": ">= 3", "met": ratio >= 3}
    say(f"decode_throughput: ours trace {ours_seconds:.2f} s, {ratio:.2f}x transformers")


# -- 4. kernel vs SDPA -----------------------------------------------------------------------------------
def median_microseconds(ctx: Context, fn, reps: int) -> float:
    """Median of `reps` timed calls after warm-up: CUDA events on a GPU, wall clock on CPU."""
    import torch

    for _ in range(max(2, reps // 5)):
        fn()
    times = []
    for _ in range(reps):
        if ctx.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def graph_microseconds(ctx: Context, fn, reps: int) -> float | None:
    """Median replay time of `fn` captured in a CUDA graph: the GPU time without the host's
    launch overhead (which eager timing includes when the host is the slower side)."""
    import torch

    if not ctx.cuda:
        return None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:
        say(f"kernel_vs_sdpa: capture failed: {e}")
        return None
    return median_microseconds(ctx, graph.replay, reps)


def sdpa_call(ctx: Context, q, k, v, causal: bool):
    """Dense SDPA on the flash backend (any backend on CPU), GQA natively if it can; returns
    (callable, how the K/V heads were handled)."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def backend():  # a fresh context manager per call: sdpa_kernel's cannot be re-entered
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION) if ctx.cuda else contextlib.nullcontext()

    def call(k=k, v=v, gqa=True):
        with backend():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    try:
        call()
        return call, "enable_gqa"
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return (lambda: call(ke, ve, False)), "K/V heads repeated"


def kernel_vs_sdpa(ctx: Context, rec: dict) -> None:
    import torch

    kernel = load_kernel()
    sizes, heads = ctx.sizes, ctx.sizes.attention_heads
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    _cpu_skip(ctx, rec, "CUDA events, graph replays and the flash backend (wall clock and the default "
              "SDPA backend instead)")
    rows = rec["tables"]["median microseconds"] = []
    num_prefill, prefill_len = sizes.prefill
    cases = [("prefill", [prefill_len] * num_prefill, [0] * num_prefill)]
    cases += [(f"decode ctx {c}", [1] * sizes.decode_requests, [c - 1] * sizes.decode_requests)
              for c in sizes.decode_contexts]
    for name, queries, contexts in cases:
        row = attempt(ctx, rec, name, time_attention, ctx, kernel, heads, dtype, queries, contexts)
        if row:
            rows.append({"case": name, **row})
            say(f"kernel_vs_sdpa: {name}: ours {row['ours_us']:.1f} us (graph {row['ours_graph_us']}), "
                f"sdpa {row['sdpa_us']:.1f} us (graph {row['sdpa_graph_us']})")
        ctx.report.save()
    rec["notes"].append("ours includes writing the new tokens' K/V into the paged cache; SDPA reads dense "
                        "K/V. *_us: eager calls timed by CUDA events (host launch cost included when the "
                        "host is slower); *_graph_us: CUDA graph replays (GPU time); the ratio and GB/s "
                        "use the graph figures where there are some")


def time_attention(ctx: Context, kernel, heads, dtype, queries: list[int], contexts: list[int]) -> dict:
    """Our kernel and dense SDPA on the same shapes (every request alike)."""
    import torch

    hq, hkv, d = heads
    reps = ctx.sizes.reps
    batch = make_batch(queries, contexts, heads, dtype, ctx.device, True, seed=3)
    for cache in (batch.k_cache, batch.v_cache):
        cache.nan_to_num_(0.0)

    def ours_call():
        return batch.call(kernel, d ** -0.5)
    ours, ours_graph = median_microseconds(ctx, ours_call, reps), graph_microseconds(ctx, ours_call, reps)
    b, n, seq_len = len(queries), queries[0], queries[0] + contexts[0]
    q = torch.randn(b, hq, n, d, device=ctx.device, dtype=dtype)
    k, v = (torch.randn(b, hkv, seq_len, d, device=ctx.device, dtype=dtype) for _ in range(2))
    call, gqa = sdpa_call(ctx, q, k, v, causal=n > 1)  # one query sees every key: no mask
    theirs, theirs_graph = median_microseconds(ctx, call, reps), graph_microseconds(ctx, call, reps)
    best_ours, best_theirs = ours_graph or ours, theirs_graph or theirs
    kv_bytes = 2 * b * seq_len * hkv * d * q.element_size()
    return {"requests": b, "query_tokens": n, "seq_len": seq_len, "ours_us": ours,
            "ours_graph_us": ours_graph, "sdpa_us": theirs, "sdpa_graph_us": theirs_graph,
            "ours_over_sdpa": best_ours / best_theirs, "sdpa_gqa": gqa,
            "ours_kv_gb_per_s": kv_bytes / best_ours / 1e3, "sdpa_kv_gb_per_s": kv_bytes / best_theirs / 1e3}


SECTION_FUNCTIONS = {"kernel_numerics": kernel_numerics, "engine_parity": engine_parity,
                     "decode_throughput": decode_throughput, "kernel_vs_sdpa": kernel_vs_sdpa}


# -- entry point ---------------------------------------------------------------------------------------
def environment(cuda: bool) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "cpu_count": os.cpu_count(),
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "")}
    for package in ("triton", "transformers"):
        try:
            env[package] = __import__(package).__version__
        except Exception as e:
            env[package] = f"not importable: {e}"
    if cuda:
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   compute_capability=f"{p.major}.{p.minor}")
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                           capture_output=True, timeout=10).stdout.strip() or "unknown"
    except Exception:
        env["git_commit"] = "unknown"
    return env


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "build" / "gpu_check")
    p.add_argument("--budget-seconds", type=float, default=450)
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, of {', '.join(SECTIONS)}")
    p.add_argument("--smoke", action="store_true", help="CPU dry run at tiny sizes (TRITON_INTERPRET=1)")
    p.add_argument("--layers", type=int, default=None, help="layers of the 8B-shaped model (default 32)")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the bound, TB/s")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one section, in-process
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv=None) -> int:
    global _LOG
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the network
    sys.path.insert(0, str(REPO))
    import torch

    cuda = not args.smoke and torch.cuda.is_available()
    if not args.smoke and not cuda:
        print("no CUDA device: run with --smoke for the CPU dry run", file=sys.stderr)
        return 2
    _LOG = args.out / "gpu_check.log"
    return run_child(args, cuda) if args.child else run_parent(args, cuda)


def run_parent(args: argparse.Namespace, cuda: bool) -> int:
    """Each section in a process of its own: a crash, or a CUDA error that poisons the
    context (an illegal address in a new kernel), then costs that section only."""
    args.out.mkdir(parents=True, exist_ok=True)
    _LOG.write_text("")
    report = Report(args.out, environment(cuda), {k: str(v) for k, v in vars(args).items() if k != "child"})
    for name in args.sections:
        report.section(name)
    report.save()
    deadline = time.monotonic() + args.budget_seconds
    say(f"gpu_check: {', '.join(args.sections)} on {report.data['environment'].get('gpu', 'cpu')}, "
        f"budget {args.budget_seconds:.0f} s, out {args.out}")
    for i, name in enumerate(args.sections):
        left = deadline - time.monotonic()
        if left < MIN_SECONDS[name]:
            report = Report.load(args.out)
            rec = report.section(name)
            rec["status"] = "skipped"
            rec["notes"].append(f"skipped: {left:.0f} s of budget left, it needs {MIN_SECONDS[name]} s")
            say(f"{name}: skipped (budget)")
            report.save()
            continue
        reserve = sum(MIN_SECONDS[n] for n in args.sections[i + 1:])
        run_section_process(args, name, max(MIN_SECONDS[name], left - reserve))
    report = Report.load(args.out)
    ok = report.all_passed()
    say(f"gpu_check: done, {'all ran and passed' if ok else 'some section failed'}; "
        f"see {args.out / 'gpu_check.md'}")
    return 0 if ok else 1


def run_section_process(args: argparse.Namespace, name: str, seconds: float) -> None:
    """Run one section in a child; record a child that died or hung without a result."""
    try:
        returncode = subprocess.run(_child_command(args, name, seconds),
                                    timeout=seconds + CHILD_GRACE_SECONDS).returncode
    except subprocess.TimeoutExpired:
        returncode = None
    report = Report.load(args.out)
    rec = report.section(name)
    if rec["status"] not in ("pending", "running"):
        return
    if returncode is None:
        rec["status"] = "timeout"
        how = f"was killed {CHILD_GRACE_SECONDS} s past its budget of {seconds:.0f} s"
    else:
        rec["status"], how = "error", f"ended with {_exit_status(returncode)}"
    rec["error"] = f"the section's process {how} before recording a result; its output is in gpu_check.log"
    say(f"{name}: {rec['status']}: {rec['error']}")
    report.save()


CHILD_GRACE_SECONDS = 30  # past the child's own alarm, for a hang the alarm cannot interrupt


def _child_command(args: argparse.Namespace, name: str, seconds: float) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--sections", name,
               "--budget-seconds", f"{seconds:.1f}", "--out", str(args.out), "--hbm-tbps", str(args.hbm_tbps)]
    command += ["--smoke"] if args.smoke else []
    command += ["--layers", str(args.layers)] if args.layers is not None else []
    return command


def _exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def run_child(args: argparse.Namespace, cuda: bool) -> int:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    report = Report.load(args.out)
    ctx = Context(args, SMOKE if args.smoke else FULL, "cuda" if cuda else "cpu", cuda, report,
                  time.monotonic() + args.budget_seconds)
    run_sections(ctx, args.sections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
