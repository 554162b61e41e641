"""Speculative decoding's proposers, on the runner's side: the scheduler reserves rows for a
request's proposals (`ScheduledRequest.num_proposals`), the runner asks its proposer to fill
them, checks them, and reports how many it proposed and which held.

Every proposer has `propose(asks)` (up to `ask.limit` tokens each, possibly none) and
`forget(request_id)`. `NgramProposer` needs only the token history, which every pipeline stage
keeps, so each stage proposes the same tokens itself; `DraftModel` (drafter.py) runs on the
runner that samples, whose tensor-parallel ranks get its proposals with the message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..core.speculative import SpeculativeConfig


@dataclass(slots=True)
class ProposalAsk:
    request_id: str
    token_ids: list[int]  # its tokens so far, ending with the newest (whose K/V is not written yet)
    block_ids: list[int]  # its block table (a draft model writes its own K/V in the same slots)
    limit: int  # the most tokens to propose


class Proposer(Protocol):
    reads_block_tables: bool  # whether it reads K/V through the requests' tables (a draft model)

    def propose(self, asks: list[ProposalAsk]) -> list[list[int]]: ...

    def forget(self, request_id: str) -> None: ...


class NgramProposer:
    """Proposals by prompt lookup, over each request's tokens (kept here as bytes, 4 per token,
    so that the search is `bytes.rfind` in C, not a Python loop over the context)."""

    reads_block_tables = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._seen: dict[str, tuple[bytearray, int]] = {}  # request id -> (its tokens as bytes, count)

    def propose(self, asks: list[ProposalAsk]) -> list[list[int]]:
        return [self.lookup(ask.request_id, ask.token_ids, ask.limit) for ask in asks]

    def lookup(self, request_id: str, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens to follow `tokens` (the request's prompt and output so
        far): after the most recent earlier occurrence of its longest suffix of n tokens,
        prompt_lookup_max >= n >= prompt_lookup_min, that has one. [] when none has."""
        limit = min(limit, self.config.num_speculative_tokens)
        if limit <= 0:
            return []
        data = self._bytes(request_id, tokens)
        num_tokens = len(tokens)
        for n in range(min(self.config.prompt_lookup_max, num_tokens - 1), self.config.prompt_lookup_min - 1, -1):
            pattern = bytes(data[(num_tokens - n) * 4:])
            end = (num_tokens - 1) * 4  # an occurrence that ends before the last token
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:  # aligned on a token
                    start = at // 4 + n
                    return tokens[start:start + limit]
                end = at + len(pattern) - 1
        return []

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)

    def _bytes(self, request_id: str, tokens: list[int]) -> bytearray:
        data, count = self._seen.get(request_id, (bytearray(), 0))
        if count > len(tokens):  # not this request's history any more (a recompute): start over
            data, count = bytearray(), 0
        for t in tokens[count:]:
            data += t.to_bytes(4, "little")
        self._seen[request_id] = (data, len(tokens))
        return data
