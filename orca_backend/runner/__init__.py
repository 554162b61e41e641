"""Model execution: the model runner (one iteration from a `SchedulerOutput`), its per-request
state, the sampler, CUDA graphs, the TensorRT runner, and `models/` (layers, attention
backends, weights). `build.build_runner(spec)` makes one from a `spec.RunnerSpec`."""
