"""Structured outputs, the grammar side: compiling a request's spec (a pool, a cache, a time
limit), a matcher per request that follows its tokens, and the allowed-token bitmask applied
to the logits. The grammar library (llguidance) is behind `backend.py` alone."""
from .backend import Grammar, Matcher, apply_bitmask, fill_bitmasks, new_bitmask
from .compiler import GrammarCompiler, GrammarTimeoutError, compiler_for, grammar_of

__all__ = ["Grammar", "GrammarCompiler", "GrammarTimeoutError", "Matcher", "apply_bitmask", "compiler_for",
           "fill_bitmasks", "grammar_of", "new_bitmask"]
