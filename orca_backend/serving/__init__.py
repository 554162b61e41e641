"""Triton's side: the decoupled Python-backend model, request parsing and response tensors,
metrics, the serving loop and its sender, `launch` (tritonserver with or without NVIDIA's
image), and the pipeline stages as Triton models (`stages/`). With the baseline's model, the
only place that imports `triton_python_backend_utils`."""
