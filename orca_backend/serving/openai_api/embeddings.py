"""/v1/embeddings: OpenAI's request and response. Each input is one embedding request to the
model (its `embedding_request` input), all on one gRPC stream; the model pools as its
`pooling_type` says, and refuses them when that is 'none'."""
from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import ConfigDict, Field

from .errors import invalid
from .protocol import Body

MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(Body):
    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None  # accepted and not used, as OpenAI's docs allow

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or a list of token ids."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            items = [self.input]
        else:
            items = list(self.input)
        if not items:
            raise invalid("input must not be empty", "input")
        if len(items) > MAX_INPUTS:
            raise invalid(f"input has {len(items)} items, more than {MAX_INPUTS}", "input")
        for i, item in enumerate(items):
            if not item:
                raise invalid(f"input[{i}] is empty", "input")
        return items

    def response(self, results: list[tuple[list[float], int]]) -> dict:
        """OpenAI's list of embeddings (floats, or base64 of little-endian float32) and usage."""
        data = [{"object": "embedding", "index": i, "embedding": self._encoded(vector)}
                for i, (vector, _) in enumerate(results)]
        tokens = sum(n for _, n in results)
        return {"object": "list", "data": data, "model": self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _encoded(self, vector: list[float]) -> list[float] | str:
        if self.encoding_format == "float":
            return vector
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
