"""The per-iteration contract between the scheduler and the model runner: plain data only,
so that it can be sent to pipeline stages as it is."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledBatch:
    """One iteration: request i contributes `num_scheduled_tokens[i]` tokens starting at
    position `num_computed_tokens[i]`; its new K/V goes to the slots of `block_tables[i]`."""

    request_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # flattened, sum(num_scheduled_tokens)
    sample: list[bool] = field(default_factory=list)  # request's last row yields a token

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prefill_requests(self) -> int:
        """Requests still working through their prompt (or a recompute) this iteration."""
        return sum(1 for n, s in zip(self.num_scheduled_tokens, self.sample) if n > 1 or not s)

    @property
    def num_decode_requests(self) -> int:
        return self.num_requests - self.num_prefill_requests


@dataclass(slots=True)
class SampledTokens:
    """What an iteration returns: one entry per request of the batch, None when not sampled."""

    token_ids: list[int | None]
    logprobs: list[dict | None] = field(default_factory=list)  # {token_id: (logprob, rank)}
    sampled_logprobs: list[float | None] = field(default_factory=list)
    logits: list | None = None  # per request, only when the engine keeps them (tests)
    errors: list[str | None] = field(default_factory=list)  # why a request's sampling failed
