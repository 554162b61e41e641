"""The engine: `LLMEngine` (requests in, deltas out, one `step()` per iteration), the offline
`LLM`, the request rules shared with the baseline, incremental detokenization and outputs."""
