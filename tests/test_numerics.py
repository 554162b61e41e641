"""Our engine against Hugging Face transformers on the same weights: greedy tokens equal,
per-iteration logits within fp32 tolerance, with prefill, decode and chunked prefill mixed."""
from __future__ import annotations

import pytest
import torch

from orca_backend import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.numerics  # slow group: against transformers

# (prompt length, max_tokens): different lengths, some longer than the token budget.
SHAPES = [(5, 12), (40, 6), (17, 20), (1, 9), (64, 4), (23, 15), (9, 1), (33, 11)]
# The K/V pool of every engine here that does not size its own: all of a test's requests fit
# at once (nothing is preempted or evicted but where a variant means it). The default, 1 GiB a
# rank, costs each engine 0.7 s of system time to zero, and with blocks of 4 (half a million
# of them) 0.1 s a step in `check_integrity`.
POOL_TOKENS = 1024


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n, _ in SHAPES]


def _reference(folder, prompts, shapes=SHAPES):
    """transformers' generate on each prompt alone: token ids and per-step logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    refs = []
    for ids, (_, max_tokens) in zip(prompts, shapes):
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
        refs.append((out.sequences[0, len(ids):].tolist(), [lg[0] for lg in out.logits]))
    return refs


def _run_staggered(engine: LLMEngine, prompts, shapes=SHAPES, cached: dict | None = None):
    """Add two requests, then one more every iteration, so batches mix prefill and decode.
    `cached` collects each request's num_cached_tokens."""
    tokens = {i: [] for i in range(len(prompts))}
    logits = {i: [] for i in range(len(prompts))}
    pending = list(range(len(prompts)))
    mixed_iterations = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(2 if len(pending) == len(prompts) else 1):
            if pending:
                i = pending.pop(0)
                engine.add_request(str(i), prompts[i], SamplingParams(
                    temperature=0, max_tokens=shapes[i][1], ignore_eos=True))
        deltas = engine.step()
        mixed_iterations += any(it.num_prefill_requests > 0 and it.num_decode_requests > 0 for it in deltas.iterations)
        for d in deltas:
            tokens[int(d.request_id)] += d.token_ids
            logits[int(d.request_id)].append(d.logits)
            if cached is not None:
                cached[int(d.request_id)] = d.num_cached_tokens
        engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0
    return tokens, logits, mixed_iterations


def _check(engine, prompts, refs, shapes=SHAPES, cached: dict | None = None):
    tokens, logits, mixed = _run_staggered(engine, prompts, shapes, cached)
    assert mixed > 0, "no iteration mixed prefill with decode"
    for i, (ref_tokens, ref_logits) in enumerate(refs):
        assert tokens[i] == ref_tokens, f"request {i} (prompt of {len(prompts[i])} tokens) diverged"
        for step, (ours, theirs) in enumerate(zip(logits[i], ref_logits)):
            torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3,
                                       msg=lambda m: f"request {i} step {step}: {m}")


ENGINE_VARIANTS = {
    "iteration": dict(),  # the projections through oneDNN (linear "auto" on the CPU)
    "torch-linear": dict(linear="torch"),  # through F.linear (MKL on the CPU)
    "chunked": dict(max_num_batched_tokens=16),
    "preempt": dict(kv_cache_tokens=96, block_size=4, max_num_batched_tokens=32),
    "reserve": dict(kv_cache_tokens=160, block_size=8, policy="reserve"),
    "request": dict(batching="request", max_batch_size=4),
    # Two iterations in flight, so a batch splits around the requests still out.
    "inflight": dict(max_inflight=2, max_batch_size=3, max_num_batched_tokens=32),
    # The runner in a child process, fed only the messages.
    "process": dict(executor="process", max_inflight=2, kv_cache_tokens=96, block_size=4,
                    max_num_batched_tokens=32),
    # Two pipeline stages, each its own layers and K/V cache; two iterations in flight.
    "pipeline": dict(executor="pipeline", max_batch_size=3, max_num_batched_tokens=32),
    "pipeline-preempt": dict(executor="pipeline", max_inflight=1, kv_cache_tokens=96, block_size=4,
                             max_num_batched_tokens=32),
    # Our kernel (trt_plugins) under the Triton interpreter, preempting, one launch per layer.
    # (Decode iterations through the padded buffers of the CUDA-graph path, the default:
    # test_kernel_backend_matches_sdpa_backend, against the SDPA backend at 1e-4.)
    "kernel-preempt": dict(attention="triton", cuda_graphs=False, kv_cache_tokens=80,
                           max_num_batched_tokens=24),
    # The GPU engine path: the kernel compiled, decode iterations replayed from CUDA graphs.
    "cuda": dict(device="cuda", attention="triton"),
    # engine: tensorrt's graph evaluated with torch (our plugin entry interpreted), preempting.
    "tensorrt-graph": dict(engine="tensorrt", tensorrt_runtime="torch", kv_cache_tokens=80,
                           max_num_batched_tokens=24),
    # Tensor parallelism (gloo): 2 ranks behind the process executor, with chunked prefill,
    # preempting, 2 iterations in flight; 4 ranks inline (Llama's 2 K/V heads replicated);
    # a 2-stage pipeline of 2 ranks each.
    "tp2": dict(tensor_parallel_size=2, executor="process", max_inflight=2,
                kv_cache_tokens=96, block_size=4, max_num_batched_tokens=32),
    "tp4": dict(tensor_parallel_size=4, max_num_batched_tokens=32),
    "pipeline-tp2": dict(executor="pipeline", tensor_parallel_size=2, max_batch_size=3,
                         max_num_batched_tokens=32),
}
PREEMPTING = ("preempt", "process", "kernel-preempt", "pipeline-preempt", "tensorrt-graph", "tp2")
# The interpreter is slow: preemption under the kernel, and the TensorRT graph (which
# test_trt_engine.py checks on Qwen2 too), run on llama alone; so do the costlier rank layouts.
KINDS = {"kernel-preempt": ["llama"], "tensorrt-graph": ["llama"], "pipeline-tp2": ["llama"],
         "tp4": ["llama"],  # the kernel with one head per K/V head (GPT-2's): test_kernel.py
         "torch-linear": ["qwen2"]}  # F.linear with a bias; the default path covers all three
# ... and on 3 of SHAPES, a sixth of the iterations: (1, 9), (64, 4), (9, 1). Still a 1-token
# prompt and a 1-token answer, and the 64-token prompt in chunks over its cached blocks beside
# decodes; under kv_cache_tokens=80 it is preempted, resumed from its cached blocks, and
# decodes into a new block at position 64. (Every shape, kernel alone: test_kernel.py.)
FEW_SHAPES = (3, 4, 6)
ON_FEW_SHAPES = ("kernel-preempt", "tensorrt-graph", "tp4", "pipeline-tp2")
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _variants():
    """(variant, model kind) pairs."""
    params = []
    for v, options in ENGINE_VARIANTS.items():
        for kind in KINDS.get(v, ["llama", "qwen2", "gpt2"]):
            marks = [NEEDS_CUDA] if options.get("device") == "cuda" else []
            params.append(pytest.param(v, kind, marks=marks, id=f"{v}-{kind}"))
    return params


@pytest.fixture(scope="module")
def references(tiny_models):
    cache = {}

    def get(kind):
        if kind not in cache:
            prompts = _prompts(512)
            cache[kind] = prompts, _reference(tiny_models[kind], prompts)
        return cache[kind]
    return get


@pytest.mark.parametrize("variant, kind", _variants())
def test_tiny_models_match_transformers(kind, variant, tiny_models, references):
    prompts, refs = references(kind)
    shapes = SHAPES
    if variant in ON_FEW_SHAPES:
        prompts, refs, shapes = ([x[i] for i in FEW_SHAPES] for x in (prompts, refs, SHAPES))
    engine = LLMEngine(EngineConfig(model=str(tiny_models[kind]), keep_logits=True,
                                    **{"kv_cache_tokens": POOL_TOKENS, **ENGINE_VARIANTS[variant]}))
    try:
        _check(engine, prompts, refs, shapes)
    finally:
        engine.shutdown()
    assert (engine.scheduler.num_preemptions > 0) == (variant in PREEMPTING)


# The default model (30 layers, each step of its reference a tenth of a second) on 4 of SHAPES:
# (1, 9), (64, 4), (23, 15), (9, 1). Two prompts still go in chunks beside decodes, and
# `preempt`'s 96 tokens still preempt; every shape: the tiny models.
DEFAULT_MODEL_SHAPES = (3, 4, 5, 6)


@pytest.fixture(scope="module")
def default_references(default_model):
    prompts = [_prompts(49152)[i] for i in DEFAULT_MODEL_SHAPES]
    shapes = [SHAPES[i] for i in DEFAULT_MODEL_SHAPES]
    return prompts, shapes, _reference(default_model, prompts, shapes)


@pytest.mark.parametrize("variant", ["chunked", "preempt"])
def test_default_model_matches_transformers(variant, default_model, default_references):
    prompts, shapes, refs = default_references
    engine = LLMEngine(EngineConfig(model=str(default_model), keep_logits=True,
                                    **{"kv_cache_tokens": POOL_TOKENS, **ENGINE_VARIANTS[variant]}))
    _check(engine, prompts, refs, shapes)
    assert (engine.scheduler.num_preemptions > 0) == (variant == "preempt")


def test_kernel_backend_matches_sdpa_backend(tiny_models):
    """The two attention backends on the same engine settings: equal greedy tokens, and
    logits closer to each other than either is to transformers' (fp32 on both). The 40- and
    31-token prompts go in chunks beside decodes; then three decode together (a batch of 3,
    padded to the CUDA-graph path's 4), the 31-token one into a new block at position 32; then
    one alone (unpadded)."""
    shapes = [(5, 8), (40, 6), (31, 4)]
    prompts = [_prompts(512)[i][:n] for i, (n, _) in zip((0, 1, 7), shapes)]  # 7: 33 tokens
    runs = {}
    for attention in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model=str(tiny_models["llama"]), keep_logits=True, attention=attention,
                                        max_num_batched_tokens=24, kv_cache_tokens=POOL_TOKENS))
        runs[attention] = _run_staggered(engine, prompts, shapes)
        engine.shutdown()
    (sdpa_tokens, sdpa_logits, _), (kernel_tokens, kernel_logits, _) = runs["torch"], runs["triton"]
    assert kernel_tokens == sdpa_tokens
    for i in sdpa_logits:
        for ours, theirs in zip(kernel_logits[i], sdpa_logits[i]):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


# -- prefix caching: the same tokens and logits as transformers with K/V reused ------------------
# Blocks of 4. Each request shares a prefix with an earlier one: 0 and 1 arrive together (no
# hit: 0's blocks are cached when its iteration returns); 2 is 0 again (the whole prompt
# cached but its last block, whose last token must be computed); 3 shares exactly 4 blocks,
# 4 one token past them, 5 one token short; 6 is 0's second turn (its prompt, its answer, a
# new message: the answer's K/V was written by decode steps); 7 is short.
SHARED_MAX_TOKENS = (6, 5, 7, 8, 3, 9, 5, 4)
SHARED_HITS = (0, 0, 16, 16, 16, 12, 24, 4)  # cached tokens of each, staggered, nothing evicted
PREFIX_VARIANTS = {
    "iteration": dict(),  # the projections through oneDNN (linear "auto" on the CPU)
    "torch-linear": dict(linear="torch"),  # through F.linear (MKL on the CPU)
    "chunked": dict(max_num_batched_tokens=8),
    "preempt": dict(kv_cache_tokens=48, max_num_batched_tokens=16),
    "inflight": dict(max_inflight=2, max_batch_size=3, max_num_batched_tokens=16),
    "process": dict(executor="process", max_inflight=2, kv_cache_tokens=48, max_num_batched_tokens=16),
    "pipeline": dict(executor="pipeline", max_batch_size=3, max_num_batched_tokens=16),
    "kernel": dict(attention="triton", max_num_batched_tokens=16),
}
# The interpreter is slow: under the kernel, every request but 0 (whose answer is 6's prompt)
# stops after its first KERNEL_MAX_TOKENS tokens. The same hits, 10 iterations instead of 14,
# at most 5 requests in one (instead of 7); each hit still decodes twice over its cached
# blocks, 6 into a new block at position 32.
KERNEL_MAX_TOKENS = 3


def _shared_prompts(folder) -> tuple[list[list[int]], list[tuple[int, int]]]:
    g = torch.Generator().manual_seed(2)
    base = torch.randint(3, 512, (20,), generator=g).tolist()
    other = torch.randint(3, 512, (6,), generator=g).tolist()
    prompts = [base, base, base, base[:16] + other[:5], base[:17] + other[:4], base[:15] + other,
               None, base[:8]]
    first_answer = _reference(folder, [base], [(20, SHARED_MAX_TOKENS[0])])[0][0]
    prompts[6] = base + first_answer + other[:5]
    return prompts, [(len(p), n) for p, n in zip(prompts, SHARED_MAX_TOKENS)]


@pytest.fixture(scope="module")
def shared_references(tiny_models):
    """Each kind's shared-prefix prompts, their shapes and transformers' answers, made once."""
    cache = {}

    def get(kind):
        if kind not in cache:
            prompts, shapes = _shared_prompts(tiny_models[kind])
            cache[kind] = prompts, shapes, _reference(tiny_models[kind], prompts, shapes)
        return cache[kind]
    return get


@pytest.mark.parametrize("variant, kind", [pytest.param(v, k, id=f"{v}-{k}") for v in PREFIX_VARIANTS
                                           for k in (["llama"] if v == "kernel" else ["llama", "gpt2"])])
def test_prefix_cache_hits_give_transformers_tokens_and_logits(variant, kind, tiny_models, shared_references):
    folder = tiny_models[kind]
    prompts, shapes, refs = shared_references(kind)
    if variant == "kernel":  # transformers' first tokens and logits are its answer to the shorter request
        shapes = [(n, min(m, KERNEL_MAX_TOKENS) if i else m) for i, (n, m) in enumerate(shapes)]
        refs = [(tokens[:m], logits[:m]) for (tokens, logits), (_, m) in zip(refs, shapes)]
    engine = LLMEngine(EngineConfig(model=str(folder), keep_logits=True, block_size=4,
                                    **{"kv_cache_tokens": POOL_TOKENS, **PREFIX_VARIANTS[variant]}))
    cached: dict[int, int] = {}
    try:
        _check(engine, prompts, refs, shapes, cached)
    finally:
        engine.shutdown()
    assert engine.kv.stats.num_hit_tokens > 0
    if variant == "iteration":
        assert tuple(cached[i] for i in range(len(prompts))) == SHARED_HITS
    if variant in ("preempt", "process"):
        assert engine.scheduler.num_preemptions > 0


def test_default_model_at_three_ranks_equals_one(default_model):
    """`LLM(tensor_parallel_size=3)`: SmolLM2-135M's 9 heads, 3 K/V heads, intermediate size
    1536 and vocabulary 49152 all split 3 ways (2 do not: its 9 heads); the same greedy
    tokens as one rank, and their log-probabilities within fp32 tolerance."""
    from orca_backend import LLM

    prompts = ["The capital of France is", "Write a haiku about the sea:"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs = []
    for size in (1, 3):
        llm = LLM(str(default_model), tensor_parallel_size=size, max_num_batched_tokens=16,
                  kv_cache_tokens=POOL_TOKENS)
        runs.append(llm.generate(prompts, params))
        llm.engine.shutdown()
    for one, three in zip(*runs):
        assert three.error is None and three.token_ids == one.token_ids
        assert three.cumulative_logprob == pytest.approx(one.cumulative_logprob, abs=1e-3)
    with pytest.raises(Exception, match="tensor_parallel_size 2 does not divide the model's attention heads 9"):
        LLM(str(default_model), tensor_parallel_size=2)
