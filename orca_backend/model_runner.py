"""Runs one iteration of a ScheduledBatch: selective batching over the paged K/V cache."""
from __future__ import annotations

import logging
import time

import torch

from .batch import SampledTokens, ScheduledBatch
from .models.attention import AttentionMetadata
from .request import Request
from .sampler import Sampler, SamplerOutput

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, seed: int, keep_logits: bool = False) -> None:
        cfg = model.config
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(cfg.num_layers)]
        self.sampler = Sampler(device, seed, cfg.eos_token_ids)
        self.keep_logits = keep_logits
        self.forward_seconds = 0.0  # time in the model forward, for the overhead benchmark

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, requests: list[Request]) -> SampledTokens:
        meta = AttentionMetadata.build(batch, self.block_size, self.device)
        input_ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        last_rows, sampling = [], []
        row = 0
        for n, sample, req in zip(batch.num_scheduled_tokens, batch.sample, requests):
            row += n
            if sample:
                last_rows.append(row - 1)
                sampling.append(req)
        start = time.perf_counter()
        h = self.model.embed_tokens(input_ids, meta)  # [num_tokens, hidden]
        h = self.model.run_layers(h, meta, self.kv_caches, range(self.model.config.num_layers))
        logits = self.model.logits(h[last_rows])  # [num_sampled, vocab]: LM head on sampled rows only
        self.forward_seconds += time.perf_counter() - start
        out = self._sample(logits, sampling) if sampling else None
        return _align(batch, out, logits if self.keep_logits else None)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample the batch at once; if that fails, row by row, so that a request whose
        parameters break the sampler fails alone and its neighbours still get their token."""
        try:
            return self.sampler(logits, requests)
        except Exception:
            log.exception("batched sampling failed; sampling row by row")
        out = SamplerOutput([], [], [], [])
        for i, req in enumerate(requests):
            try:
                row = self.sampler(logits[i:i + 1], [req])
                error = None
            except Exception as e:
                row = SamplerOutput([None], [None], [None])
                error = f"internal error while sampling this request's token: {e}"
            out.token_ids += row.token_ids
            out.sampled_logprobs += row.sampled_logprobs
            out.top_logprobs += row.top_logprobs
            out.errors.append(error)
        return out


def _align(batch: ScheduledBatch, out, logits) -> SampledTokens:
    """Spread the sampler's per-sampled-row results over all requests of the batch."""
    index, j = [], 0
    for sample in batch.sample:
        index.append(j if sample else None)
        j += sample

    def pick(values):
        return [values[i] if i is not None else None for i in index]

    if out is None:
        return SampledTokens(token_ids=pick([]))
    return SampledTokens(pick(out.token_ids), pick(out.top_logprobs), pick(out.sampled_logprobs),
                         pick(logits) if logits is not None else None,
                         pick(out.errors) if out.errors else [])
