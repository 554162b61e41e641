"""How a model's text becomes an assistant message: tool calls (`--tool-call-parser`, or
forced by a grammar) and reasoning (`--reasoning-parser`), read incrementally as it streams."""
from .pythonic import PythonicParser
from .reasoning import REASONING_PARSERS
from .tool_parsers import HermesParser, Llama3JsonParser, MistralParser, ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser, "pythonic": PythonicParser}
# Their calls begin with a special token, which the text keeps only with skip_special_tokens false.
SPECIAL_TOKEN_PARSERS = ("mistral",)

__all__ = ["REASONING_PARSERS", "SPECIAL_TOKEN_PARSERS", "TOOL_PARSERS"]
