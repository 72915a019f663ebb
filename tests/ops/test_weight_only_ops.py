"""Tests for `qfuse::weight_only_scaled_mm` (W8A16: a float activation, an int8 / fp8 weight with its scale).

The expected result is computed here in float64, the 128x128 block scale expanded by index,
independently of qfuse. Covered: the reference kernel (the ground truth) on odd shapes with block,
per-channel and int8 weights; `torch.library.opcheck`; ValueErrors naming the problem; a kernel
without a weight-only GEMM raising NotImplementedError; the op inside torch.compile with dynamic
shapes (the onednn kernel, whose numerics are tested in tests/kernels/test_onednn.py). CPU only.
"""

import math

import pytest
import torch

import qfuse.ops  # noqa: F401  (registers torch.ops.qfuse)
from qfuse.kernels import get_kernel
from qfuse.platform import current_platform
from qfuse.schemes import FP8_DTYPE

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ONE_ROUNDING = {FP32: 1e-6, BF16: 2.0**-7, FP16: 2.0**-10}
# opcheck's test_schema compares inputs with allclose, which CPU torch cannot do for fp8 (as in
# test_scaled_mm_ops.py): it runs on an int8 weight, the fp8 weight gets the other checks.
FP8_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def w8a16_operands(m, k, n, with_bias, seed=0):
    """x bf16 [M, K], an fp8 weight [K, N] (a `w.t()` view), its 128x128 block scale, a bias or None."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(BF16)
    b = (torch.randn(n, k, generator=generator) * 40).to(FP8_DTYPE).t()
    scale_b = torch.rand(math.ceil(k / 128), math.ceil(n / 128), generator=generator) * 0.01 + 1e-3
    bias = torch.randn(n, generator=generator) if with_bias else None
    return x, b, scale_b, bias


def expected_weight_only(x, b, scale_b, bias):
    """float64, the block scale expanded by index, independently of qfuse."""
    k, n = b.shape
    weight = b.to(torch.float64) * scale_b.to(torch.float64)[torch.arange(k) // 128][:, torch.arange(n) // 128]
    out = x.reshape(-1, k).to(torch.float64) @ weight
    return (out if bias is None else out + bias.to(torch.float64)).reshape(*x.shape[:-1], n)


@pytest.mark.parametrize("m, k, n", [(1, 300, 200), (33, 256, 130), (5, 77, 45), (2, 100, 200)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("out_dtype", [BF16, FP32, FP16])
def test_reference_matches_float64(m, k, n, with_bias, out_dtype):
    x, b, scale_b, bias = w8a16_operands(m, k, n, with_bias)
    out = torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, bias, None, out_dtype, "reference")
    expected = expected_weight_only(x, b, scale_b, bias)
    rel, magnitude = ONE_ROUNDING[out_dtype], expected.abs().max().item()
    assert out.dtype == out_dtype and out.shape == expected.shape
    torch.testing.assert_close(out.to(torch.float64), expected.to(out_dtype).to(torch.float64),
                               rtol=rel, atol=rel * magnitude)


def test_reference_takes_int8_weights_and_per_channel_scales():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 40, generator=generator, dtype=FP16)
    b = torch.randint(-128, 128, (40, 24), dtype=torch.int8, generator=generator)
    scale_b = torch.rand(24, generator=generator)
    out = torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, None, None, FP32, "reference")
    expected = x.to(torch.float64) @ (b.to(torch.float64) * scale_b.to(torch.float64))
    torch.testing.assert_close(out, expected.to(FP32))


ONEDNN_HERE, WHY_NOT_ONEDNN = get_kernel("onednn").is_supported(current_platform("cpu"))
NEEDS_ONEDNN = pytest.mark.skipif(not ONEDNN_HERE, reason=f"the fp8 block W8A16 runs on oneDNN: {WHY_NOT_ONEDNN}")


@pytest.mark.parametrize("kernel", [pytest.param("onednn", marks=NEEDS_ONEDNN), "reference"])
def test_opcheck(kernel):
    x, b, scale_b, bias = w8a16_operands(3, 200, 130, True)
    for args in ((x, b, scale_b, bias, None, BF16, kernel), (x.reshape(1, 3, 200), b, scale_b, None, None, FP32, kernel)):
        torch.library.opcheck(torch.ops.qfuse.weight_only_scaled_mm.default, args, test_utils=FP8_OPCHECK_UTILS)


@pytest.mark.parametrize("kernel", ["torch", "reference"])
def test_opcheck_with_schema_check_on_an_int8_weight(kernel):
    x, _, _, bias = w8a16_operands(3, 208, 130, True)  # K a multiple of 16: the torch kernel's bf16 GEMM
    b = torch.randint(-128, 128, (130, 208), dtype=torch.int8).t()
    zero_point = torch.randint(-3, 4, (130,), dtype=torch.int32)
    for azp_b in (None, zero_point):
        torch.library.opcheck(torch.ops.qfuse.weight_only_scaled_mm.default, (x, b, torch.rand(130), bias, azp_b, FP32, kernel))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, b, s, bias: (x.to(torch.int8), b, s, bias, None, BF16), "activation must be one of"),
        (lambda x, b, s, bias: (x, b.to(torch.uint8), s, bias, None, BF16), "weight must be one of"),
        (lambda x, b, s, bias: (x, b, s, bias, None, torch.int32), "out_dtype must be one of"),
        (lambda x, b, s, bias: (x, b, s, bias[:-1], None, BF16), r"bias must have shape \[130\]"),
        (lambda x, b, s, bias: (x, b, s[:1], bias, None, BF16), "scale_b of shape"),
        (lambda x, b, s, bias: (x[:, :-1], b, s, bias, None, BF16), "activation has K=199"),
    ],
)
def test_errors_name_the_problem(change, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.qfuse.weight_only_scaled_mm(*change(*w8a16_operands(3, 200, 130, True)), "reference")


def test_a_kernel_without_weight_only_raises_not_implemented():
    x, b, scale_b, bias = w8a16_operands(3, 200, 130, True)
    cutlass = get_kernel("cutlass")
    with pytest.raises(NotImplementedError, match="its capability table has no row with a float activation dtype"):
        cutlass.weight_only_apply(x, get_kernel("torch").prepare_weight(b, scale_b, None), None, FP32)


@NEEDS_ONEDNN
def test_under_torch_compile_with_dynamic_shapes():
    def linear_gelu(x, b, scale_b, bias):
        return torch.nn.functional.gelu(torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, bias, None, BF16, "onednn"))

    compiled = torch.compile(linear_gelu, dynamic=True, fullgraph=True)
    for m, k, n in ((3, 300, 200), (17, 260, 150)):  # M, K and N symbolic (the weight is an input)
        x, b, scale_b, bias = w8a16_operands(m, k, n, True)
        x = x.reshape(1, m, k)
        torch.testing.assert_close(compiled(x, b, scale_b, bias), linear_gelu(x, b, scale_b, bias))


@pytest.mark.parametrize("shape", [(0, 64), (1, 64), (17, 64), (5, 1), (2, 3, 64), (100, 64)], ids=str)
@pytest.mark.parametrize("dtype", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("zero_point", [False, True], ids=["symmetric", "zero_point"])
@pytest.mark.parametrize("per_channel", [True, False], ids=["per_channel", "per_tensor"])
def test_the_torch_kernel_int8_weight_only_matches_the_reference(shape, dtype, zero_point, per_channel):
    """aten._weight_int8pack_mm on CPU, with the zero point's row-sum correction in float32."""
    generator = torch.Generator().manual_seed(1)
    k, n = shape[-1], 48
    x = torch.randn(shape, generator=generator).to(dtype)
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator).t()
    scale_b = torch.rand(n if per_channel else 1, generator=generator) * 0.02 + 0.001
    azp_b = torch.randint(-20, 21, (n,), dtype=torch.int32, generator=generator) if zero_point else None
    bias = torch.randn(n, generator=generator).to(dtype)
    if dtype == BF16 and k % 16:
        with pytest.raises(ValueError, match="K a multiple of 16"):  # instead of torch 2.13's crash
            torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, bias, azp_b, dtype, "torch")
        return
    out = torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, bias, azp_b, dtype, "torch")
    expected = torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, bias, azp_b, dtype, "reference")
    assert out.shape == expected.shape == (*shape[:-1], n) and out.dtype == dtype
    if expected.numel():  # above 64 rows the weight is rounded to x's dtype first (a dequantized mm): a norm check
        error = (out.double() - expected.double()).norm() / expected.double().norm()
        assert error < 4 * ONE_ROUNDING[dtype], error


def test_an_all_zero_weight_zero_point_is_dropped():
    x, _, _, bias = w8a16_operands(3, 64, 48, True)
    b = torch.randint(-128, 128, (48, 64), dtype=torch.int8).t()
    scale_b = torch.rand(48) * 0.02
    zeros = torch.zeros(48, dtype=torch.int64)
    with_zeros = torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, bias, zeros, BF16, "torch")
    torch.testing.assert_close(with_zeros, torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, bias, None, BF16, "torch"))
