"""W4A8 (qfuse/passes/forms/w4a8.py): an int4 weight stored one value per int8 with group scales, whose
activation is a symmetric int8 fake quant per token, becomes `qfuse::w4a8_scaled_mm` on the graph's
own q and scale where a kernel runs it, and int4 weight-only (its fallback) elsewhere, saying why.

No machine here runs W4A8 (the `xpu` kernel needs an Intel GPU): on the CPU the linear falls back,
and the W4A8 rewrite itself is checked with the `reference` kernel forced. Covered: vLLM's scale
(amax / 127) and torchao's symmetric one (amax / 127.5), bf16 / fp32, 2D and 3D, M = 0 / 1 / odd, a
dynamic batch, bias or not, a static scale with a nan row; forms that stay weight-only, each with its reason.
"""

import pytest
import torch

import qfuse
from qfuse.ops.verify import tolerance_for
from qfuse.schemes import INT4_DTYPE, Granularity, QuantScheme
from tests.peers import weight_only_models as wo

BF16, FP32 = torch.bfloat16, torch.float32
W4A8_OP, INT4_OP = "qfuse.w4a8_scaled_mm.default", "qfuse.int4_weight_only_mm.default"
REFERENCE = {"kernel": "reference"}
W4A8_NOTE = " x int4 per-group-32, no kernel runs it"  # after "read as int8 dyn-token" (dyn-tensor at one row)


def w4a8(dtype, zero_points="none", bias=True, **options) -> wo.W4A8Linear:
    weight = wo.torchao_intx_int4(dtype, group_size=32, zero_points=zero_points, bias=bias)
    return wo.W4A8Linear(weight, **options).eval()


def assert_close_as_verify_mode(out, eager):
    """What `verify` mode accepts of a rewrite: a relative error (norm) within `tolerance_for`. Eager
    rounds the dequantized activation and weight to the model dtype before its float GEMM, the
    fused ops do not (W4A8 multiplies the integers exactly, the weight-only kernels dequantize in
    their own precision): in bf16 that is more than one output rounding."""
    assert out.dtype == eager.dtype and out.shape == eager.shape
    if eager.numel():
        scheme = QuantScheme(torch.int8, INT4_DTYPE, Granularity.PER_TOKEN, Granularity.PER_GROUP, dynamic=True,
                             weight_group_size=32)
        error = (out.double() - eager.double()).norm() / eager.double().norm()
        assert error <= tolerance_for(scheme, eager.dtype), error


def compiled_and_explained(model, x, options=None):
    with torch.no_grad():
        eager = model(x)
        out = torch.compile(model, backend="qfuse", options=options)(x)
        return eager, out, qfuse.explain(model, x, options=options)


SHAPES = [(1, 256), (5, 256), (2, 3, 256), (0, 256)]
SHAPE_IDS = ["M1", "M5", "3D", "M0"]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("divisor", [127.0, 127.5], ids=["vllm-scale", "torchao-scale"])
def test_with_the_reference_kernel_the_linear_is_w4a8_and_matches_eager(divisor, dtype, shape):
    model = w4a8(dtype, divisor=divisor, bias=shape != (1, 256))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    eager, out, explanation = compiled_and_explained(model, x, REFERENCE)
    assert_close_as_verify_mode(out, eager)
    (record,) = explanation.records
    activation = "dyn-tensor" if shape == (1, 256) else "dyn-token"  # one row: its [1, 1] scale is one value
    assert record.fused and record.kernel == "reference" and record.scheme == f"int8 {activation} x int4 per-group-32"
    assert record.pattern.startswith("fake quant (round, clamp) x int8-stored int4"), record
    report = explanation.reports[-1]
    assert report.ops_after[W4A8_OP] == 1 and report.ops_after.get(INT4_OP, 0) == 0


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_without_a_w4a8_kernel_the_linear_is_weight_only_and_says_why(dtype, shape):
    model = w4a8(dtype)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    eager, out, explanation = compiled_and_explained(model, x)
    assert_close_as_verify_mode(out, eager)
    (record,) = explanation.records
    assert explanation.reports[-1].ops_after.get(W4A8_OP, 0) == 0
    assert record.fused and record.scheme.endswith("x int4 per-group (weight-only)"), explanation
    assert W4A8_NOTE in record.note and "falls back to" in record.note, record.note


def test_a_dynamic_batch_compiles_once_and_stays_w4a8():
    model = w4a8(BF16)
    compiled = torch.compile(model, backend="qfuse", dynamic=True, options=REFERENCE)
    marker = qfuse.graphs_compiled()
    with torch.no_grad():
        for rows in (2, 7, 33):
            x = torch.randn(rows, 256).to(BF16)
            assert_close_as_verify_mode(compiled(x), model(x))
    (report,) = qfuse.reports_since(marker)
    assert report.ops_after[W4A8_OP] == 1 and report.fused and not report.near_misses


@pytest.mark.parametrize("model, note", [
    (lambda: w4a8(BF16, zero_points="zero"), "the weight subtracts stored zero points; W4A8 kernels take symmetric int4"),
    (lambda: w4a8(BF16, activation_zero_point=True), "the activation is a fake quant W4A8 kernels cannot take (the "
                                                      "activation's zero point is a torch.bfloat16 tensor"),
], ids=["weight-zero-points", "asymmetric-activation"])
def test_forms_that_stay_weight_only_say_why(model, note):
    model = model()
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(5)).to(BF16)
    eager, out, explanation = compiled_and_explained(model, x, REFERENCE)
    assert_close_as_verify_mode(out, eager)
    (record,) = explanation.records
    assert record.fused and record.scheme == "bf16 x int4 per-group (weight-only)" and note in record.note, record


def test_a_static_scale_keeps_eagers_nan_rows():
    """A static activation scale carries no nan: the rows of the fake quant's q that hold one (clamp keeps it)
    multiply the fused op's output by nan, as eager's float linear of q * s propagates it."""
    model = w4a8(FP32, static_scale=0.02)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6))
    x[2, 17] = float("nan")
    x[1, 3] = float("inf")  # clamped to 127: a finite row in eager
    eager, out, explanation = compiled_and_explained(model, x, REFERENCE)
    (record,) = explanation.records
    assert record.scheme == "int8 static-tensor x int4 per-group-32", record
    assert torch.equal(out.isnan(), eager.isnan()) and eager[2].isnan().all() and eager[1].isfinite().all()
    finite = eager.isfinite()
    assert_close_as_verify_mode(out[finite].reshape(3, -1), eager[finite].reshape(3, -1))
