"""Executors: where the model runner lives and how each iteration's message reaches it.
`base` has the interface, `factory` the executor an engine config names."""
