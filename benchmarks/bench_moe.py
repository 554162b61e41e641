"""Mixtures of experts on the CPU: a decode iteration of a Qwen3-MoE-shaped model beside a dense
Qwen3 with the same active parameters per token, how a batch's tokens spread over the experts,
two expert-parallel ranks against one, and the K/V bytes latent attention (MLA) keeps per token.

Random checkpoints from transformers' config classes (tools/model_zoo.py), fp32, the experts on
torch's grouped GEMM (moe_kernel "torch"; our Triton kernel is only interpreted on the CPU).
Timings are the model forward of full decode iterations (`benchmarks.common.decode_forward_ms`),
medians over rounds in which the configurations take turns; nothing asserts on time. Torch
work of size runs off the main thread (`off_main_thread`), until the last section.

    python -m benchmarks.bench_moe [--rounds 7] [--ep-rounds 4] [--steps 16]    # writes docs/benchmarks/moe.md
"""
from __future__ import annotations

import contextlib
import json
import statistics
import time
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
import transformers

from benchmarks.bench_models import decode_ms
from benchmarks.common import Report, best_seconds, log, num_params, off_main_thread, options, table, work_dir
from benchmarks.headline import record
from orca_backend.checkpoint.config import ModelConfig
from orca_backend.checkpoint.store import prepare_default_model
from orca_backend.engine.llm import LLM
from orca_backend.runner.models import moe
from orca_backend.runner.models.layers import MLP
from orca_backend.runner.models.moe import SparseMLP
from tools.model_zoo import FAMILIES, TINY, save_family

BATCHES = (1, 32, 256)
EP_BATCH = 32
ROUTED = (32, 256)  # batches whose tokens per expert are shown
SHAPE = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=2048)
EXPERTS, TOP_K, EXPERT_SIZE = 32, 4, 256
MOE = dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_SIZE, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])
DENSE = dict(intermediate_size=TOP_K * EXPERT_SIZE)  # the same MLP parameters per token as the MoE's top-k
ENGINE = dict(kv_cache_tokens=16384, max_batch_size=max(BATCHES), max_num_batched_tokens=4096, moe_kernel="torch")
EP_CONFIGS = {"1 rank": {}, "2 ranks, attention replicated": dict(expert_parallel_size=2),
              "2 ranks, attention split": dict(expert_parallel_size=2, tensor_parallel_size=2)}
# DeepSeek-V3's published shapes (671B), those the K/V cache depends on and the rest it needs to parse.
DEEPSEEK_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                   kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                   n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3,
                   n_group=8, topk_group=4, routed_scaling_factor=2.5)
BF16 = 2


def active_params(folder, config: ModelConfig) -> tuple[int, int]:
    """(all parameters, those one token's forward reads): the experts it is not routed to left out."""
    total, spec = num_params(folder), config.moe
    if spec is None:
        return total, total
    idle = sum(config.is_sparse(i) for i in range(config.num_layers)) * (spec.num_experts - spec.top_k)
    return total, total - idle * 3 * config.hidden_size * spec.intermediate_size


def decode_medians(folders: dict, rounds: int, steps: int, last=None) -> tuple[dict, dict, dict]:
    """({(model, batch): median forward ms}, {(model, batch): iterations timed}, {model: what
    `last(model, llm)` returned}) over `rounds` rounds, the models taking turns, each in an engine
    of its own for the round (one runner thread, one OpenMP team at a time) warmed up untimed at
    every batch first; `last` runs on each model's engine of the last round."""
    times, extra = {(k, b): [] for k in folders for b in BATCHES}, {}
    for n in range(rounds):
        for kind, folder in folders.items():
            with LLM(str(folder), **ENGINE) as llm:
                for batch in BATCHES:  # one-time costs (the allocator's first blocks)
                    decode_ms(llm, batch, 2)
                for batch in BATCHES:
                    times[(kind, batch)] += decode_ms(llm, batch, steps)
                if last is not None and n == rounds - 1:
                    extra[kind] = last(kind, llm)
        log(f"round {n + 1} of {rounds}: " + ", ".join(
            f"{k} b{b} {statistics.median(v):.1f} ms" for (k, b), v in times.items()))
    return {key: statistics.median(v) for key, v in times.items()}, {key: len(v) for key, v in times.items()}, extra


def moe_vs_dense(args, r: Report, folders: dict) -> dict[tuple[str, int], float]:
    """Decode ms per iteration of both models at each batch; where the MLP's time goes; how
    the experts' tokens spread."""
    def last(kind, llm):
        mlp = {b: mlp_profile(kind, llm, b, args.steps) for b in BATCHES}
        if kind != "MoE":
            return mlp, None
        routed = {}
        for batch in ROUTED:
            with watching(moe, "route", batch) as seen:
                decode_ms(llm, batch, 2)
            routed[batch] = [ids for _, (_, ids) in seen[:SHAPE["num_hidden_layers"]]]
        return mlp, routed
    med, counts, extra = decode_medians(folders, args.rounds, args.steps, last)
    (moe_mlp, routed), (dense_mlp, _) = extra["MoE"], extra["dense"]
    configs = {kind: ModelConfig.from_folder(folder) for kind, folder in folders.items()}
    sizes = {kind: active_params(folders[kind], configs[kind]) for kind in folders}
    r.section("A decode iteration: MoE against dense at the same active parameters",
              f"Qwen3 shapes: hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, "
              f"{SHAPE['num_attention_heads']} heads / {SHAPE['num_key_value_heads']} K/V heads of "
              f"{SHAPE['head_dim']}, "
              f"vocabulary {SHAPE['vocab_size']}. MoE: {EXPERTS} experts of {EXPERT_SIZE}, top {TOP_K}, on every "
              f"layer; dense: one MLP of {TOP_K} x {EXPERT_SIZE} = {DENSE['intermediate_size']}, so that a token's "
              "forward reads the same parameters. Prompts of 16 tokens; model forward per iteration in which every "
              f"row decodes, median of {args.rounds} rounds of about {args.steps} iterations, the two models taking "
              "turns, one engine open at a time.")
    r.table(["model", "parameters", "active per token"],
            [[kind, f"{total / 1e6:.1f} M", f"{active / 1e6:.1f} M"] for kind, (total, active) in sizes.items()])
    ratios = {b: med[("MoE", b)] / med[("dense", b)] for b in BATCHES}
    r.table(["batch", "MoE ms / iteration", "dense ms / iteration", "MoE / dense", "MoE tokens/s", "iterations timed"],
            [[b, f"{med[('MoE', b)]:.1f}", f"{med[('dense', b)]:.1f}", f"{ratios[b]:.2f}x",
              f"{b / med[('MoE', b)] * 1e3:,.0f}", counts[("MoE", b)]] for b in BATCHES])
    mib = 3 * SHAPE["hidden_size"] * EXPERT_SIZE * 4 * SHAPE["num_hidden_layers"] / 2**20  # one expert per layer, fp32
    r.add(f"The goal is at most 1.3x at batch 32 and above. From batch 32 on few experts are idle (see below), "
          f"so an iteration reads nearly all {EXPERTS} experts' weights ({EXPERTS * mib:.0f} MiB in fp32, "
          f"{EXPERTS // TOP_K}x the dense model's {TOP_K * mib:.0f} MiB of MLP), in GEMMs of about batch x {TOP_K} / "
          f"{EXPERTS} rows each. Where the difference is: the MLP blocks of all {SHAPE['num_hidden_layers']} "
          "layers per iteration (a run after the last round's, each call timed; `grouped experts`: "
          "`grouped_experts`, the two grouped GEMMs with the sort and the weighted sum; the rest of the MoE block is "
          "the router and `route`), and the rest of the forward (attention, norms, LM head): the same runs' median "
          "forward less their MLP blocks:", "")
    r.table(["batch", "MoE block ms", "of it grouped experts", "dense MLP ms", "MoE block / dense MLP",
             "rest of MoE forward", "rest of dense forward"],
            [[b, f"{moe_mlp[b]['block']:.1f}", f"{moe_mlp[b]['experts']:.1f}", f"{dense_mlp[b]['block']:.1f}",
              f"{moe_mlp[b]['block'] / dense_mlp[b]['block']:.1f}x", f"{moe_mlp[b]['rest']:.1f}",
              f"{dense_mlp[b]['rest']:.1f}"] for b in BATCHES])
    r.add(*off_main_thread(grouped_gemm_lines))
    routing_section(r, routed)
    return med


@contextlib.contextmanager
def watching(owner, name: str, rows: int) -> Iterator[list]:
    """`owner.name` wrapped while inside: (seconds, result) of each call whose first tensor
    argument has `rows` rows (a decode iteration's, at batch `rows`), in call order."""
    original, seen = getattr(owner, name), []

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        took = time.perf_counter() - start
        if next(a for a in args if isinstance(a, torch.Tensor)).shape[0] == rows:
            seen.append((took, out))
        return out
    setattr(owner, name, wrapper)
    try:
        yield seen
    finally:
        setattr(owner, name, original)


def mlp_profile(kind: str, llm: LLM, batch: int, steps: int) -> dict[str, float]:
    """Ms per decode iteration at `batch` in the MLP blocks of all layers (`block`; the MoE's
    grouped experts apart, `experts`) and in the rest of the forward, from one run."""
    layers = SHAPE["num_hidden_layers"]
    per_iteration = lambda seen: sum(t for t, _ in seen) / max(1, len(seen) // layers) * 1e3
    with contextlib.ExitStack() as stack:
        block = stack.enter_context(watching(SparseMLP if kind == "MoE" else MLP, "__call__", batch))
        experts = stack.enter_context(watching(moe, "grouped_experts", batch))
        forward = statistics.median(decode_ms(llm, batch, steps))
    return {"block": per_iteration(block), "experts": per_iteration(experts), "rest": forward - per_iteration(block)}


def grouped_gemm_lines() -> list[str]:
    """The gate|up projection of every layer three ways: the grouped GEMM over even runs of
    tokens, one matmul per expert, and the dense model's one matmul over the same active weights."""
    h, layers, rows = SHAPE["hidden_size"], SHAPE["num_hidden_layers"], []
    w1s = [torch.randn(EXPERTS, h, 2 * EXPERT_SIZE) for _ in range(layers)]  # each layer its own, as in the model
    denses = [torch.randn(h, 2 * DENSE["intermediate_size"]) for _ in range(layers)]
    for batch in BATCHES:
        pairs, x = torch.randn(batch * TOP_K, h), torch.randn(batch, h)
        counts = [batch * TOP_K // EXPERTS + (e < batch * TOP_K % EXPERTS) for e in range(EXPERTS)]
        ends = torch.tensor(counts).cumsum(0).to(torch.int32)
        spans = list(enumerate(zip([0, *ends[:-1].tolist()], ends.tolist())))
        ways = (lambda: [F.grouped_mm(pairs, w1, offs=ends) for w1 in w1s],
                lambda: [[pairs[i:j] @ w1[e] for e, (i, j) in spans] for w1 in w1s],
                lambda: [x @ dense for dense in denses])
        times = [best_seconds(fn, 10) for fn in ways]
        rows.append([batch, *(f"{t * 1e3:.2f}" for t in times), f"{times[0] / times[2]:.1f}x"])
    mib = EXPERTS * h * 2 * EXPERT_SIZE * 4 / 2**20
    return [f"The gate|up projections of {layers} layers alone, each layer its own weights ({mib:.0f} MiB of experts "
          f"each, fp32; one layer's alone would stay in the cache between calls, which the model's do not), the "
          f"{TOP_K} pairs of each token spread evenly over the experts (at batch 1, {TOP_K} experts of one token "
          f"each and {EXPERTS - TOP_K} empty): `torch.nn.functional.grouped_mm` as the MoE layer calls it, one "
          "matmul per expert in a Python loop, and the dense model's matmul over the same active weights; best of "
          "10, ms for all layers:", "",
            *table(["batch", "grouped_mm", "a matmul per expert", "dense matmul", "grouped_mm / dense"], rows), ""]


def routing_section(r: Report, routed: dict[int, list[torch.Tensor]]) -> None:
    """Tokens per expert of each layer's expert ids [batch, k], at each batch."""
    rows = []
    for batch, layers in routed.items():
        for layer, ids in enumerate(layers):
            counts = sorted(ids.reshape(-1).tolist().count(e) for e in range(EXPERTS))  # Python: see off_main_thread
            rows.append([batch, layer, counts[0], f"{statistics.median(counts):.0f}", counts[-1],
                         f"{counts[-1] / statistics.mean(counts):.2f}x", f"{counts.count(0) / EXPERTS:.0%}",
                         len({tuple(sorted(row)) for row in ids.tolist()})])
    r.section(f"Tokens per expert at batch {' and '.join(map(str, routed))}",
              "The expert ids `route` returned on each layer in the first iteration where every row decodes "
              f"(batch x {TOP_K} pairs over {EXPERTS} experts: {ROUTED[0] * TOP_K // EXPERTS} and "
              f"{ROUTED[-1] * TOP_K // EXPERTS} each if even); `sets`: how many different sets of {TOP_K} experts the "
              "rows chose. A random checkpoint: its router is untrained, so this shows how the layer's work spreads "
              "over a batch, not a trained model's balance.")
    r.table(["batch", "layer", "min tokens", "median", "max", "max / mean", "idle experts", "sets"], rows)


class _WholeStep:
    """An LLM as `decode_ms` reads it, the engine's whole step() in place of its model forward
    (the message handed to the other ranks, sampling and scheduling included)."""

    def __init__(self, llm: LLM) -> None:
        self.engine, self._engine = self, llm.engine
        self.add_request, self.step = llm.engine.add_request, llm.engine.step
        self.has_unfinished_requests = llm.engine.has_unfinished_requests

    @property
    def stats(self):
        return types.SimpleNamespace(forward_seconds=self._engine.stats.step_seconds)


def expert_parallel(args, r: Report, folder) -> None:
    """Batch EP_BATCH on 1 and 2 ranks; an engine per configuration and round (a 2-rank group
    sets this process's torch threads while it lives)."""
    forward, step = ({c: [] for c in EP_CONFIGS} for _ in range(2))
    for n in range(args.ep_rounds):
        for name, extra in EP_CONFIGS.items():
            with LLM(str(folder), **{**ENGINE, "max_batch_size": EP_BATCH, **extra}) as llm:
                forward[name] += decode_ms(llm, EP_BATCH, args.steps)
                step[name] += decode_ms(_WholeStep(llm), EP_BATCH, args.steps)
            log(f"expert parallel: round {n + 1}: {name}: forward {statistics.median(forward[name]):.1f} ms, "
                f"step {statistics.median(step[name]):.1f} ms")
    fwd = {c: statistics.median(v) for c, v in forward.items()}
    whole = {c: statistics.median(v) for c, v in step.items()}
    one = "1 rank"
    r.section(f"Expert parallelism at batch {EP_BATCH}",
              f"The MoE model above on one rank, and with expert_parallel_size 2 (each rank holds {EXPERTS // 2} "
              "whole experts; one all-reduce per layer joins them), attention replicated on both ranks "
              "(tensor_parallel_size 1) or split between them (2). Ranks are processes on gloo, one torch thread "
              f"each; one rank has both threads. Median of {args.ep_rounds} rounds, a fresh engine per configuration "
              "and round; `forward`: rank 0's model forward (waiting for the other rank's all-reduces included); "
              "`step`: the engine's step() (the message's hand-off to the other rank, sampling and scheduling too; "
              "the engine prepares an iteration while the runner thread runs the last, so it can be below the "
              "forward), from a second run.")
    r.table(["configuration", "forward ms / iteration", "vs 1 rank", "step ms / iteration", "vs 1 rank"],
            [[c, f"{fwd[c]:.1f}", f"{fwd[c] / fwd[one]:.2f}x", f"{whole[c]:.1f}", f"{whole[c] / whole[one]:.2f}x"]
             for c in EP_CONFIGS])
    r.add("This machine has 2 cores: two ranks split them rather than add any, so the most expert parallelism "
          "can do here is what two 1-thread GEMMs of half the experts save over one 2-thread GEMM of all of "
          "them, less a gloo all-reduce per layer. On GPUs each rank brings its own memory bandwidth.", "")


EXCHANGE = dict(hidden=2048, top_k=8, tokens=(32, 256), repeats=20)  # Qwen3-30B-A3B's hidden size and top-k


def _exchange_rank(rank: int, world: int, port: int, results) -> None:
    """One of `world` gloo ranks: the time of each way of joining an expert-parallel layer's
    outputs, when every rank holds every token (ms, rank 0's)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    hidden, k, timings = EXCHANGE["hidden"], EXCHANGE["top_k"], {}
    for tokens in EXCHANGE["tokens"]:
        y, own = torch.randn(tokens, hidden), torch.randn(tokens // world, hidden)
        pairs = torch.randn(tokens // world * k, hidden)  # this rank's tokens' (token, expert) pairs
        splits = [len(pairs) // world] * world  # routed evenly over the ranks' experts

        def all_reduce():  # every rank has every token: sum the ranks' partial outputs
            dist.all_reduce(y)

        def all_to_all():  # each rank its 1/world of the tokens: pairs out to their experts, back, then gather
            there, back = torch.empty_like(pairs), torch.empty_like(pairs)
            dist.all_to_all_single(there, pairs, splits, splits)
            dist.all_to_all_single(back, there, splits, splits)
            dist.all_gather([torch.empty_like(own) for _ in range(world)], own)

        for name, fn in (("all-reduce", all_reduce), ("all-to-all dispatch, combine, all-gather", all_to_all)):
            for _ in range(3):
                fn()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(EXCHANGE["repeats"]):
                fn()
            dist.barrier()
            timings[(name, tokens)] = (time.perf_counter() - start) / EXCHANGE["repeats"] * 1e3
    if rank == 0:
        results.put(timings)
    dist.destroy_process_group()


def exchange(r: Report) -> None:
    """The all-reduce expert parallelism uses against an all-to-all exchange, on 2 gloo ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_exchange_rank, args=(rank, 2, port, results)) for rank in range(2)]
    for p in ranks:
        p.start()
    timings = results.get(timeout=600)
    for p in ranks:
        p.join()
    names = sorted({name for name, _ in timings}, key=len)
    r.section("Joining the experts' outputs: one all-reduce against an all-to-all",
              f"2 gloo ranks on this machine, one thread each, fp32 rows of {EXCHANGE['hidden']} (Qwen3-30B-A3B's "
              f"hidden size), top-{EXCHANGE['top_k']}, the pairs routed evenly over the ranks; ms per layer, rank 0, "
              f"mean of {EXCHANGE['repeats']}. `all-reduce`: what expert parallelism does here, every rank holding "
              "every token. `all-to-all`: each rank taking 1/2 of the tokens, sending their pairs to the experts' "
              "ranks and back, then gathering every token's output (what data-parallel attention would need).")
    r.table(["tokens", *names, "all-to-all / all-reduce"],
            [[str(t), *(f"{timings[(n, t)]:.2f}" for n in names), f"{timings[(names[1], t)] / timings[(names[0], t)]:.1f}x"]
             for t in EXCHANGE["tokens"]])
    r.add("With every token already on every rank, one all-reduce moves 2 (E-1)/E of the layer's output; the "
          "all-to-all moves each pair twice (top-k pairs a token) and the tokens once more.", "")


def mla_config(tmp, name: str, fields: dict) -> ModelConfig:
    """A DeepseekV3ForCausalLM ModelConfig from transformers' DeepseekV3Config(**fields)."""
    folder = tmp / name
    folder.mkdir()
    raw = transformers.DeepseekV3Config(**fields).to_dict()
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(raw))
    return ModelConfig.from_folder(folder)


def mla_bytes(r: Report, tmp) -> None:
    """K/V bytes per token from ModelConfig for DeepSeek-V3's shapes and the zoo's tiny one,
    against per-head K (nope + rope dims) and V of the same heads."""
    configs = {"DeepSeek-V3 (671B shapes)": mla_config(tmp, "v3", DEEPSEEK_V3),
               "zoo deepseek-v3 (tiny)": mla_config(tmp, "tiny", {**TINY, **FAMILIES["deepseek-v3"][1]})}
    rows, ratio = [], {}
    for name, c in configs.items():
        m, heads, t = c.mla, c.num_heads, min(8, c.num_heads)
        plain = {n: c.num_layers * (heads // n) * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * BF16
                 for n in (1, t)}
        latent = {n: c.kv_elements_per_rank_token(n) * BF16 for n in (1, t)}
        ratio[name] = plain[1] / latent[1]
        rows.append([name, c.num_layers, heads, f"{m.kv_lora_rank} + {m.qk_rope_head_dim}", str(c.kv_layout()),
                     f"{latent[1]:,}", f"{plain[1]:,}", f"{ratio[name]:.1f}x", t, f"{latent[t]:,}", f"{plain[t]:,}"])
    r.section("K/V bytes per token: latent attention (MLA) against plain heads",
              "bf16. `latent`: `ModelConfig.kv_elements_per_rank_token(T)` x 2 bytes, a config.json written from "
              "transformers' `DeepseekV3Config(...).to_dict()` and read by `ModelConfig.from_folder`: one latent "
              "(kv_lora_rank + qk_rope_head_dim) per token and layer, whole on every rank. `plain`: the same heads "
              "caching K (qk_nope_head_dim + qk_rope_head_dim) and V (v_head_dim) apiece, "
              "layers x heads / T x (nope + rope + v) x 2 bytes. T: tensor-parallel ranks (8, or one per head).")
    r.table(["model", "layers", "heads", "latent dims", "kv_layout() (heads, dims, V apart)", "latent, T=1",
             "plain, T=1", "plain / latent", "T", "latent per rank", "plain per rank"], rows)
    v3 = configs["DeepSeek-V3 (671B shapes)"]
    context = 32768 * v3.kv_elements_per_rank_token() * BF16 / 2**30  # GiB
    r.add(f"At DeepSeek-V3's shapes a 32k-token context holds {context:.1f} GiB of latents against "
          f"{context * ratio['DeepSeek-V3 (671B shapes)']:.0f} "
          "GiB of plain K/V. The latent is not split by tensor parallelism, so the saving per rank shrinks with T.", "")


def second_team(args, r: Report, folders: dict, clean: dict[tuple[str, int], float]) -> None:
    """The MoE against dense again once this thread has run one torch GEMM of size, so that its
    OpenMP team stays beside each runner thread's (as in a process whose other threads use torch)."""
    torch.randn(256, 512) @ torch.randn(512, 512)
    med, _, _ = decode_medians(folders, args.second_rounds, args.steps)
    r.section("With a second OpenMP team in the process",
              "The same two engines once the thread that steps them has run one 256 x 512 x 512 matmul: torch "
              "keeps an OpenMP team per thread that calls into it, and that team's threads then share the 2 cores "
              "with the runner thread's. Every figure above was measured without it (the checkpoints and the "
              "grouped_mm table ran on threads of their own that ended); median of "
              f"{args.second_rounds} rounds:")
    ratio = lambda ms, b: f"{ms[('MoE', b)] / ms[('dense', b)]:.2f}x"
    r.table(["batch", "MoE ms", "without it", "dense ms", "without it", "MoE / dense", "without it"],
            [[b, f"{med[('MoE', b)]:.1f}", f"{clean[('MoE', b)]:.1f}", f"{med[('dense', b)]:.1f}",
              f"{clean[('dense', b)]:.1f}", ratio(med, b), ratio(clean, b)] for b in BATCHES])
    r.add(f"The MoE model loses more than the dense one: on the CPU its grouped GEMMs are a matmul per expert with "
          f"tokens, up to {2 * EXPERTS} small ones a layer, where the dense MLP runs 2.", "")


def main() -> None:
    p = options(__doc__, "moe.md")
    p.add_argument("--rounds", type=int, default=7, help="rounds of the MoE against dense")
    p.add_argument("--ep-rounds", type=int, default=4, help="rounds of the expert-parallel configurations")
    p.add_argument("--second-rounds", type=int, default=2, help="rounds with a second OpenMP team")
    p.add_argument("--steps", type=int, default=16, help="decode iterations per run, about")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    tokenizer = prepare_default_model() / "tokenizer.json"
    r = Report("Mixtures of experts: decode cost, routing, expert parallelism, latent K/V", "bench-moe")
    with work_dir() as tmp:
        log("writing the checkpoints ...")
        folders = {"MoE": off_main_thread(save_family, "qwen3-moe", tmp / "moe", tokenizer, **SHAPE, **MOE),
                   "dense": off_main_thread(save_family, "qwen3", tmp / "dense", tokenizer, **SHAPE, **DENSE)}
        clean = moe_vs_dense(args, r, folders)
        expert_parallel(args, r, folders["MoE"])
        exchange(r)
        mla_bytes(r, tmp)
        second_team(args, r, folders, clean)  # last: it leaves this thread's OpenMP team behind
    r.section("What limits these figures",
              "- 2 CPU cores: the experts' GEMMs, attention and the LM head share them; two expert-parallel ranks "
              "split them (one thread each) rather than add any.",
              "- float32 throughout, and torch's CPU `grouped_mm` (the table above: about one matmul per expert); "
              "our Triton kernel (moe_kernel \"triton\", the GPU path) is only interpreted on the CPU and not timed.",
              "- Small random models: at hidden 512 an iteration is partly fixed per-op cost, and the routing comes "
              "from an untrained router, not a trained model's balance.",
              "- Torch's OpenMP teams: one per thread that calls into torch. The engines' runner threads here are "
              "the only ones (last section: what a second costs, the MoE most).",
              "- Medians over a few rounds on a shared machine (its load is in the setup); read the ratios more "
              "than the absolute figures.")
    r.setup(f"- torch {torch.__version__}, {torch.get_num_threads()} threads, dtype float32, moe_kernel torch "
            "(`torch.nn.functional.grouped_mm`)").write(args.markdown)
    log("MoE / dense: " + ", ".join(f"batch {b} {clean[('MoE', b)] / clean[('dense', b)]:.2f}x" for b in BATCHES))
    ratio = {b: clean[("MoE", b)] / clean[("dense", b)] for b in BATCHES}
    record(args.markdown, "bench-moe", {"moe": (
        f"Mixture of experts ({EXPERTS} experts, top {TOP_K}): a decode iteration against a dense model of the same "
        f"active parameters, batch {' / '.join(map(str, BATCHES))} (goal: at most 1.3x from 32 on)",
        " / ".join(f"{ratio[b]:.2f}x" for b in BATCHES) + f" (from batch 32 on it reads all {EXPERTS} experts)")})


if __name__ == "__main__":
    main()
