"""Deterministic mode (`deterministic: true`): a request's greedy tokens and the logprobs of
every generated token (top 5) are the same bits alone, in batches with other prompts, with
prefix caching off, on and hit, in chunks of 64 and of 512 prompt tokens, and under preemption;
seeded sampling gives the same text in every mix. With the mode off the same comparisons
differ (each check seen red). What the mode cannot promise yet is refused by name."""
from __future__ import annotations

import pytest
import torch

from orca_backend import LLM, EngineConfig, SamplingParams
from orca_backend.core.errors import ConfigError

PREFIX = ("The library keeps its books on shelves by subject, and each shelf has a card that lists the "
          "titles it holds, the year each was bought and the reader who last borrowed it. ")
PROMPTS = ([PREFIX + "Who keeps the cards?", "def fibonacci(n):", "The capital of France is",
            PREFIX + "When does it open?", "Once upon a time there was a", "Water boils at",
            "In 1492, Columbus", PREFIX + "Which shelf holds poetry?"]
           + [f"Fact {i}: the number {i * 37} is" for i in range(36)]
           + [PREFIX * (2 + i % 3) + f"Question {i}: which book is oldest?" for i in range(6)])  # up to 170 tokens
OTHERS = [f"Unrelated request number {i} asks about the weather in city {i}" for i in range(78)]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)


def _outputs(llm: LLM, prompts, params=GREEDY) -> list[tuple]:
    return [(o.token_ids, o.logprobs) for o in llm.generate(prompts, [params] * len(prompts))]


def _batches(llm: LLM, prompts: list[str], size: int) -> list[tuple]:
    """`prompts` in batches of `size`, each filled up with OTHERS."""
    out = []
    for i in range(0, len(prompts), size):
        part = prompts[i:i + size]
        out += _outputs(llm, part + OTHERS[:size - len(part)])[:len(part)]
    return out


def _scenarios(model, deterministic: bool, prompts: list[str], sizes=(8, 32, 128)) -> dict[str, list[tuple]]:
    """`prompts`' outputs in each way of running them."""
    out = {}
    common = dict(kv_cache_tokens=16384, max_batch_size=128, deterministic=deterministic)
    with LLM(str(model), enable_prefix_caching=False, **common) as llm:
        out["alone"] = [_outputs(llm, [p])[0] for p in prompts]
        for size in sizes:
            out[f"batches of {size}"] = _batches(llm, prompts, size)
    with LLM(str(model), enable_prefix_caching=True, **common) as llm:  # the first alone; the rest hit PREFIX
        runs = [o for i in (0, *range(1, len(prompts), 8)) for o in llm.generate(prompts[i:i + 8 if i else 1], GREEDY)]
        out["prefix caching, hits"] = [(o.token_ids, o.logprobs) for o in runs]
        assert sum(o.num_cached_tokens > 0 for o in runs) >= len(prompts) // 8
    for chunk in (64, 512):
        with LLM(str(model), enable_prefix_caching=False, max_num_batched_tokens=chunk, **common) as llm:
            out[f"chunks of {chunk}"] = _outputs(llm, prompts + OTHERS[:8])[:len(prompts)]
    with LLM(str(model), enable_prefix_caching=False, kv_cache_tokens=256, block_size=4,
             deterministic=deterministic) as llm:
        out["preempting"] = _outputs(llm, prompts)
        out["preempting"].append(llm.engine.scheduler.num_preemptions)
    return out


@pytest.fixture(scope="module")
def runs(default_model):
    return {True: _scenarios(default_model, True, PROMPTS),
            False: _scenarios(default_model, False, PROMPTS[:8], sizes=(8,))}


def test_each_way_of_running_a_request_gives_the_same_bits(runs):
    out = runs[True]
    assert out["preempting"].pop() > 0  # the small pool did preempt
    for name, outputs in out.items():
        assert len(outputs) == len(PROMPTS), name
        for i, (alone, other) in enumerate(zip(out["alone"], outputs)):
            assert other[0] == alone[0], f"{name}: prompt {i}'s tokens differ"
            assert other[1] == alone[1], f"{name}: prompt {i}'s logprobs differ"


def test_without_the_mode_the_same_comparisons_differ(runs):
    """The comparisons above could fail: the mode off, batches and chunks change the bits."""
    out = runs[False]
    out["preempting"].pop()
    differing = [name for name, outputs in out.items() if name != "alone"
                 and any(other[1] != alone[1] for alone, other in zip(out["alone"], outputs))]
    assert {"batches of 8", "chunks of 64"} <= set(differing), differing


def test_seeded_sampling_gives_the_same_text_in_every_mix(default_model):
    seeded = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    prompts = PROMPTS[:3]
    with LLM(str(default_model), kv_cache_tokens=4096, deterministic=True) as llm:
        alone = [llm.generate([p], [s])[0].token_ids for p, s in zip(prompts, seeded)]
        mixed = llm.generate(prompts + OTHERS[:8], seeded + [SamplingParams(max_tokens=8)] * 8)
    assert [o.token_ids for o in mixed[:3]] == alone


def test_every_projection_of_the_default_model_is_row_invariant(default_model):
    """oneDNN's GEMM over packed weights, a single row beside its twin: a row's result is the
    same bits with 1, 2, 9 or 200 rows (the property the mode rests on, per shape)."""
    from orca_backend.runner.build import load_model
    from orca_backend.runner.models.linear import batch_invariant, pack_linears

    model = load_model(default_model, torch.float32, torch.device("cpu"))
    shapes = {}
    for linear in model.linears():
        shapes.setdefault(tuple(linear.weight.shape), linear)
    pack_linears(model, "onednn")
    batch_invariant(model, torch.float32)
    torch.manual_seed(0)
    for (_, in_features), linear in shapes.items():
        rows = torch.randn(200, in_features)
        alone = linear(rows[:1])[0]
        for n in (2, 9, 200):
            assert torch.equal(linear(torch.cat([rows[1:n], rows[:1]]))[n - 1], alone), (in_features, n)


def test_a_single_row_that_another_kernel_takes_runs_beside_its_twin_and_other_variance_is_refused():
    """The load-time check, over kernels that behave as some CPUs' do: one that gives a single
    row other bits (a matrix-vector kernel) gets the twin, and the row its batched bits; one
    whose rows change with the batch's size is refused, naming the shape."""
    from types import SimpleNamespace

    from orca_backend.runner.models.linear import Linear, batch_invariant

    def invariant(x):  # row by row
        return torch.stack([weight @ row for row in x])

    def single_row_differs(x):
        return invariant(x) + (1e-3 if x.shape[0] == 1 else 0.0)

    def rows_differ_past_8(x):
        return invariant(x) + (1e-3 if x.shape[0] > 8 else 0.0)

    weight = torch.randn(16, 32)
    for kernel, rows in ((single_row_differs, 2), (invariant, 1)):
        linear = Linear(weight)
        linear._run = kernel
        batch_invariant(SimpleNamespace(linears=lambda: [linear]), torch.float32)
        x = torch.randn(5, 32)
        assert linear.min_rows == rows
        assert torch.equal(linear(x[:1])[0], linear(x)[0])
    linear = Linear(weight)
    linear._run = rows_differ_past_8
    with pytest.raises(ConfigError, match=r"\[16, 32\] projection other bits in another batch"):
        batch_invariant(SimpleNamespace(linears=lambda: [linear]), torch.float32)


def test_two_tensor_parallel_ranks_keep_the_bits(tiny_vocab_llama):
    """Two ranks (each its half of the heads and of the MLP, the partial sums added in rank
    order): the first 8 prompts alone (the later ones hitting the prefix cache), in a batch
    of 32 and in chunks of 16, the same bits."""
    common = dict(tensor_parallel_size=2, deterministic=True, kv_cache_tokens=4096)
    with LLM(str(tiny_vocab_llama), **common) as llm:
        alone = [_outputs(llm, [p])[0] for p in PROMPTS[:8]]
        batch = _batches(llm, PROMPTS[:8], 32)
    with LLM(str(tiny_vocab_llama), enable_prefix_caching=False, max_num_batched_tokens=16, **common) as llm:
        chunks = _outputs(llm, PROMPTS[:8])
    assert batch == alone
    assert chunks == alone


@pytest.mark.parametrize("options, named", [
    (dict(device="cuda"), "deterministic"),
    (dict(linear="torch"), "deterministic"),
    (dict(quantization="int8"), "deterministic"),
])
def test_what_the_mode_cannot_promise_yet_is_refused_by_name(options, named):
    with pytest.raises(ConfigError, match=f"engine option '{named}'"):
        EngineConfig(deterministic=True, **options)


@pytest.mark.parametrize("checkpoint, named", [("served_moe", "mixture of experts"),
                                                ("served_compressed", "quantized checkpoint")])
def test_checkpoints_whose_kernels_vary_with_the_batch_are_refused_by_name(request, checkpoint, named):
    """A mixture's experts (torch's grouped GEMM: a row's bits change with its expert's other
    rows) and a quantized checkpoint's kernels, refused when the model is built."""
    with pytest.raises(ConfigError, match=f"deterministic true is not supported with a {named}"):
        LLM(str(request.getfixturevalue(checkpoint)), deterministic=True)


def test_the_peers_names_turn_it_on(monkeypatch):
    assert EngineConfig().runner.deterministic is False
    assert EngineConfig(enable_deterministic_inference=True).runner.deterministic is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().runner.deterministic is True
    assert EngineConfig(deterministic=False).runner.deterministic is False


@pytest.mark.server
def test_identical_concurrent_requests_through_tritonserver_get_one_answer(feature_server):
    """200 copies of one request at once (model `det`): waves of 32, each copy beside different
    others, prefilled and decoded in different mixes; one text and one set of logprobs."""
    from client.triton_client import StreamingClient
    from helpers import assert_no_leak

    sampling = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 5}
    with StreamingClient(feature_server.grpc_url, "det") as c:
        ids = [c.send(PREFIX + "Who keeps the cards?", sampling=sampling, flags={"return_logprobs": True})
               for _ in range(200)]
        results = [c.wait(i) for i in ids]
    assert [r.error for r in results] == [None] * 200
    answers = {(r.text, str([x.get("logprobs") for x in r.responses])) for r in results}
    assert len(answers) == 1
    assert_no_leak(feature_server, "det")


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (12, 12, 64), (32, 8, 128), (8, 1, 256),
                                                       (14, 2, 64), (32, 32, 80), (16, 4, 96), (4, 2, 16)])
@pytest.mark.parametrize("window, softcap, sinks", [(None, None, False), (100, 30.0, True)])
def test_attention_gives_a_row_the_same_bits_in_any_batch_or_chunking(heads, kv_heads, head_dim, window, softcap,
                                                                      sinks):
    """The attention alone, for every head layout the loaders know: request 0's 300 rows as
    one prompt, in chunks of 64 and 5 (later chunks read the earlier ones' K/V from the
    cache, as after a prefix-cache hit), decoded one by one, and beside other prompts and
    decodes; every row the same bits."""
    from orca_backend.runner.models.attention import BatchLayout, TorchPagedAttention

    torch.manual_seed(0)
    block_size, length = 16, 300
    attention = TorchPagedAttention(block_size, torch.device("cpu"), invariant=True)
    k_cache, v_cache = attention.allocate_kv_cache(1, 80, kv_heads, head_dim, torch.float32)[0]
    k_cache.normal_(), v_cache.normal_()
    q = torch.randn(length, heads, head_dim)
    sink = torch.randn(heads) if sinks else None
    others = [(0, 40, list(range(40, 43))), (500, 1, list(range(43, 43 + 32))), (90, 3, list(range(43, 50)))]

    def keys(t):  # the cache's own K/V: rewriting it changes nothing
        return k_cache.view(-1, kv_heads, head_dim)[t]

    def run(chunk: tuple[int, int], beside=()) -> torch.Tensor:
        start, count = chunk
        layout = BatchLayout([start] + [o[0] for o in beside], [count] + [o[1] for o in beside],
                             [list(range(20))] + [o[2] for o in beside])
        meta = attention.plan(layout)
        slots = meta.slot_mapping
        rows = torch.cat([q[start:start + count]] + [torch.randn(o[1], heads, head_dim) for o in beside])
        out = meta.attend(rows, keys(slots), v_cache.view(-1, kv_heads, head_dim)[slots], (k_cache, v_cache),
                          head_dim ** -0.5, window, softcap, sink)
        return out[:count]

    whole = run((0, length))
    for size in (64, 5):
        chunks = torch.cat([run((s, min(size, length - s))) for s in range(0, length, size)])
        assert torch.equal(chunks, whole), size
    for at in (0, 1, 7, 150, 299):
        assert torch.equal(run((at, 1)), whole[at:at + 1]), at
        assert torch.equal(run((at, 1), others), whole[at:at + 1]), at
    assert torch.equal(run((0, length), others), whole)


def test_the_attention_products_give_a_query_row_the_same_bits_with_any_number_of_rows():
    """The two products the attention rests on, as it runs them: keys [L, D] (read where they
    lie, among other K/V heads) x q^T [D, M], and weights [M, 64] x values [64, Dv] (where they
    lie); a query row's bits the same with 4 to 1024 rows in batches of 2 to 9. The natural
    order, q x keys^T with the keys read transposed, fails this on AVX-512 CPUs for head sizes
    of 96 and more (a decode's 4 rows take another MKL kernel)."""
    torch.manual_seed(0)
    for d in (16, 64, 96, 128, 256):
        keys, values = torch.randn(9, 320, 2, d)[:, :, 1], torch.randn(9, 64, 2, d)[:, :, 1]
        q, weights = torch.randn(9, d, 1024), torch.randn(9, 1024, 64)
        scores, out = torch.bmm(keys[:2], q[:2, :, :4].contiguous())[0], torch.bmm(weights[:2, :4], values[:2])[0]
        for batch, rows in ((2, 5), (2, 8), (3, 12), (9, 64), (4, 1024)):
            assert torch.equal(torch.bmm(keys[:batch], q[:batch, :, :rows].contiguous())[0, :, :4], scores), (d, rows)
            assert torch.equal(torch.bmm(weights[:batch, :rows], values[:batch])[0, :4], out), (d, rows)


@pytest.mark.server
def test_streamed_and_unstreamed_logprobs_are_the_same_bits_through_the_openai_api(feature_server, tmp_path):
    """Triton's own OpenAI client test: one request unstreamed, then streamed (a prefix-cache
    hit: its last prompt token runs alone; three other requests decoding beside it), the top
    logprobs compared exactly; in chat and completions."""
    import openai
    from benchmarks.servers import Frontend
    from helpers import serving

    chat = dict(model="det", messages=[{"role": "user", "content": PREFIX + "Who keeps the cards?"}], max_tokens=8,
                temperature=0, seed=0, logprobs=True, top_logprobs=5)
    legacy = dict(model="det", prompt=PREFIX + "When does it open?", max_tokens=8, temperature=0, seed=0, logprobs=5)
    with serving(Frontend(tmp_path, feature_server.grpc_url, args=["--model", "det"])) as frontend:
        api = openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        whole = api.chat.completions.create(**chat)
        others = [api.completions.create(model="det", prompt=p, max_tokens=64, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}) for p in OTHERS[:3]]
        for other in others:  # each decoding beside the streamed one
            next(iter(other))
        chunks = list(api.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
        for other in others:
            list(other)
        streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the second one hit the cache
        assert [t.model_dump() for t in streamed] == [t.model_dump() for t in whole.choices[0].logprobs.content]
        text = api.completions.create(**legacy).choices[0].logprobs
        parts = [c.choices[0].logprobs for c in api.completions.create(**legacy, stream=True)
                 if c.choices and c.choices[0].logprobs]
        assert [t for p in parts for t in p.top_logprobs] == text.top_logprobs
        assert [t for p in parts for t in p.token_logprobs] == text.token_logprobs
