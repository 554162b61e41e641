"""Incremental detokenization with stop strings.

Never emits half a multi-byte character (the tokenizer's DecodeStream buffers those), never
emits text that may turn out to be the start of a stop string, and cuts at the first stop.
"""
from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ..core.sampling_params import SamplingParams

_PROMPT_CONTEXT_TOKENS = 4  # enough for decoders that drop a leading space at the start


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:],
                                   skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.text = ""  # all output text decoded so far (cut at a stop string)
        self.num_emitted_chars = 0

    def append(self, token_id: int, check_stop: bool = True) -> bool:
        """Decode one more token; True when the text now contains a stop string."""
        piece = self.stream.step(self.tokenizer, token_id)
        if not piece:
            return False
        old_len = len(self.text)
        self.text += piece
        if not (self.stop and check_stop):
            return False
        longest = max(map(len, self.stop))
        search_from = max(0, old_len - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        i, s = min(hits)
        self.text = self.text[:i + (len(s) if self.include_stop else 0)]
        return True

    def take_delta(self, final: bool) -> str:
        """Text not yet emitted, holding back a tail that could begin a stop string."""
        end = len(self.text) if final else len(self.text) - self._stop_prefix_len()
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        return delta

    def _stop_prefix_len(self) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
