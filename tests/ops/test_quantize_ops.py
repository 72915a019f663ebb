"""Tests for the quantize ops: `qfuse::dynamic_quant`, `dynamic_quant_asymmetric`, `static_quant`.

Numerics are checked against straightforward torch formulas written here (not qfuse's
`reference_math`), plus a dequantize round-trip bound; shapes and dtypes of q / scale / zero
point; ValueErrors on bad input; and `torch.library.opcheck` on representative argument sets.
CPU only.
"""

import pytest
import torch

import qfuse  # noqa: F401  (registers torch.ops.qfuse.*)

ops = torch.ops.qfuse
FP8 = torch.float8_e4m3fn
QMIN_QMAX = {torch.int8: (-128.0, 127.0), torch.uint8: (0.0, 255.0), FP8: (-448.0, 448.0)}
SHAPES = [(5, 256), (2, 3, 384), (1, 128)]


def make_input(shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 3
    return x.to(dtype)


def expected_symmetric(x, quant_dtype, granularity, eps):
    """amax per tensor / token / 128-group, scale = max(amax, eps) / qmax, q = quantize(x / scale)."""
    qmin, qmax = QMIN_QMAX[quant_dtype]
    if granularity == "per_tensor":
        amax = x.abs().max()
    elif granularity == "per_token":
        amax = x.abs().amax(dim=-1, keepdim=True)
    else:
        amax = x.reshape(*x.shape[:-1], x.shape[-1] // 128, 128).abs().amax(dim=-1)
    scale = torch.clamp(amax, min=eps) / qmax
    full = scale.unsqueeze(-1).expand(*scale.shape, 128).reshape(x.shape) if granularity == "per_group" else scale
    scaled = x / full
    if quant_dtype == FP8:
        return scaled.clamp(qmin, qmax).to(FP8), scale, full
    return scaled.round().clamp(qmin, qmax).to(quant_dtype), scale, full


def expected_asymmetric(x, quant_dtype, granularity, eps):
    qmin, qmax = QMIN_QMAX[quant_dtype]
    if granularity == "per_tensor":
        low, high = torch.clamp(x.min(), max=0), torch.clamp(x.max(), min=0)
    else:
        low = torch.clamp(x.amin(dim=-1, keepdim=True), max=0)
        high = torch.clamp(x.amax(dim=-1, keepdim=True), min=0)
    scale = torch.clamp(high - low, min=eps) / (qmax - qmin)
    zero_point = torch.clamp(qmin - torch.round(low / scale), qmin, qmax).to(torch.int32)
    q = torch.clamp(torch.round(x / scale) + zero_point, qmin, qmax).to(quant_dtype)
    return q, scale, zero_point


def expected_scale_shape(shape, granularity):
    return {"per_tensor": (), "per_token": (*shape[:-1], 1), "per_group": (*shape[:-1], shape[-1] // 128)}[granularity]


def assert_same_quantized(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.to(torch.float32), expected.to(torch.float32))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity", ["per_tensor", "per_token", "per_group"])
@pytest.mark.parametrize("quant_dtype", [torch.int8, FP8])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_dynamic_quant_matches_formula(shape, granularity, quant_dtype, x_dtype):
    x = make_input(shape, x_dtype)
    q, scale = ops.dynamic_quant(x, quant_dtype, granularity, 1e-6, "reference")
    want_q, want_scale, full_scale = expected_symmetric(x, quant_dtype, granularity, 1e-6)
    assert scale.dtype == x_dtype and tuple(scale.shape) == expected_scale_shape(shape, granularity)
    assert torch.equal(scale, want_scale)
    assert_same_quantized(q, want_q)
    # Round trip: int8 within half a step, fp8 (3 mantissa bits) within 1/16 relative (+ subnormal
    # spacing), plus the rounding of x / scale in x's dtype.
    error = (q.to(torch.float64) * full_scale.double() - x.double()).abs()
    step, magnitude = full_scale.double(), x.double().abs()
    division = magnitude * 2 * torch.finfo(x_dtype).eps
    bound = step * 0.5 if quant_dtype == torch.int8 else magnitude / 16 + step * 2.0**-9
    assert bool((error <= bound + division + 1e-12).all())
    # The largest |x| lands on qmax (up to the rounding of the scale in x's dtype).
    qmax, largest = QMIN_QMAX[quant_dtype][1], q.to(torch.float32).abs().max().item()
    assert qmax * (1 - 2 * torch.finfo(x_dtype).eps) - 0.5 <= largest <= qmax


@pytest.mark.parametrize("quant_dtype", [torch.int8, FP8])
def test_dynamic_quant_eps_and_zero_rows(quant_dtype):
    x = make_input((4, 256))
    x[1] = 0.0
    x[2] = 1e-9
    q, scale = ops.dynamic_quant(x, quant_dtype, "per_token", 1e-3, "torch")
    qmax = QMIN_QMAX[quant_dtype][1]
    assert scale[1].item() == pytest.approx(1e-3 / qmax) and scale[2].item() == pytest.approx(1e-3 / qmax)
    assert torch.isfinite(scale).all()
    assert torch.equal(q[1:3].to(torch.float32), torch.zeros(2, 256))
    assert scale[0].item() == pytest.approx(x[0].abs().max().item() / qmax)


def test_dynamic_quant_per_group_all_zero_group():
    x = make_input((2, 256))
    x[0, 128:] = 0.0
    q, scale = ops.dynamic_quant(x, torch.int8, "per_group", 1e-5, "reference")
    assert scale.shape == (2, 2)
    assert scale[0, 1].item() == pytest.approx(1e-5 / 127)
    assert not q[0, 128:].any()
    assert scale[0, 0].item() == pytest.approx(x[0, :128].abs().max().item() / 127)


@pytest.mark.parametrize("shape", [(6, 40), (2, 3, 17)])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_token"])
@pytest.mark.parametrize("quant_dtype", [torch.int8, torch.uint8])
def test_dynamic_quant_asymmetric_matches_formula(shape, granularity, quant_dtype):
    x = make_input(shape) + 1.0  # skewed, so the zero point is not the midpoint
    q, scale, zero_point = ops.dynamic_quant_asymmetric(x, quant_dtype, granularity, 1e-6, "reference")
    want_q, want_scale, want_zero_point = expected_asymmetric(x, quant_dtype, granularity, 1e-6)
    assert tuple(scale.shape) == tuple(zero_point.shape) == expected_scale_shape(shape, granularity)
    assert scale.dtype == torch.float32 and zero_point.dtype == torch.int32
    assert torch.equal(scale, want_scale) and torch.equal(zero_point, want_zero_point)
    assert_same_quantized(q, want_q)
    dequantized = (q.to(torch.float64) - zero_point.double()) * scale.double()
    assert bool(((dequantized - x.double()).abs() <= scale.double() * 0.51).all())


def test_dynamic_quant_asymmetric_all_positive_and_zero_rows():
    x = torch.stack([torch.linspace(0.5, 2.0, 64), torch.zeros(64)])
    q, scale, zero_point = ops.dynamic_quant_asymmetric(x, torch.uint8, "per_token", 1e-4, "torch")
    # low is clamped to 0, so the zero point is qmin and 0.0 is exactly representable.
    assert zero_point.flatten().tolist() == [0, 0]
    assert scale[0].item() == pytest.approx(2.0 / 255)
    assert scale[1].item() == pytest.approx(1e-4 / 255)
    assert q[0, -1].item() == 255 and not q[1].any()


@pytest.mark.parametrize(
    "x_shape, scale, zero_point, quant_dtype",
    [
        ((4, 32), torch.tensor(0.05), None, torch.int8),
        ((4, 32), torch.tensor([0.05]), None, FP8),
        ((4, 32), torch.linspace(0.01, 0.1, 4).reshape(4, 1), None, torch.int8),
        ((2, 3, 32), torch.linspace(0.01, 0.06, 6).reshape(2, 3, 1), None, torch.int8),
        ((2, 3, 32), torch.tensor(0.02), torch.tensor(128, dtype=torch.int32), torch.uint8),
        ((4, 32), torch.tensor(0.03), torch.full((4, 1), -5, dtype=torch.int32), torch.int8),
    ],
)
def test_static_quant_matches_formula(x_shape, scale, zero_point, quant_dtype):
    x = make_input(x_shape)
    q = ops.static_quant(x, scale, zero_point, quant_dtype, "reference")
    qmin, qmax = QMIN_QMAX[quant_dtype]
    if quant_dtype == FP8:
        want = (x / scale).clamp(qmin, qmax).to(FP8)
    else:
        shifted = torch.round(x / scale) + (0 if zero_point is None else zero_point)
        want = shifted.clamp(qmin, qmax).to(quant_dtype)
    assert_same_quantized(q, want)
    if quant_dtype == torch.int8:
        assert {q.min().item(), q.max().item()} & {-128, 127}  # the scale is small enough to saturate


BAD_INPUT_CASES = [
    (lambda x: ops.dynamic_quant(x, torch.int8, "per_channel", 1e-6, "reference"), "granularity must be one of"),
    (lambda x: ops.dynamic_quant(x.half(), torch.int8, "per_token", 1e-6, "reference", torch.bfloat16),
     "scale_dtype must be x's dtype or a wider float"),
    (lambda x: ops.silu_mul_quant(x, x[:, :8], torch.int8, 1e-6, "reference"), "one shape"),
    (lambda x: ops.dynamic_quant(x, torch.int8, "token", 1e-6, "reference"), "got 'token'"),
    (lambda x: ops.dynamic_quant(x.to(torch.int32), torch.int8, "per_token", 1e-6, "reference"),
     "input must be floating point"),
    (lambda x: ops.dynamic_quant(x[:, :200], torch.int8, "per_group", 1e-6, "reference"),
     "multiple of 128, got 200"),
    (lambda x: ops.dynamic_quant(x, torch.uint8, "per_token", 1e-6, "reference"), "quant_dtype must be one of"),
    (lambda x: ops.dynamic_quant(x, torch.float16, "per_token", 1e-6, "reference"), "quant_dtype must be one of"),
    (lambda x: ops.dynamic_quant_asymmetric(x, FP8, "per_token", 1e-6, "reference"), "quant_dtype must be one of"),
    (lambda x: ops.dynamic_quant_asymmetric(x, torch.int8, "per_group", 1e-6, "reference"),
     "per_group is not supported; use per_tensor or per_token"),
    (lambda x: ops.dynamic_quant_asymmetric(x.to(torch.int8), torch.int8, "per_token", 1e-6, "reference"),
     "input must be floating point"),
    (lambda x: ops.static_quant(x, torch.ones(3), None, torch.int8, "reference"), "does not broadcast"),
    (lambda x: ops.static_quant(x, torch.ones(4, 2), None, torch.int8, "reference"), "does not broadcast"),
    (lambda x: ops.static_quant(x, torch.tensor(0.1), torch.ones(5, 1, dtype=torch.int32), torch.uint8,
                                "reference"), "zero_point of shape"),
    (lambda x: ops.static_quant(x.to(torch.int8), torch.tensor(0.1), None, torch.int8, "reference"),
     "input must be floating point"),
    (lambda x: ops.static_quant(x, torch.tensor(0.1), None, torch.int32, "reference"), "quant_dtype must be one of"),
]


@pytest.mark.parametrize("call, message", BAD_INPUT_CASES, ids=[message for _, message in BAD_INPUT_CASES])
def test_bad_input_raises_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(make_input((4, 256)))


def test_static_quant_scale_with_extra_dims_keeps_shape():
    x = make_input((4, 8))
    try:
        q = ops.static_quant(x, torch.full((1, 1, 1), 0.1), None, torch.int8, "reference")
    except ValueError:
        return
    assert q.shape == x.shape


def test_static_quant_fp8_rejects_zero_point():
    with pytest.raises(ValueError, match="zero"):
        ops.static_quant(make_input((4, 8)), torch.tensor(0.1), torch.tensor(3), FP8, "reference")


@pytest.mark.parametrize(
    "args",
    [
        (make_input((5, 256)), torch.int8, "per_token", 1e-6, "reference"),
        (make_input((2, 3, 256), torch.bfloat16), FP8, "per_group", 1e-6, "torch"),
        (make_input((2, 3, 64)), torch.int8, "per_tensor", 1e-6, "reference"),
    ],
)
def test_opcheck_dynamic_quant(args):
    torch.library.opcheck(ops.dynamic_quant.default, args)


@pytest.mark.parametrize(
    "args",
    [
        (make_input((5, 64)), torch.uint8, "per_token", 1e-6, "reference"),
        (make_input((2, 3, 64)), torch.int8, "per_tensor", 1e-6, "torch"),
    ],
)
def test_opcheck_dynamic_quant_asymmetric(args):
    torch.library.opcheck(ops.dynamic_quant_asymmetric.default, args)


@pytest.mark.parametrize(
    "args",
    [
        (make_input((5, 64)), torch.tensor(0.05), None, torch.int8, "reference"),
        (make_input((2, 3, 64)), torch.full((2, 3, 1), 0.02), None, FP8, "torch"),
        (make_input((4, 64)), torch.tensor(0.02), torch.tensor(128, dtype=torch.int32), torch.uint8, "reference"),
    ],
)
def test_opcheck_static_quant(args):
    torch.library.opcheck(ops.static_quant.default, args)
