"""Speculative decoding's `draft_model` proposer: a smaller checkpoint with the target's
tokenizer, run by the runner that samples, k greedy steps ahead of the requests it is asked for.

Its K/V lives in a pool of its own with as many blocks as the target's, addressed by the
target's block tables: the scheduler's reservation for a speculating request (1 + k rows from
its newest token) covers the draft's k steps too, and no block manager of its own is needed.
What the draft has written is tracked per request, by the tokens it wrote them for: on the next
call, the proposals the target accepted are still valid K/V and the rest is written over. A
request new to the draft (or back from a preemption, or sharing cached blocks of the target's)
has its whole history computed in the first step, as one prompt chunk.

Proposals are argmax: a one-hot proposal distribution, which the runner's rejection sampler
checks exactly (the target's distribution is kept at any temperature).
"""
from __future__ import annotations

import torch

from .models.attention import AttentionBackend, BatchLayout
from .proposers import ProposalAsk


class DraftModel:
    reads_block_tables = True  # its whole history's K/V, through the target's tables

    def __init__(self, model, num_blocks: int, device: torch.device, dtype: torch.dtype,
                 attention: AttentionBackend, max_chunk: int = 512) -> None:
        """`max_chunk`: the most tokens of one request a catch-up forward runs (the model's
        own token budget per iteration, so that its activations stay within what it has)."""
        cfg = model.config
        self.model = model
        self.max_chunk = max_chunk
        self.attention = attention
        attention.rope_lens = attention.rope_lens or getattr(model, "needs_rope_lens", False)
        self.device = device
        heads, dim, values = cfg.kv_layout(1)
        caches = attention.allocate_kv_cache(cfg.num_layers, num_blocks, heads, dim, dtype, values)
        self.kv_caches = dict(zip(model.layer_range, caches))
        # request id -> (tokens of its history whose K/V is written, proposals written after them)
        self._written: dict[str, tuple[int, list[int]]] = {}

    @torch.inference_mode()
    def propose(self, asks: list[ProposalAsk]) -> list[list[int]]:
        """`ask.limit` proposed tokens for each. Step 1 runs every request's tokens not yet in
        the draft's K/V (a long history first in chunks of max_chunk, one request at a time);
        the next steps one row each."""
        items = [(a.request_id, a.token_ids, a.block_ids, a.limit) for a in asks]
        layout = BatchLayout([], [], [])
        input_ids: list[int] = []
        for request_id, tokens, blocks, _ in items:
            start = self._valid(request_id, tokens)
            while len(tokens) - start > self.max_chunk:
                self._hidden(BatchLayout([start], [self.max_chunk], [blocks]), tokens[start:start + self.max_chunk])
                start += self.max_chunk
            layout.num_computed_tokens.append(start)
            layout.num_scheduled_tokens.append(len(tokens) - start)
            layout.block_tables.append(blocks)
            input_ids += tokens[start:]
        proposals: list[list[int]] = [[] for _ in items]
        active = list(range(len(items)))
        while True:
            last = torch.tensor(layout.num_scheduled_tokens, device=self.device).cumsum(0) - 1
            next_ids = self._forward(layout, input_ids, last)
            for i, token_id in zip(active, next_ids):
                proposals[i].append(token_id)
            active = [i for i in active if len(proposals[i]) < items[i][3]]
            if not active:
                break
            layout = BatchLayout([len(items[i][1]) + len(proposals[i]) - 1 for i in active], [1] * len(active),
                                 [items[i][2] for i in active])
            input_ids = [proposals[i][-1] for i in active]
        for (request_id, tokens, _, _), drafts in zip(items, proposals):
            self._written[request_id] = (len(tokens), drafts[:-1])  # the last was never an input
        return proposals

    def forget(self, request_id: str) -> None:
        """Its K/V is gone (finished) or moved (preempted: a new block table comes)."""
        self._written.pop(request_id, None)

    def _valid(self, request_id: str, tokens: list[int]) -> int:
        """How many of `tokens` have K/V written in the draft's pool: those it was run on, and
        its proposals after them that came true. The newest token never counts (it is the
        input that yields the first proposal)."""
        count, drafts = self._written.get(request_id, (0, []))
        if count >= len(tokens):  # not this history (the request was rolled back): start over
            return 0
        matched = 0
        while matched < len(drafts) and count + matched < len(tokens) - 1 and drafts[matched] == tokens[count + matched]:
            matched += 1
        return count + matched

    def _forward(self, layout: BatchLayout, input_ids: list[int], last_rows: torch.Tensor) -> list[int]:
        """The argmax after each of `last_rows`."""
        return self.model.logits(self._hidden(layout, input_ids)[last_rows]).argmax(dim=-1).tolist()

    def _hidden(self, layout: BatchLayout, input_ids: list[int]) -> torch.Tensor:
        """Run the rows (their K/V written); their last hidden states."""
        meta = self.attention.plan(layout)
        hidden = self.model.embed_tokens(torch.tensor(input_ids, dtype=torch.long, device=self.device), meta)
        return self.model.run_layers(hidden, meta, self.kv_caches, self.model.layer_range)
