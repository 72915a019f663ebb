"""Tests for `qfuse::w4a8_scaled_mm` with the "reference" kernel (CPU; the xpu kernel's call is tested
against a stand-in in tests/kernels/test_xpu.py).

The expected result is computed here group by group in float64: the activation quantized per token
with qfuse's quantizer, each K-group of the int4 weight multiplied separately and scaled by its row
of scale_b, then the token scale and the bias. Also: `torch.library.opcheck` and the ValueErrors.
"""

import pytest
import torch

import qfuse.ops  # noqa: F401  (registers torch.ops.qfuse)
from qfuse.kernels import reference_math
from qfuse.schemes import Granularity

ops = torch.ops.qfuse


def operands(group_size, dtype, rows=(5,), n=16, k=256, seed=0):
    """x [*rows, K], int4 values [N, K] (int8), scale_b, bias [N], and the op's group_size argument."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=generator)
    groups = 1 if group_size is None else k // group_size
    scale = torch.rand(groups, n, generator=generator) * 0.02 + 0.001
    x = torch.randn(*rows, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    if group_size is None:
        return x, values, scale.reshape(n), bias, -1
    return x, values, scale, bias, group_size


@pytest.mark.parametrize("group_size", [32, 128, None])
def test_reference_matches_float64_group_by_group_math(group_size):
    x, values, scale, bias, group_arg = operands(group_size, torch.float32)
    out = ops.w4a8_scaled_mm(x, values.t(), scale, bias, group_arg, 1e-6, torch.float32, "reference")
    quantized, token_scale = reference_math.dynamic_quant(x, torch.int8, Granularity.PER_TOKEN, 1e-6)
    group = 256 if group_size is None else group_size
    weight_kn, scale_rows = values.t().to(torch.float64), scale.reshape(-1, 16).to(torch.float64)
    expected = torch.zeros(5, 16, dtype=torch.float64)
    for index in range(256 // group):
        rows = slice(index * group, (index + 1) * group)
        expected += (quantized[:, rows].to(torch.float64) @ weight_kn[rows]) * scale_rows[index]
    expected = expected * token_scale.to(torch.float64) + bias.to(torch.float64)
    torch.testing.assert_close(out, expected.to(torch.float32), rtol=1e-6, atol=1e-6)


def test_leading_dimensions_are_kept():
    x, values, scale, bias, group_arg = operands(64, torch.bfloat16, rows=(2, 3))
    out = ops.w4a8_scaled_mm(x, values.t(), scale, bias, group_arg, 1e-5, torch.bfloat16, "reference")
    flat = ops.w4a8_scaled_mm(x.reshape(6, 256), values.t(), scale, bias, group_arg, 1e-5, torch.bfloat16, "reference")
    assert out.shape == (2, 3, 16) and out.dtype == torch.bfloat16
    assert torch.equal(out.reshape(6, 16), flat)


@pytest.mark.parametrize("group_size", [32, None])
def test_opcheck(group_size):
    x, values, scale, bias, group_arg = operands(group_size, torch.float16, rows=(2, 3))
    for args in ((x, values.t(), scale, bias), (x[0], values.t(), scale, None)):
        torch.library.opcheck(ops.w4a8_scaled_mm.default, (*args, group_arg, 1e-5, torch.float16, "reference"))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kernel": "torch"}, r"kernel 'torch' does not implement W4A8; use one of \('xpu', 'reference'\)"),
        ({"group_size": 48}, r"group_size must be -1 \(per channel\) or a positive divisor of K=256, got 48"),
        ({"group_size": 0}, r"group_size must be -1 \(per channel\) or a positive divisor of K=256, got 0"),
        ({"group_size": 64}, r"scale_b must have shape \(4, 16\) for group_size 64, got \(8, 16\)"),
        ({"group_size": -1}, r"per-channel scale_b must have 16 values, got shape \(8, 16\)"),
        ({"b": torch.zeros(256, 16, dtype=torch.int32)}, r"weight must be an int8 \[K, N\] matrix of int4 values"),
        ({"b": torch.zeros(128, 16, dtype=torch.int8)}, r"activation has K=256 but the \[K, N\] weight has 128 rows"),
        ({"x": torch.zeros(3, 256, dtype=torch.int8)}, "activation must be floating point, got torch.int8"),
        ({"bias": torch.zeros(15)}, r"bias must have shape \[16\], got \(15,\)"),
        ({"scale_b": torch.ones(8, 16, dtype=torch.int32)}, "scale_b must be floating point"),
        ({"out_dtype": torch.int32}, "out_dtype must be one of"),
    ],
)
def test_errors_name_the_problem(change, message):
    x, values, scale, bias, group_arg = operands(32, torch.float16)
    arguments = {"x": x, "b": values.t(), "scale_b": scale, "bias": bias, "group_size": group_arg, "eps": 1e-5,
                 "out_dtype": torch.float16, "kernel": "reference"} | change
    with pytest.raises(ValueError, match=message):
        ops.w4a8_scaled_mm(*arguments.values())
