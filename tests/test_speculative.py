"""Speculative decoding with n-gram proposals and with a draft model: the proposers and their
configuration; the rejection sampler's output distribution against the target's; and through
the engine, greedy output token for token the output without speculation, with every stop, EOS
and max_tokens alignment inside accepted runs, preemption, prefix caching, seeded sampling, the
process and pipeline executors and two tensor-parallel ranks. A model drafting for itself
accepts every proposal, whatever the model: those tests run tiny random Llamas of the default
model's vocabulary (`looping_llama`; `tiny_vocab_llama` over two ranks), and so do the n-gram
tests that need some proposals accepted somewhere in 40 tokens (the looping Llama's greedy text
falls into loops that n-grams catch). Two tests run the default model, as they need text that
repeats the prompt from the first tokens on, which a random model does not write: the ends at
each of the first 8 tokens under n-grams (inside accepted runs), and sampling with n-grams
(sampled text that repeats the prompt). The refusals of unfit draft models name the default
model's configuration without loading its weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import ALL_PROJECTIONS, LORA_MAX_TOKENS, LORA_PROMPTS, make_lora_adapters, save_tiny_vocab_llama
from orca_backend.core.errors import ConfigError
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.core.speculative import SpeculativeConfig
from orca_backend.runner.proposers import NgramProposer, ProposalAsk
from orca_backend.engine.llm import LLM

# Prompts whose continuations repeat what they hold (the default model's: proposals get accepted)
# and one that does not.
PROMPTS = ["Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
           "Repeat: apple, banana,",
           "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
           "The capital of France is"]
SPEC = {"num_speculative_tokens": 4, "max_batch_size": 64}
# 24 blocks of 4 tokens, fewer than PROMPTS hold by their 40th output token (44): some are preempted.
PREEMPTING = dict(kv_cache_tokens=96, block_size=4, max_num_batched_tokens=64)


def test_the_proposer_looks_up_the_longest_recent_ngram():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3))
    assert p.lookup("r", [1, 2, 3, 4, 5, 9, 1, 2, 3], 5) == [4, 5, 9]  # the 3-gram 1 2 3
    assert p.lookup("r", [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 2, 3], 5) == [7, 2, 3]  # 2 3: its latest earlier place
    assert p.lookup("r", [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 2, 3], 1) == [7]  # the limit
    assert p.lookup("x", [5, 6, 7, 8], 5) == []  # nothing repeats
    assert p.lookup("y", [9, 9], 5) == []  # a 1-gram is below prompt_lookup_min
    # token ids whose bytes line up across tokens are never a match in between
    assert p.lookup("z", [256, 1, 2, 0, 1, 2], 5) == [0, 1, 2]
    assert p.lookup("w", [1, 256, 1, 1], 3) == []


@pytest.mark.parametrize("value, words", [
    ({"method": "eagle"}, "'method' must be one of ngram"),
    ({"num_speculative_tokens": 0}, "'num_speculative_tokens' must be an integer >= 1"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "'prompt_lookup_min' \\(5\\) must be <="),
    ({"draft": 1}, "unknown key 'draft'"),
    ("{not json", "not valid JSON"),
    ("[1]", "must be a JSON object"),
])
def test_a_bad_speculative_config_is_refused_by_name(value, words):
    with pytest.raises(ConfigError, match=words):
        SpeculativeConfig.parse(value)


@pytest.mark.parametrize("min_p", [0.0, 0.2])
def test_rejection_sampling_keeps_the_target_distribution(min_p):
    """A 6-token vocabulary, two proposals (one likely, one not), 20,000 draws with a fixed
    seed: the first two tokens emitted are distributed as the target's rows (independent
    here), total variation below 0.015; every proposal accepted at its probability. min_p cuts
    the rows short of 1: the target is what is left, scaled back up."""
    from orca_backend.runner.sampler import Sampler
    from orca_backend.runner.state import RunnerRequest

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 1.5, -0.5, 2.2, 0.0, 0.0],
                           [0.0, 0.0, 3.0, 0.0, 1.0, 0.0]])
    drafts = [0, 4]
    params = SamplingParams(temperature=0.8, top_k=5, min_p=min_p)
    state = RunnerRequest("r", 1, [1], params, False)
    state.generator = torch.Generator().manual_seed(1234)
    sampler = Sampler(torch.device("cpu"), 0, [])
    target = sampler._probs(logits, [state] * 3)
    target = target / target.sum(-1, keepdim=True)
    first, second = [0] * 6, [0] * 6  # counted in Python: a tensor's += costs as much as a draw
    accepted_first = 0
    n = 20_000
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # rows of 6: a second thread only adds its wake-ups (same draws)
    try:
        with torch.inference_mode():  # as the runner calls it
            for _ in range(n):
                accepted, token = sampler.verify(logits, state, drafts)
                first[drafts[0] if accepted >= 1 else token] += 1
                if accepted >= 1:  # the second token: the second proposal, or the draw that replaced it
                    accepted_first += 1
                    second[drafts[1] if accepted == 2 else token] += 1
    finally:
        torch.set_num_threads(threads)
    first_counts, second_counts = torch.tensor(first, dtype=torch.float), torch.tensor(second, dtype=torch.float)
    # the first token is distributed as the first row; the second (after the first proposal) as the second row
    assert (first_counts / n - target[0]).abs().sum() / 2 < 0.015
    assert (second_counts / second_counts.sum() - target[1]).abs().sum() / 2 < 0.015
    assert abs(accepted_first / n - target[0, drafts[0]].item()) < 0.01


@pytest.fixture(scope="module")
def looping_llama(tmp_path_factory, default_model) -> Path:
    """A tiny random Llama with the default model's vocabulary and tokenizer, its weights drawn
    small (initializer range 0.05, where `tiny_vocab_llama`'s are 0.2): its greedy text falls into
    loops that n-grams catch (for PROMPTS' first two, some proposals accepted by their 40th token,
    some rejected). Its EOS is also the token it writes last for the third prompt, of the 32 it
    writes there greedily, that it has not written before: a request of that prompt ends by EOS."""
    folder = save_tiny_vocab_llama(tmp_path_factory.mktemp("looping_llama"), default_model, 0.05)
    with LLM(str(folder), kv_cache_tokens=512) as llm:
        out, = llm.generate(PROMPTS[2], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    tokens = out.token_ids
    last_new = max(i for i, t in enumerate(tokens) if t not in tokens[:i])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, tokens[last_new]]}))
    return folder


def outputs_of(llm: LLM):
    """`llm.generate` for greedy requests, each prompt's output with given parameters computed
    once in the module (it does not change): several tests compare the same requests with their
    output without speculation."""
    outputs = {}

    def generate(prompts: str | list[str], params: SamplingParams) -> list:
        prompts = [prompts] if isinstance(prompts, str) else prompts
        assert params.greedy
        new = list(dict.fromkeys(p for p in prompts if (p, repr(params)) not in outputs))
        for prompt, out in zip(new, llm.generate(new, params) if new else []):
            outputs[(prompt, repr(params))] = out
        return [outputs[(p, repr(params))] for p in prompts]
    return generate


@pytest.fixture(scope="module")
def reference(default_model):
    with LLM(str(default_model), kv_cache_tokens=4096) as llm:
        yield llm


@pytest.fixture(scope="module")
def speculating(default_model):
    with LLM(str(default_model), kv_cache_tokens=4096, speculative_config=SPEC) as llm:
        yield llm


@pytest.fixture(scope="module")
def looping_reference(looping_llama):
    with LLM(str(looping_llama), kv_cache_tokens=4096) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain(looping_reference):
    """`outputs_of(looping_reference)`: the looping Llama's greedy outputs without speculation."""
    return outputs_of(looping_reference)


@pytest.fixture(scope="module")
def looping(looping_llama):
    """The looping Llama with n-gram proposals."""
    with LLM(str(looping_llama), kv_cache_tokens=4096, speculative_config=SPEC) as llm:
        yield llm


def self_draft(model) -> dict:
    return {"method": "draft_model", "model": str(model), **SPEC}


@pytest.fixture(scope="module")
def drafting(looping_llama):
    """The looping Llama proposing for itself: every proposal is its own greedy choice."""
    with LLM(str(looping_llama), kv_cache_tokens=4096, speculative_config=self_draft(looping_llama)) as llm:
        yield llm


def same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert (x.token_ids, x.text, x.finish_reason, x.error) == (y.token_ids, y.text, y.finish_reason, y.error)


def ends(reference: LLM):
    """Each prompt ending by max_tokens, a stop token and a stop string at each of its first 8
    tokens (3 x 25 requests), and by EOS or at 32 tokens: the requests and `reference`'s outputs
    (without speculation). With 4 proposals a step, 8 tokens are the prefill's, one whole accepted
    run and the start of the next: every place in a run an end can fall. The stops may run to 12
    tokens, so proposals are not cut to the room left."""
    base = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    full = [o.token_ids for o in reference.generate(PROMPTS, base)]
    text = reference.engine.rules.tokenizer.decode
    prompts, params = [], []
    for prompt, tokens in zip(PROMPTS, full):
        for j in range(1, 9):
            prompts += [prompt] * 3
            params += [SamplingParams(max_tokens=j, temperature=0, ignore_eos=True),
                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[tokens[j - 1]]),
                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                      stop=[text(tokens[j - 1:j]).strip() or "\n"])]
        prompts.append(prompt)
        params.append(SamplingParams(max_tokens=32, temperature=0))  # EOS where the model says so
    outputs = reference.generate(prompts, params)
    assert outputs[-1].finish_reason == "stop"  # an EOS end is among them
    return prompts, params, outputs


@pytest.fixture(scope="module")
def every_end(reference):
    """`ends` of the default model: its EOS is the third prompt's 30th token, the others end at
    32 by length. Under n-grams, the first prompt's third step has 2 of 4 accepted and ends
    inside them."""
    return ends(reference)


@pytest.fixture(scope="module")
def looping_ends(looping_reference):
    """`ends` of the looping Llama (its EOS: in the third prompt's output, by construction)."""
    return ends(looping_reference)


@pytest.mark.parametrize("proposer, requests", [("speculating", "every_end"), ("drafting", "looping_ends")],
                         ids=["ngram", "draft_model"])
def test_greedy_output_is_the_output_without_speculation_at_every_end(request, proposer, requests):
    """Every request of `ends` in one generate call, speculating (the prompts' full blocks in
    the prefix cache first, as they are in the reference's): every output, text and finish
    reason equal to the engine's without speculation; proposals were accepted (every one, when
    the model drafts for itself; under n-grams some were rejected). N-grams on the default
    model: its text repeats the first prompt's from the first tokens on, so that the ends fall
    in accepted runs; the looping Llama drafts for itself."""
    speculating = request.getfixturevalue(proposer)
    prompts, params, expected = request.getfixturevalue(requests)
    speculating.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0))  # hits for the 78 prompts below
    before = speculating.engine.stats.speculation.copy()
    same(expected, speculating.generate(prompts, params))
    stats = speculating.engine.stats.speculation
    drafted, accepted = (stats.num_draft_tokens - before.num_draft_tokens,
                         stats.num_accepted_tokens - before.num_accepted_tokens)
    assert accepted > 0
    if proposer == "drafting":
        assert accepted == drafted
    else:  # and some rejected
        assert accepted < drafted
    assert speculating.engine.kv.num_used_blocks == 0


# 40 greedy tokens of PROMPTS: the looping Llama's text has looped (n-gram proposals accepted)
# in the first two by then.
LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("options", [dict(executor="process"), dict(executor="pipeline", pipeline_stages=2),
                                     PREEMPTING], ids=["process", "pipeline", "preempting"])
def test_greedy_output_is_the_same_through_other_executors_and_preemption(looping_llama, plain, options):
    prompts = PROMPTS if options is PREEMPTING else PROMPTS * 2
    with LLM(str(looping_llama), speculative_config=SPEC, **{"kv_cache_tokens": 4096, **options}) as llm:
        outs = llm.generate(prompts, LONG)
        stats = llm.engine.stats.speculation
        preemptions = llm.engine.scheduler.num_preemptions
    same(plain(prompts, LONG), outs)
    assert stats.num_accepted_tokens > 0
    if options is PREEMPTING:
        assert preemptions > 0


@pytest.mark.parametrize("proposer", ["looping", "drafting"], ids=["ngram", "draft_model"])
def test_prefix_caching_names_only_accepted_tokens(request, proposer, plain):
    """A request whose prompt is an earlier request's prompt and output hits the cache, and
    its output is right: the cached blocks hold accepted tokens' K/V only (a draft model
    computes its own K/V of the cached tokens, and still proposes right). The earlier request
    had proposals accepted (and under n-grams, rejected)."""
    speculating = request.getfixturevalue(proposer)
    before = speculating.engine.stats.speculation.copy()
    first, = speculating.generate(PROMPTS[0], LONG)
    stats = speculating.engine.stats.speculation
    assert 0 < stats.num_accepted_tokens - before.num_accepted_tokens
    if proposer == "looping":
        assert stats.num_accepted_tokens - before.num_accepted_tokens < stats.num_draft_tokens - before.num_draft_tokens
    follow = PROMPTS[0] + first.text + " Again:"
    again, = speculating.generate(follow, LONG)
    assert again.num_cached_tokens >= 32
    same(plain(follow, LONG), [again])


class _Watching:
    """A proposer's calls, recorded: (request id, tokens so far, the most it may propose)."""

    def __init__(self, proposer) -> None:
        self.proposer, self.calls = proposer, []

    reads_block_tables = False

    def propose(self, asks: list[ProposalAsk]) -> list[list[int]]:
        self.calls += [(a.request_id, len(a.token_ids), a.limit) for a in asks]
        return self.proposer.propose(asks)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)


def test_sampling_with_speculation_ends_right_and_seeded_requests_do_not_speculate(speculating, reference,
                                                                                   monkeypatch):
    """Unseeded sampled requests speculate, never asked for proposals past max_tokens (the
    runner adds a token of its own), and end at max_tokens; a seeded one decodes one token at a
    time, so its output is the same with speculation on, whatever the load."""
    before = speculating.engine.stats.speculation.num_drafts
    runner = speculating.engine.executor.runner
    watching = _Watching(runner.proposer)
    monkeypatch.setattr(runner.requests, "proposer", watching)
    free = speculating.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=0.7, ignore_eos=True))
    assert [len(o.token_ids) for o in free] == [12, 12] and speculating.engine.stats.speculation.num_drafts > before
    prompt = {o.request_id: len(o.prompt_token_ids) for o in free}
    assert watching.calls and all(n - prompt[rid] + limit <= 11 for rid, n, limit in watching.calls)
    seeded = [SamplingParams(max_tokens=12, temperature=0.7, seed=s) for s in (1, 2)]
    same(reference.generate(PROMPTS[:2], seeded), speculating.generate(PROMPTS[:2], seeded))


class _Oracle:
    """Proposes the tokens a reference run produced next, the last of them wrong every other
    step: proposals accepted, and rejected, whatever the model."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences, self.calls = sequences, 0

    reads_block_tables = False

    def propose(self, asks: list[ProposalAsk]) -> list[list[int]]:
        return [self._one(a.token_ids, a.limit) for a in asks]

    def _one(self, tokens: list[int], limit: int) -> list[int]:
        self.calls += 1
        for seq in self.sequences:
            if seq[:len(tokens)] == tokens:
                drafts = seq[len(tokens):len(tokens) + min(limit, 3)]
                if drafts and self.calls % 2:
                    drafts[-1] = (drafts[-1] + 1) % 512
                return drafts
        return []

    def forget(self, request_id: str) -> None:
        pass


@pytest.fixture(scope="module")
def one_rank(tiny_vocab_llama):
    """Two prompts, 16 greedy tokens each, of the tiny Llama on one rank without speculation:
    what the tests over two ranks must write."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [PROMPTS[2], PROMPTS[0]]
    with LLM(str(tiny_vocab_llama), kv_cache_tokens=512) as llm:
        return prompts, params, llm.generate(prompts, params)


def test_a_draft_model_over_two_tensor_parallel_ranks(tiny_vocab_llama, one_rank):
    """Rank 0 runs the draft model (whole) and its proposals reach the other rank with the
    message: the tiny Llama drafting for itself, split over two ranks, equal to one rank
    without speculation, every proposal accepted."""
    prompts, params, want = one_rank
    with LLM(str(tiny_vocab_llama), kv_cache_tokens=512, tensor_parallel_size=2,
             speculative_config=self_draft(tiny_vocab_llama)) as llm:
        got = llm.generate(prompts, params)
        stats = llm.engine.stats.speculation
    same(want, got)
    assert 0 < stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize("options, words", [
    (dict(speculative_config={"method": "draft_model"}), "'draft_model' needs 'model'"),
    (dict(speculative_config={"model": "x"}), "method 'ngram' uses no model"),
    (dict(executor="pipeline", pipeline_stages=2), "method 'ngram' with engine 'null' or executor 'pipeline'"),
    (dict(draft="tiny"), "a vocabulary of 512 tokens, the model 49152"),
    (dict(draft="tiny_vocab"), "takes 512 positions, fewer than the model's max_model_len 8192"),
])
def test_an_unfit_draft_model_is_refused_by_name(default_model, tiny_models, tiny_vocab_llama, options, words):
    drafts = {"tiny": tiny_models["llama"], "tiny_vocab": tiny_vocab_llama, None: default_model}
    draft = drafts[options.pop("draft", None)]
    options.setdefault("speculative_config", self_draft(draft))
    with pytest.raises(ConfigError, match=words):
        LLM(str(default_model), kv_cache_tokens=512, **options)


def test_speculation_over_two_tensor_parallel_ranks(tiny_vocab_llama, one_rank):
    """The proposals reach every rank with the message; rank 0 checks them. A tiny Llama that
    two ranks split (its random output never repeats, so an oracle proposes): greedy tokens
    equal one rank without speculation, some proposals accepted and some rejected."""
    prompts, params, want = one_rank
    sequences = [o.prompt_token_ids + o.token_ids for o in want]
    with LLM(str(tiny_vocab_llama), kv_cache_tokens=512, tensor_parallel_size=2, speculative_config={}) as llm:
        llm.engine.executor.runner.requests.proposer = _Oracle(sequences)
        got = llm.generate(prompts, params)
        stats = llm.engine.stats.speculation
    same(want, got)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("options", [dict(executor="process"), PREEMPTING], ids=["process", "preempting"])
def test_a_draft_model_in_a_child_process_and_under_preemption(looping_llama, plain, options):
    """The model drafting for itself in the process executor's child, and with a pool so small
    that requests are preempted (the draft's K/V is recomputed on resume): output equal to the
    engine's without speculation, every proposal accepted."""
    prompts = PROMPTS if options is PREEMPTING else PROMPTS * 2
    with LLM(str(looping_llama), speculative_config=self_draft(looping_llama),
             **{"kv_cache_tokens": 4096, **options}) as llm:
        outs = llm.generate(prompts, LONG)
        stats = llm.engine.stats.speculation
        preemptions = llm.engine.scheduler.num_preemptions
    same(plain(prompts, LONG), outs)
    assert 0 < stats.num_accepted_tokens == stats.num_draft_tokens
    if options is PREEMPTING:
        assert preemptions > 0


@pytest.fixture(scope="module")
def looping_adapters(looping_llama, tmp_path_factory):
    """LoRA adapters of the looping Llama, as `lora_adapters`' b and c: "b" rank 16 on every
    projection, "c" rank 8 on o, gate and down with rsLoRA (see make_lora_adapters); scaled down
    (alpha 1 and 0.5, where `lora_adapters`' are 16 and 8) so that they move the model's choices
    without overturning them all: the base model's proposals for them are accepted in part."""
    return make_lora_adapters(looping_llama, tmp_path_factory.mktemp("looping_lora"), {
        "b": dict(r=16, lora_alpha=1, target_modules=ALL_PROJECTIONS),
        "c": dict(r=8, lora_alpha=0.5, use_rslora=True, target_modules=["o_proj", "gate_proj", "down_proj"])})


def test_a_draft_model_for_an_adapter_is_checked_row_by_row(looping_llama, looping_adapters):
    """The base model drafting for LoRA adapters (b on every projection, c on o, gate and
    down), in one batch with base-model requests: the adapters' requests accept some proposals
    and reject others (so the draft's K/V is kept for accepted ones and written over after),
    the base model's accept all; greedy tokens equal to PEFT's merged model's
    (`looping_adapters.greedy`, what the engine without speculation writes: test_lora_engine.py),
    text and finish reason those of the tokens."""
    from orca_backend.lora import LoRARequest

    params = SamplingParams(max_tokens=LORA_MAX_TOKENS, temperature=0, ignore_eos=True)
    names = ["b", "b", "c", "c", None, None]
    prompts = list(LORA_PROMPTS) * 3
    loras = [None if n is None else LoRARequest(n, 0, str(looping_adapters.paths[n])) for n in names]
    with LLM(str(looping_llama), speculative_config=self_draft(looping_llama), kv_cache_tokens=4096,
             enable_lora=True, max_loras=2) as llm:
        got = llm.generate(prompts, params, lora_request=loras)
        stats = llm.engine.stats.speculation
        decode = llm.engine.rules.tokenizer.decode
    assert [o.token_ids for o in got] == [looping_adapters.greedy[(n, p)] for n, p in zip(names, prompts)]
    assert [(o.text, o.finish_reason, o.error) for o in got] == [(decode(o.token_ids), "length", None) for o in got]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_failing_draft_model_costs_its_proposals_only(drafting, plain):
    """The draft model raises every other call: those rows are checked with stand-in
    proposals, the iteration goes on, and the output is the output without speculation."""
    drafter = drafting.engine.executor.runner.proposer
    propose, calls = drafter.propose, []

    def flaky(items):
        calls.append(len(items))
        if len(calls) % 2:
            raise RuntimeError("the draft model failed (test)")
        return propose(items)

    drafter.propose = flaky
    try:
        got = drafting.generate(PROMPTS, LONG)  # `plain` has its output
    finally:
        del drafter.propose
    same(plain(PROMPTS, LONG), got)
    assert len(calls) >= 4 and drafting.engine.kv.num_used_blocks == 0


def test_the_draft_model_reuses_exactly_the_kv_of_accepted_proposals(tiny_vocab_llama):
    """Called again after the target accepted 0..k of its proposals (and added its own token),
    the draft proposes what a fresh draft computing the whole history proposes: it kept the K/V
    of the accepted proposals and wrote over the rest. It catches up on a history longer than
    its chunk (here 4 tokens) in chunks, with the same proposals."""
    from orca_backend.runner.drafter import DraftModel
    from orca_backend.runner.models import load_model
    from orca_backend.runner.models.attention import TorchPagedAttention

    model = load_model(tiny_vocab_llama, torch.float32, torch.device("cpu"))

    def fresh(max_chunk: int = 512) -> DraftModel:
        return DraftModel(model, 64, torch.device("cpu"), torch.float32, TorchPagedAttention(4, torch.device("cpu")),
                          max_chunk)

    blocks = list(range(40))
    draft = fresh(max_chunk=4)
    hidden, rows = draft._hidden, []
    draft._hidden = lambda layout, ids: rows.append(max(layout.num_scheduled_tokens)) or hidden(layout, ids)
    tokens = [5, 17, 300, 9, 42, 7, 11, 12, 13, 14, 15]
    for step, accept in enumerate([4, 0, 2, 3, 1, 0, 4]):
        drafts, = draft.propose([ProposalAsk("r", tokens, blocks, 4)])
        want, = fresh().propose([ProposalAsk("r", tokens, blocks, 4)])
        assert drafts == want, f"step {step}"
        tokens = tokens + drafts[:accept] + [1000 + step]  # the target's own token after those accepted
    # all 4 accepted last: the first 3 proposals' K/V kept (the 4th was never an input)
    assert draft._valid("r", tokens) == len(tokens) - 2
    assert rows[0] == 4 and max(rows) <= 4  # the 11-token history in chunks of 4
