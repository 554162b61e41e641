"""The projections' GEMM paths (runner/models/linear.py) against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orca_backend import ConfigError
from orca_backend.runner.models.linear import Linear, linear_backend

torch.manual_seed(0)
WEIGHT, BIAS = torch.randn(96, 64) / 8, torch.randn(96)


def packed(backend: str, bias: torch.Tensor | None = BIAS) -> Linear:
    linear = Linear(WEIGHT.clone(), bias)
    linear.pack(backend)
    assert linear.backend == backend and linear.weight is None  # the [out, in] copy is gone
    return linear


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("bias", [BIAS, None])
def test_onednn_matches_f_linear(rows, bias):
    x = torch.randn(rows, 64)
    torch.testing.assert_close(packed("onednn", bias)(x), F.linear(x, WEIGHT, bias), rtol=1e-5, atol=1e-5)


def test_onednn_takes_a_strided_input():
    x = torch.randn(5, 128)[:, ::2]  # a view, as a split of a fused projection's output is
    torch.testing.assert_close(packed("onednn")(x), F.linear(x, WEIGHT, BIAS), rtol=1e-5, atol=1e-5)


def test_int8_is_close_to_fp32():
    x = torch.randn(9, 64)
    ref = F.linear(x, WEIGHT, BIAS)
    error = (packed("int8")(x) - ref).norm() / ref.norm()
    assert error < 0.02, f"relative error {error:.4f}"


def test_int8_scales_activations_per_row():
    """A row of large activations (a prompt's first token) must not cost its batch
    neighbours their precision: each row gets its own activation scale."""
    linear = packed("int8")
    x = torch.randn(4, 64)
    ref = F.linear(x[1:], WEIGHT, BIAS)

    def error(y):
        return float((y - ref).norm() / ref.norm())
    alone = error(linear(x[1:]))
    beside = error(linear(torch.cat([x[:1] * 1000, x[1:]]))[1:])
    assert beside < 2 * alone + 1e-3, f"relative error {beside:.4f} beside the large row, {alone:.4f} alone"


@pytest.mark.parametrize("backend", ["torch", "onednn", "int8"])
def test_no_rows_give_no_rows(backend):
    linear = Linear(WEIGHT.clone(), BIAS)
    linear.pack(backend)
    assert linear(torch.empty(0, 64)).shape == (0, 96)


def test_a_packed_projection_is_not_packed_again_for_another_backend():
    linear = packed("onednn")
    linear.pack("onednn")  # the same: nothing to do
    with pytest.raises(ConfigError, match="packed for 'onednn' already"):
        linear.pack("int8")


def test_backend_choice():
    cpu = torch.device("cpu")
    assert linear_backend(cpu, torch.float32, "none", "auto") == "onednn"
    assert linear_backend(cpu, torch.float32, "none", "torch") == "torch"
    assert linear_backend(cpu, torch.float32, "int8", "auto") == "int8"
    assert linear_backend(torch.device("cuda"), torch.bfloat16, "none", "auto") == "torch"
    with pytest.raises(ConfigError, match="linear 'onednn' is a CPU path"):
        linear_backend(torch.device("cuda"), torch.bfloat16, "none", "onednn")
    with pytest.raises(ConfigError, match="quantization 'int8' is a CPU path"):
        linear_backend(torch.device("cuda"), torch.float32, "int8", "auto")
