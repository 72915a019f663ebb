"""Tests for `qfuse::w4a8_scaled_mm` with the "reference" kernel (CPU; the xpu kernel's call is tested
against a stand-in in tests/kernels/test_xpu.py).

The op takes the activation quantized (q int8 and its scale, as the model's graph computes them).
The expected result is computed here group by group in float64: each K-group of the int4 weight
multiplied separately and scaled by its row of scale_b, then the token scale and the bias. Also:
`torch.library.opcheck` and the ValueErrors.
"""

import pytest
import torch

import qfuse.ops  # noqa: F401  (registers torch.ops.qfuse)
from qfuse.kernels import reference_math
from qfuse.schemes import Granularity

ops = torch.ops.qfuse


def quantized(x):
    """x quantized per token to symmetric int8 by qfuse's quantizer: (q, scale [..., 1])."""
    q, scale = reference_math.dynamic_quant(x.reshape(-1, x.shape[-1]), torch.int8, Granularity.PER_TOKEN, 1e-6)
    return q.reshape(x.shape), scale.float().reshape(*x.shape[:-1], 1)


def operands(group_size, dtype, rows=(5,), n=16, k=256, seed=0):
    """a int8 [*rows, K], its scale [*rows, 1], int4 values [N, K] (int8), scale_b, bias [N], and the
    op's group_size argument."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=generator)
    groups = 1 if group_size is None else k // group_size
    scale = torch.rand(groups, n, generator=generator) * 0.02 + 0.001
    a, scale_a = quantized(torch.randn(*rows, k, generator=generator))
    bias = torch.randn(n, generator=generator).to(dtype)
    if group_size is None:
        return a, scale_a, values, scale.reshape(n), bias, -1
    return a, scale_a, values, scale, bias, group_size


@pytest.mark.parametrize("group_size", [32, 128, None])
def test_reference_matches_float64_group_by_group_math(group_size):
    quantized, token_scale, values, scale, bias, group_arg = operands(group_size, torch.float32)
    out = ops.w4a8_scaled_mm(quantized, token_scale, values.t(), scale, bias, group_arg, torch.float32, "reference")
    group = 256 if group_size is None else group_size
    weight_kn, scale_rows = values.t().to(torch.float64), scale.reshape(-1, 16).to(torch.float64)
    expected = torch.zeros(5, 16, dtype=torch.float64)
    for index in range(256 // group):
        rows = slice(index * group, (index + 1) * group)
        expected += (quantized[:, rows].to(torch.float64) @ weight_kn[rows]) * scale_rows[index]
    expected = expected * token_scale.to(torch.float64) + bias.to(torch.float64)
    torch.testing.assert_close(out, expected.to(torch.float32), rtol=1e-6, atol=1e-6)


def test_leading_dimensions_are_kept_and_one_scale_serves_every_token():
    a, scale_a, values, scale, bias, group_arg = operands(64, torch.bfloat16, rows=(2, 3))
    out = ops.w4a8_scaled_mm(a, scale_a, values.t(), scale, bias, group_arg, torch.bfloat16, "reference")
    flat = ops.w4a8_scaled_mm(a.reshape(6, 256), scale_a.reshape(6, 1), values.t(), scale, bias, group_arg,
                              torch.bfloat16, "reference")
    assert out.shape == (2, 3, 16) and out.dtype == torch.bfloat16
    assert torch.equal(out.reshape(6, 16), flat)
    one = torch.tensor(0.02)
    per_tensor = ops.w4a8_scaled_mm(a, one, values.t(), scale, bias, group_arg, torch.bfloat16, "reference")
    expanded = ops.w4a8_scaled_mm(a, one.expand(2, 3, 1), values.t(), scale, bias, group_arg, torch.bfloat16, "reference")
    assert torch.equal(per_tensor, expanded)


@pytest.mark.parametrize("group_size", [32, None])
def test_opcheck(group_size):
    a, scale_a, values, scale, bias, group_arg = operands(group_size, torch.float16, rows=(2, 3))
    for args in ((a, scale_a, values.t(), scale, bias), (a[0], scale_a[0], values.t(), scale, None)):
        torch.library.opcheck(ops.w4a8_scaled_mm.default, (*args, group_arg, torch.float16, "reference"))


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
        ({"a": torch.zeros(5, 256)}, r"activation must be int8 \(quantized\), got torch.float32"),
        ({"scale_a": torch.ones(5, 2)}, r"scale_a must be one value or one per token \(5, 1\), got \(5, 2\)"),
        ({"scale_a": torch.ones(5, 1, dtype=torch.int32)}, "scale_a must be floating point"),
        ({"bias": torch.zeros(15)}, r"bias must have shape \[16\], got \(15,\)"),
        ({"scale_b": torch.ones(8, 16, dtype=torch.int32)}, "scale_b must be floating point"),
        ({"out_dtype": torch.int32}, "out_dtype must be one of"),
    ],
)
def test_errors_name_the_problem(change, message):
    a, scale_a, values, scale, bias, group_arg = operands(32, torch.float16)
    arguments = {"a": a, "scale_a": scale_a, "b": values.t(), "scale_b": scale, "bias": bias, "group_size": group_arg,
                 "out_dtype": torch.float16, "kernel": "reference"} | change
    with pytest.raises(ValueError, match=message):
        ops.w4a8_scaled_mm(*arguments.values())
