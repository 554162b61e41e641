"""Custom kernels for the serving engine, and the ahead-of-time build of them for TensorRT.

`paged_attention` is imported eagerly: the function shares its name with its module, and a
lazy `__getattr__` would lose to the submodule attribute once anything imported the module.
"""
from trt_plugins.paged_attention import paged_attention

__all__ = ["paged_attention"]
