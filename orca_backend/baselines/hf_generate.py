"""Request-level batching as Triton users deploy it today, kept honest: the baseline.

Triton's dynamic batcher forms a batch; `generate` of `transformers` runs it, left-padded,
until its last request is done; every request is answered when the batch ends. Requests that
finish early keep being computed (their rows are padding until the batch ends), and requests
that arrive meanwhile wait for the next batch. That is the cost ORCA removes, and nothing else
is added: the same weights, dtype, tokenizer, request checks and finish rule as `orca`
(`RequestRules`), so greedy outputs are the same tokens.

What `generate` cannot do per request in one batch is refused with a clear error: streaming,
log-probabilities, `min_tokens`, `seed`, presence and frequency penalties. Requests of one batch
with different sampling settings (temperature, top_k, top_p, min_p, repetition_penalty) run
as separate `generate` calls, one after the other.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch
import transformers

from ..core.config import EngineConfig
from ..core.errors import InvalidRequestError
from ..core.request import RequestStatus
from ..core.sampling_params import SamplingParams
from ..engine.detokenizer import IncrementalDetokenizer
from ..engine.request_rules import RequestRules
from ..serving.inputs import GenerateRequest

# Sampling parameters that one generate call cannot honour per request: their defaults only.
UNSUPPORTED_PARAMETERS = {"min_tokens": 0, "seed": None, "presence_penalty": 0.0,
                          "frequency_penalty": 0.0, "logprobs": None, "structured_outputs": None,
                          "prompt_logprobs": None, "logit_bias": None, "allowed_token_ids": None, "bad_words": [],
                          "priority": 0}
UNSUPPORTED_FLAGS = ("return_cumulative_logprob", "return_logprobs", "return_prompt_logprobs", "return_perf_metrics")


@dataclass(slots=True)
class Finished:
    """One request's answer."""

    text: str  # the generated text (without the prompt)
    finish_reason: str  # "stop" or "length"
    num_prompt_tokens: int
    token_ids: list[int]


@dataclass(slots=True)
class BatchRecord:
    """What one batch cost: one JSON line of the model's trace per execute()."""

    batch_size: int
    num_generate_calls: int  # one per distinct sampling setting in the batch
    num_prompt_tokens: int  # the prompts' real tokens
    num_padded_prompt_tokens: int  # left padding computed in prefill
    num_steps: int  # generate steps, summed over the calls
    num_output_tokens: int  # the tokens answered
    num_computed_output_tokens: int  # rows x steps: also the rows already done
    seconds: float
    prefill_seconds: float  # up to the first token of each call, summed


@dataclass(slots=True)
class _Row:
    params: SamplingParams
    prompt: list[int]
    detokenizer: IncrementalDetokenizer
    tokens: list[int] = field(default_factory=list)
    status: RequestStatus | None = None


class _RowsDone:
    """A stopping criterion of `generate` that applies our finish rule to every row.

    It sees each new token once, so the rows' detokenizers follow the generation; a row
    that is done stays done, and generate stops when every row is."""

    def __init__(self, rules: RequestRules, rows: list[_Row]) -> None:
        self.rules, self.rows = rules, rows
        self.first_token_at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        for row, token_id in zip(self.rows, input_ids[:, -1].tolist()):
            if row.status is None:
                row.tokens.append(token_id)
                row.status = self.rules.finish_status(row.params, row.detokenizer, token_id,
                                                      len(row.tokens), len(row.prompt) + len(row.tokens))
        return torch.tensor([row.status is not None for row in self.rows], device=input_ids.device)


def _sampling_key(p: SamplingParams) -> tuple:
    if p.greedy:
        return ("greedy", p.repetition_penalty)
    return ("sample", p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty)


class HFBatchGenerator:
    """Loads the model with `transformers` and runs the batches Triton forms."""

    def __init__(self, config: EngineConfig, name: str = "hf_dynamic_batching") -> None:
        self.name = name
        self.rules = RequestRules(config.runner)
        self.device = torch.device(config.runner.device)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.rules.model_path, dtype=getattr(torch, config.runner.dtype)).to(self.device).eval()
        eos = self.rules.model_config.eos_token_ids
        self.pad_id = eos[0] if eos else 0  # masked out: any id does

    def check(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids; raises InvalidRequestError naming what this model refuses."""
        if request.stream:
            raise InvalidRequestError(
                f"model {self.name!r} does not stream: it answers when its whole batch is done; "
                "send stream=false, or use a streaming model such as 'orca'")
        for flag in UNSUPPORTED_FLAGS:
            if getattr(request, flag):
                raise InvalidRequestError(f"input {flag!r} is not supported by model {self.name!r}")
        for name, default in UNSUPPORTED_PARAMETERS.items():
            if getattr(request.params, name) != default:
                raise InvalidRequestError(
                    f"sampling parameter {name!r} is not supported by model {self.name!r} "
                    "(one generate call cannot honour it per request)")
        return self.rules.prepare(request.prompt, request.params)

    def run(self, batch: list[tuple[SamplingParams, list[int]]]) -> tuple[list[Finished | Exception], BatchRecord]:
        """Answer every request of `batch` (parameters, prompt token ids), in order; a failed
        generate call fails only the requests it ran."""
        started = time.perf_counter()
        results: list[Finished | Exception | None] = [None] * len(batch)
        record = BatchRecord(len(batch), 0, 0, 0, 0, 0, 0, 0.0, 0.0)
        order = sorted(range(len(batch)), key=lambda i: _sampling_key(batch[i][0]))
        for _, group in itertools.groupby(order, key=lambda i: _sampling_key(batch[i][0])):
            indices = list(group)
            try:
                for i, finished in zip(indices, self._generate([batch[i] for i in indices], record)):
                    results[i] = finished
            except Exception as e:
                for i in indices:
                    results[i] = e
        record.seconds = time.perf_counter() - started
        return results, record

    def _generate(self, items: list[tuple[SamplingParams, list[int]]], record: BatchRecord) -> list[Finished]:
        rows = [_Row(params, prompt, self.rules.detokenizer(prompt, params))
                for params, prompt in ((self.rules.resolved(p, len(t)), t) for p, t in items)]
        width = max(len(r.prompt) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # left padding: every row's last token is in the last column
            input_ids[i, width - len(row.prompt):] = torch.tensor(row.prompt)
            attention[i, width - len(row.prompt):] = 1
        p = items[0][0]
        # top_k 0 is "off" for generate (unset, it would default to 50).
        sampling = ({"do_sample": False} if p.greedy else
                    {"do_sample": True, "temperature": p.temperature, "top_k": max(p.top_k, 0),
                     "top_p": p.top_p, "min_p": p.min_p or None})
        done = _RowsDone(self.rules, rows)
        started = time.perf_counter()
        with torch.inference_mode():
            # Settings as arguments: they override the checkpoint's generation config, while
            # unset fields of a config object are filled from it. eos_token_id=None, or
            # generate stops rows at EOS on its own, ignore_eos or not: our rule decides.
            out = self.model.generate(input_ids.to(self.device), attention_mask=attention.to(self.device),
                                      max_new_tokens=max(r.params.max_tokens for r in rows),
                                      repetition_penalty=p.repetition_penalty, eos_token_id=None,
                                      pad_token_id=self.pad_id, stopping_criteria=transformers.StoppingCriteriaList([done]),
                                      **sampling)
        steps = out.shape[1] - width
        record.num_generate_calls += 1
        record.num_prompt_tokens += sum(len(r.prompt) for r in rows)
        record.num_padded_prompt_tokens += sum(width - len(r.prompt) for r in rows)
        record.num_steps += steps
        record.num_output_tokens += sum(len(r.tokens) for r in rows)
        record.num_computed_output_tokens += steps * len(rows)
        record.prefill_seconds += (done.first_token_at or time.perf_counter()) - started
        return [Finished(r.detokenizer.take_delta(final=True), (r.status or RequestStatus.FINISHED_LENGTH).reason,
                         len(r.prompt), r.tokens) for r in rows]
