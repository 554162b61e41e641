"""The batched logits processors against a row-by-row reference of the same rules, over
iterations in which outputs grow, rows change order and requests leave and join (slots
reused); and the output heads each alone, on hand-made logits."""
from __future__ import annotations

import random

import torch

from orca_backend.core.messages import NewRequest, RunnerOutput
from orca_backend.core.sampling_params import SamplingParams
from orca_backend.runner.grammar_masks import GrammarMasks
from orca_backend.runner.heads import PoolHead, RowsOffered, SampleHead, ScoreHead, VerifyHead
from orca_backend.runner.logits_processors import LogitsProcessors
from orca_backend.runner.sampler import Sampler
from orca_backend.runner.state import RunnerRequest

VOCAB, EOS = 64, [0, 1]
CPU = torch.device("cpu")


def _reference(logits: torch.Tensor, states: list[RunnerRequest]) -> torch.Tensor:
    """The rules applied row by row, each from the request's whole history."""
    logits = logits.clone()
    for i, state in enumerate(states):
        p, row = state.params, logits[i]
        if p.allowed_token_ids is not None:
            kept = row[p.allowed_token_ids].clone()
            row[:] = float("-inf")
            row[p.allowed_token_ids] = kept
        for token, bias in (p.logit_bias or {}).items():
            row[token] += bias
        seen = torch.tensor(sorted(set(state.token_ids)))
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        counts = torch.bincount(torch.tensor(state.output_token_ids, dtype=torch.long), minlength=VOCAB).float()
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        output = state.output_token_ids
        for word in p.bad_words_token_ids:
            if len(word) == 1 or (len(output) >= len(word) - 1 and output[len(output) - len(word) + 1:] == word[:-1]):
                row[word[-1]] = float("-inf")
        if state.num_output_tokens < p.min_tokens:
            row[p.stop_token_ids + ([] if p.ignore_eos else EOS)] = float("-inf")
    return logits


def _random_request(rng: random.Random, n: int) -> RunnerRequest:
    rules = dict(repetition_penalty=rng.choice([1.0, 1.3]), frequency_penalty=rng.choice([0.0, 0.5]),
                 presence_penalty=rng.choice([0.0, 0.7]), min_tokens=rng.choice([0, 3]),
                 stop_token_ids=rng.choice([[], [5]]), ignore_eos=rng.random() < 0.3,
                 logit_bias=rng.choice([None, {3: 2.0, 9: -1.5}]),
                 allowed_token_ids=rng.choice([None, None, [2, 4, 8, 16, 32, 33]]),
                 bad_words_token_ids=rng.choice([[], [[7]], [[10, 11], [12]]]))
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    return RunnerRequest.new(NewRequest(f"r{n}", prompt, SamplingParams(max_tokens=50, **rules), False), CPU)


def test_processors_equal_the_row_by_row_rules_as_outputs_grow_and_requests_come_and_go():
    rng = random.Random(0)
    processors = LogitsProcessors(CPU, EOS)
    live = [_random_request(rng, n) for n in range(12)]
    for state in live:
        processors.add(state)
    made = len(live)
    for step in range(30):
        if step % 4 == 3:  # some leave, others join (taking the slots of those that left)
            for state in live[:3]:
                processors.remove(state)
            live = live[3:] + [_random_request(rng, made + k) for k in range(3)]
            for state in live[-3:]:
                processors.add(state)
            made += 3
        batch = rng.sample(live, rng.randrange(1, len(live) + 1))  # rows in any order, some absent
        logits = torch.randn(len(batch), VOCAB)
        want = _reference(logits, batch)
        processors.apply(logits, batch)
        assert torch.equal(logits.isinf(), want.isinf()), f"step {step}"
        torch.testing.assert_close(logits[~want.isinf()], want[~want.isinf()], msg=f"step {step}")
        for state in batch:  # a token fed back, sometimes one of the bad words' first tokens
            state.token_ids.append(rng.choice([10, 11, rng.randrange(VOCAB)]))


def _state(request_id: str, prompt: list[int], **params) -> RunnerRequest:
    p = SamplingParams(**params)
    return RunnerRequest.new(NewRequest(request_id, prompt, p, p.logprobs is not None), CPU)


def _offer(state: RunnerRequest, first: int, own: int, computed: int, samples: bool = True, proposals=()):
    return RowsOffered(state, first, own, list(proposals), computed, samples)


def test_each_head_alone_on_hand_made_rows():
    sampler = Sampler(CPU, 0, EOS)
    greedy = _state("g", [2, 3], temperature=0)
    sampler.add(greedy)
    sample = SampleHead(sampler, GrammarMasks(VOCAB))
    sample.begin()
    sample.take(_offer(greedy, 0, 2, 0))  # a 2-token prompt: its last row samples
    sample.start()
    assert sample.rows == [1]
    out = RunnerOutput(0)
    sample.emit(torch.eye(VOCAB)[[9]], out)
    assert out.sampled["g"].token_id == 9

    verify = VerifyHead(sampler)
    verify.begin()
    verify.take(_offer(greedy, 4, 1, 10, proposals=[9, 5]))
    assert verify.rows == [4, 5, 6]
    out = RunnerOutput(0)
    verify.emit(torch.eye(VOCAB)[[9, 7, 8]], out)  # the first proposal holds, the second not
    assert out.accepted_token_ids["g"] == [9] and out.sampled["g"].token_id == 7 and out.num_proposed["g"] == 2

    scored = _state("s", [4, 5, 6], prompt_logprobs=1)
    score = ScoreHead()
    score.begin()
    score.take(_offer(scored, 0, 3, 0))
    assert score.rows == [0, 1]  # the last prompt row samples instead
    out = RunnerOutput(0)
    score.emit(torch.eye(VOCAB)[[5, 0]] * 10, out)
    position, entries = out.prompt_logprobs["s"]
    assert position == 1 and [e[0] for e in entries] == [5, 6] and entries[0][2] == 1 and entries[1][2] > 1

    embed = _state("e", [1, 2, 3, 4], embed=True)
    pool = PoolHead("mean")
    for first, computed, samples, rows in ((0, 0, False, [[1.0, 0.0], [3.0, 0.0]]), (2, 2, True, [[0.0, 4.0]] * 2)):
        pool.begin()
        pool.take(_offer(embed, first, 2, computed, samples))
        out = RunnerOutput(0)
        pool.emit(torch.tensor(rows), out)
    assert torch.frombuffer(bytearray(out.embeddings["e"]), dtype=torch.float32).tolist() == [1.0, 2.0]


def test_a_rule_beyond_the_vocabulary_fails_its_request_alone_and_a_bad_word_beyond_it_is_dropped():
    sampler = Sampler(CPU, 0, EOS, VOCAB)
    bad = _state("bad", [2], temperature=0, logit_bias={VOCAB + 1: 5.0})
    word = _state("word", [2], temperature=0, presence_penalty=0.5, bad_words_token_ids=[[VOCAB + 5], [3, VOCAB]])
    plain = _state("plain", [2], temperature=0, presence_penalty=0.5)
    for state in (bad, word, plain):
        sampler.add(state)
    out = sampler(torch.eye(VOCAB)[[3, 4, 5]] * 5, [bad, word, plain])
    assert "logit_bias holds a token id outside the model's 64 tokens" in out.errors[0]
    assert out.errors[1:] == [None, None] and out.token_ids[1:] == [4, 5]


def test_a_processor_that_fails_fails_only_the_rows_with_rules(monkeypatch):
    from orca_backend.runner import logits_processors

    def broken(self, logits, states):
        raise RuntimeError("injected")

    monkeypatch.setattr(logits_processors.TokenBans, "apply", broken)
    sampler = Sampler(CPU, 0, EOS, VOCAB)
    ruled, plain = _state("ruled", [2], temperature=0, min_tokens=2, max_tokens=4), _state("plain", [2], temperature=0)
    for state in (ruled, plain):
        sampler.add(state)
    out = sampler(torch.eye(VOCAB)[[3, 4]] * 5, [ruled, plain])
    assert "injected" in out.errors[0] and out.errors[1] is None and out.token_ids[1] == 4
