"""What the runner keeps of one request between iterations."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.messages import NewRequest
from ..core.sampling_params import SamplingParams
from ..grammar import GrammarCompiler, Matcher


@dataclass(slots=True, eq=False)
class RunnerRequest:
    request_id: str
    num_prompt_tokens: int
    token_ids: list[int]  # every token it has been sent: the prompt, then outputs as fed back
    params: SamplingParams
    wants_logprob: bool
    block_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # its own: seeded, not greedy, and this runner samples
    failure: str | None = None  # why it cannot sample (its seed broke the generator): it fails alone
    last_sampled: int | None = None  # its token this runner sampled last, until a placeholder takes it
    matcher: Matcher | None = None  # where its output stands in its structured_outputs grammar
    lora_id: int | None = None  # its adapter, held in the runner's tiers; None: the base model
    pooled: torch.Tensor | None = None  # an embedding request with mean pooling: its rows' sum so far
    num_computed: int = 0  # the first position of its rows in the last iteration it was scheduled in

    @classmethod
    def new(cls, new: NewRequest, sampling_device: torch.device | None,
            grammars: GrammarCompiler | None = None) -> RunnerRequest:
        """`sampling_device`: where this runner samples (None if it does not): a seeded
        request's generator is made there now, so that sampling never creates state; so is
        the matcher of its grammar, from `grammars` (compiled already, when the engine that
        waited for it shares this process)."""
        state = cls(new.request_id, len(new.prompt_token_ids), list(new.prompt_token_ids), new.params,
                    new.wants_logprob)
        seed = new.params.seed
        if seed is not None and sampling_device is not None and not new.params.greedy:
            try:
                state.generator = torch.Generator(device=sampling_device).manual_seed(seed)
            except Exception as e:
                state.failure = f"its seed {seed} cannot seed a generator: {e}"
        spec = new.params.structured_outputs
        if spec is not None and sampling_device is not None:
            try:
                if grammars is None:
                    raise RuntimeError("this runner has no grammar compiler")
                state.matcher = grammars.compile(spec).matcher()
            except Exception as e:
                state.failure = f"its structured_outputs grammar cannot be followed: {e}"
        return state

    @property
    def output_token_ids(self) -> list[int]:
        """Outputs so far: when it samples, every earlier output has been fed back."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
