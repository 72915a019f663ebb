"""Tests for `qfuse::scaled_mm` and `qfuse::quant_scaled_mm` with the "reference" and "torch" kernels.

The expected result is computed here, independently of qfuse: every operand is dequantized to
float64 (zero points subtracted, scales expanded element by element, 128x128 blocks by index),
multiplied in float64, and the bias added. The reference kernel must match tightly; the torch
kernel within float32 epilogue rounding (int8) or bf16 rounding (fp8 on CPU multiplies in bf16).
Also: ValueErrors naming the problem, and `torch.library.opcheck`. CPU only.
"""

import pytest
import torch

import qfuse  # noqa: F401  (registers torch.ops.qfuse.*)

ops = torch.ops.qfuse
FP8 = torch.float8_e4m3fn
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative tolerance of one rounding to each out dtype (both sides round the same float64 value).
ONE_ROUNDING = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def quantized(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=generator, dtype=torch.int8)
    return (torch.randn(shape, generator=generator) * 40).to(FP8)


def positive(shape, seed):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) + 0.5


def weight(k, n, dtype, layout, seed=1):
    """The [K, N] weight: a `w.t()` view of a stored [N, K] tensor, or a contiguous [K, N] tensor."""
    if layout == "transposed":
        return quantized((n, k), dtype, seed).t()
    return quantized((k, n), dtype, seed)


def expected_linear(a, b, scale_a=None, scale_b=None, bias=None, azp_a=None, azp_b=None):
    """float64: ((a - azp_a) * scale_a) @ ((b - azp_b) * scale_b) + bias, every scale expanded by hand."""
    k, n = b.shape
    a64 = a.reshape(-1, k).to(torch.float64)
    b64 = b.to(torch.float64)
    m = a64.shape[0]
    if azp_a is not None:
        a64 = a64 - azp_a.reshape(-1, 1).to(torch.float64)
    if azp_b is not None:
        b64 = b64 - azp_b.reshape(1, -1).to(torch.float64)
    if scale_a is not None:
        scale = scale_a.to(torch.float64)
        if scale.numel() == 1:
            a64 = a64 * scale.item()
        elif scale.numel() == m:
            a64 = a64 * scale.reshape(m, 1)
        else:  # one per row and 128-group of K
            a64 = a64 * scale.reshape(m, -1)[:, torch.arange(k) // 128]
    if scale_b is not None:
        scale = scale_b.to(torch.float64)
        if scale.numel() == 1:
            b64 = b64 * scale.item()
        elif scale.numel() == n:
            b64 = b64 * scale.reshape(1, n)
        else:  # one per 128x128 block
            b64 = b64 * scale[torch.arange(k) // 128][:, torch.arange(n) // 128]
    out = a64 @ b64
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.reshape(*a.shape[:-1], n)


def assert_matches(out, expected64, out_dtype, rel):
    assert out.dtype == out_dtype and out.shape == expected64.shape
    magnitude = expected64.abs().max().item()
    torch.testing.assert_close(out.to(torch.float64), expected64.to(out_dtype).to(torch.float64),
                               rtol=rel, atol=rel * magnitude)


def tolerance(kernel, quant_dtype, out_dtype):
    if kernel == "reference":
        return ONE_ROUNDING[out_dtype]
    if quant_dtype == FP8 and out_dtype == torch.bfloat16:  # CPU: bf16 mm, then a bf16 epilogue
        return 2.0**-6
    return max(1e-5, ONE_ROUNDING[out_dtype])  # int32 (exact) or fp32 accumulation, fp32 epilogue


@pytest.mark.parametrize("kernel", ["reference", "torch"])
@pytest.mark.parametrize("quant_dtype", [torch.int8, FP8])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("scales", ["none", "tensor", "row", "column", "row_column"])
@pytest.mark.parametrize("m, k, n", [(1, 64, 48), (17, 200, 33)])
def test_scaled_mm_matches_dequantized_float64(kernel, quant_dtype, out_dtype, scales, m, k, n):
    a = quantized((m, k), quant_dtype, seed=0)
    b = weight(k, n, quant_dtype, "transposed")
    scale_a = {"tensor": torch.tensor(0.02), "row": positive((m, 1), 2), "row_column": positive((m, 1), 2)}.get(scales)
    scale_b = {"tensor": torch.tensor([0.03]), "column": positive((n,), 3) * 0.01,
               "row_column": positive((1, n), 3) * 0.01}.get(scales)
    bias = positive((n,), 4) * 100
    out = ops.scaled_mm(a, b, scale_a, scale_b, bias, None, None, out_dtype, kernel)
    assert_matches(out, expected_linear(a, b, scale_a, scale_b, bias), out_dtype, tolerance(kernel, quant_dtype, out_dtype))


@pytest.mark.parametrize("kernel", ["reference", "torch"])
@pytest.mark.parametrize("quant_dtype", [torch.int8, FP8])
@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_scaled_mm_3d_activation_and_weight_layouts(kernel, quant_dtype, layout, with_bias):
    a = quantized((2, 5, 96), quant_dtype, seed=5)
    b = weight(96, 40, quant_dtype, layout)
    scale_a, scale_b = positive((2, 5, 1), 6) * 0.1, positive((1, 40), 7) * 0.1
    bias = torch.linspace(-3, 3, 40) if with_bias else None
    out = ops.scaled_mm(a, b, scale_a, scale_b, bias, None, None, torch.float32, kernel)
    assert out.shape == (2, 5, 40)
    expected = expected_linear(a, b, scale_a, scale_b, bias)
    assert_matches(out, expected, torch.float32, tolerance(kernel, quant_dtype, torch.float32))


@pytest.mark.parametrize("kernel", ["reference", "torch"])
@pytest.mark.parametrize("zero_points", ["a_tensor", "a_row", "b_column", "both"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_int8_zero_points(kernel, zero_points, out_dtype):
    m, k, n = 17, 200, 33
    a, b = quantized((m, k), torch.int8, 8), weight(k, n, torch.int8, "transposed")
    azp_a = {"a_tensor": torch.tensor(-7, dtype=torch.int32),
             "a_row": torch.arange(m, dtype=torch.int32).reshape(m, 1) - 8,
             "both": torch.tensor([3], dtype=torch.int32)}.get(zero_points)
    azp_b = torch.arange(n, dtype=torch.int32) % 5 - 2 if zero_points in ("b_column", "both") else None
    scale_a, scale_b, bias = positive((m, 1), 9) * 0.01, positive((n,), 10) * 0.01, positive((n,), 11)
    out = ops.scaled_mm(a, b, scale_a, scale_b, bias, azp_a, azp_b, out_dtype, kernel)
    expected = expected_linear(a, b, scale_a, scale_b, bias, azp_a, azp_b)
    assert not torch.allclose(expected, expected_linear(a, b, scale_a, scale_b, bias), rtol=1e-3)
    assert_matches(out, expected, out_dtype, tolerance(kernel, torch.int8, out_dtype))


@pytest.mark.parametrize("quant_dtype", [torch.int8, FP8])
# (2, 200, 1): a block scale [2, 1] of one column, shaped like a group scale of 100 rows, is still 128-blocks
@pytest.mark.parametrize("m, k, n", [(3, 256, 256), (17, 200, 300), (1, 384, 33), (2, 200, 1)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_reference_group_and_block_scales(quant_dtype, m, k, n, out_dtype):
    a, b = quantized((m, k), quant_dtype, 12), weight(k, n, quant_dtype, "transposed")
    groups, blocks = -(-k // 128), (-(-k // 128), -(-n // 128))
    scale_a, scale_b = positive((m, groups), 13) * 0.01, positive(blocks, 14) * 0.01
    out = ops.scaled_mm(a, b, scale_a, scale_b, None, None, None, out_dtype, "reference")
    assert_matches(out, expected_linear(a, b, scale_a, scale_b), out_dtype, ONE_ROUNDING[out_dtype])


@pytest.mark.parametrize("kernel", ["reference", "torch"])
@pytest.mark.parametrize("quant_dtype", [torch.int8, FP8])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_quant_scaled_mm_quantizes_then_multiplies(kernel, quant_dtype, static, x_dtype, out_dtype):
    x = (torch.randn(2, 9, 160, generator=torch.Generator().manual_seed(15)) * 2).to(x_dtype)
    b = weight(160, 24, quant_dtype, "transposed")
    scale_b, bias = positive((24,), 16) * 0.01, positive((24,), 17)
    qmax = 127.0 if quant_dtype == torch.int8 else 448.0
    if static:
        scale_a = torch.tensor(0.05)
        scaled = x / scale_a
    else:
        scale_a = None
        row_scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / qmax
        scaled = x / row_scale
    q = scaled.round().clamp(-128, 127).to(torch.int8) if quant_dtype == torch.int8 else scaled.clamp(-448, 448).to(FP8)
    expected = expected_linear(q, b, scale_a if static else row_scale, scale_b, bias)
    out = ops.quant_scaled_mm(x, b, scale_a, scale_b, bias, quant_dtype, 1e-6, out_dtype, kernel)
    assert out.shape == (2, 9, 24)
    assert_matches(out, expected, out_dtype, tolerance(kernel, quant_dtype, out_dtype))


def test_scaled_mm_torch_kernel_block_scales_raise_or_are_correct():
    a, b = quantized((2, 256), torch.int8, 18), weight(256, 128, torch.int8, "transposed")
    scale_b = torch.tensor([[1.0], [2.0]])  # [K / 128, N / 128] = [2, 1]
    try:
        out = ops.scaled_mm(a, b, None, scale_b, None, None, None, torch.float32, "torch")
    except (ValueError, RuntimeError):
        return
    assert_matches(out, expected_linear(a, b, None, scale_b), torch.float32, 1e-5)


def test_scaled_mm_fp8_zero_points_raise_or_are_applied():
    a, b = quantized((4, 64), FP8, 19), weight(64, 16, FP8, "transposed")
    azp_a = torch.tensor(1, dtype=torch.int32)
    try:
        out = ops.scaled_mm(a, b, None, None, None, azp_a, None, torch.float32, "torch")
    except ValueError:
        return
    assert_matches(out, expected_linear(a, b, azp_a=azp_a), torch.float32, 2.0**-7)


@pytest.mark.parametrize("kernel", ["reference", "torch"])
def test_scaled_mm_fp8_float32_output_has_float32_precision(kernel):
    a, b = quantized((17, 200), FP8, 20), weight(200, 33, FP8, "transposed")
    out = ops.scaled_mm(a, b, None, None, None, None, None, torch.float32, kernel)
    expected = expected_linear(a, b)
    # Not bf16-accurate only: an accumulator rounded to bf16 would be off by ~1e-3 of the largest value.
    assert (out.double() - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


I8 = torch.int8
BAD_CASES = [
    (lambda: ops.scaled_mm(quantized((4, 64), I8, 0), weight(32, 16, I8, "transposed"), None, None, None, None, None,
                           torch.float32, "reference"), "activation has K=64 but the \\[K, N\\] weight has 32 rows"),
    (lambda: ops.scaled_mm(quantized((4, 64), I8, 0), weight(64, 16, FP8, "transposed"), None, None, None, None, None,
                           torch.float32, "torch"), "weight dtype torch.float8_e4m3fn does not match"),
    (lambda: ops.scaled_mm(quantized((4, 64), I8, 0).to(torch.uint8), weight(64, 16, I8, "transposed"), None, None,
                           None, None, None, torch.float32, "torch"), "must be int8 or float8_e4m3fn"),
    (lambda: ops.scaled_mm(quantized((4, 64), I8, 0), weight(64, 16, I8, "transposed"), None, None, None, None, None,
                           torch.int32, "torch"), "out_dtype must be one of"),
    (lambda: ops.scaled_mm(quantized((4, 64), I8, 0), quantized((2, 64, 16), I8, 1), None, None, None, None, None,
                           torch.float32, "torch"), "weight must be a \\[K, N\\] matrix"),
    (lambda: ops.scaled_mm(quantized((4, 64), I8, 0), weight(64, 16, I8, "transposed"), torch.ones(3, 1), None, None,
                           None, None, torch.float32, "torch"), "scale_a of shape \\(3, 1\\)"),
    (lambda: ops.scaled_mm(quantized((4, 64), I8, 0), weight(64, 16, I8, "transposed"), None, torch.ones(17), None,
                           None, None, torch.float32, "torch"), "scale_b of shape \\(17,\\)"),
    (lambda: ops.scaled_mm(quantized((4, 64), I8, 0), weight(64, 16, I8, "transposed"), None, None, torch.ones(15),
                           None, None, torch.float32, "torch"), "bias must have shape \\[16\\]"),
    (lambda: ops.scaled_mm(quantized((4, 64), I8, 0), weight(64, 16, I8, "transposed"), None, None, None,
                           torch.tensor(1.0), None, torch.float32, "torch"), "azp_a must be an integer zero point"),
    (lambda: ops.scaled_mm(quantized((4, 64), I8, 0), weight(64, 16, I8, "transposed"), None, None, None, None,
                           torch.ones(5, dtype=torch.int32), torch.float32, "torch"), "azp_b must have one value or 16"),
    (lambda: ops.quant_scaled_mm(quantized((4, 64), I8, 0), weight(64, 16, I8, "transposed"), None, None, None, I8,
                                 1e-6, torch.float32, "torch"), "activation must be floating point"),
    (lambda: ops.quant_scaled_mm(torch.randn(4, 64), weight(64, 16, I8, "transposed"), None, None, None, torch.uint8,
                                 1e-6, torch.float32, "torch"), "must be int8 or float8_e4m3fn"),
    (lambda: ops.quant_scaled_mm(torch.randn(4, 48), weight(64, 16, I8, "transposed"), None, None, None, I8,
                                 1e-6, torch.float32, "torch"), "activation has K=48"),
]


@pytest.mark.parametrize("call, message", BAD_CASES, ids=[message for _, message in BAD_CASES])
def test_bad_operands_raise_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def opcheck_utils(args):
    """opcheck's test_schema multiplies the inputs, which CPU torch cannot do for fp8: skip it there."""
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    has_fp8 = any(isinstance(arg, torch.Tensor) and arg.dtype == FP8 for arg in args)
    return utils[1:] if has_fp8 else utils


@pytest.mark.parametrize(
    "args",
    [
        (quantized((5, 64), I8, 0), weight(64, 24, I8, "transposed"), positive((5, 1), 1), positive((24,), 2),
         positive((24,), 3), None, torch.arange(24, dtype=torch.int32) % 3, torch.float32, "torch"),
        (quantized((2, 3, 64), FP8, 0), weight(64, 24, FP8, "contiguous"), torch.tensor(0.5), None, None, None, None,
         torch.bfloat16, "torch"),
        (quantized((3, 256), I8, 0), weight(256, 130, I8, "transposed"), positive((3, 2), 4), positive((2, 2), 5),
         None, torch.tensor(2, dtype=torch.int32), None, torch.float16, "reference"),
    ],
)
def test_opcheck_scaled_mm(args):
    torch.library.opcheck(ops.scaled_mm.default, args, test_utils=opcheck_utils(args))


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(5, 64), weight(64, 24, I8, "transposed"), None, positive((24,), 2), positive((24,), 3), I8, 1e-6,
         torch.float32, "torch"),
        (torch.randn(2, 3, 64, dtype=torch.bfloat16), weight(64, 24, FP8, "contiguous"), torch.tensor(0.05), None,
         None, FP8, 1e-6, torch.bfloat16, "reference"),
    ],
)
def test_opcheck_quant_scaled_mm(args):
    torch.library.opcheck(ops.quant_scaled_mm.default, args, test_utils=opcheck_utils(args))


@pytest.mark.parametrize("kernel", ["torch", "reference"])
def test_size_one_dims_with_any_stride(kernel):
    """Inductor gives a size-1 dim stride 0; CPU _int_mm (torch 2.13) misreads such a [1, K] row or
    [K, 1] column, so the torch kernel gives those dims their dense stride (torch_native.dense_unit_strides)."""
    a, w = quantized((1, 24), torch.int8, 0), quantized((1, 24), torch.int8, 1)
    row = a.as_strided((1, 24), (0, 1))
    column = w.as_strided((24, 1), (1, 0))
    out = ops.scaled_mm(row, column, None, None, None, None, None, torch.float32, kernel)
    torch.testing.assert_close(out, (a.double() @ w.double().t()).float())
