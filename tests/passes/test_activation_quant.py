"""activation_quant: for kernels that quantize internally, the quantize chain folds into
qfuse::quant_scaled_mm; for the others (torch) it stays in Inductor's generated code."""

import pytest
import torch

from tests.helpers import compile_and_run
from tests.passes.test_reference_linear import (
    assert_close,
    fp8_scaled_mm,
    fp8_weight,
    int_mm_linear,
    int_mm_static_float_scale,
    int_mm_static_tensor_scale_kn_weight,
    operands,
)

FOLDED = "qfuse.quant_scaled_mm.default"


@pytest.mark.parametrize("shape", [(1, 64), (17, 64), (2, 7, 64)], ids=["M1", "M17", "3D"])
@pytest.mark.parametrize("form", [int_mm_linear, fp8_scaled_mm, int_mm_static_float_scale,
                                  int_mm_static_tensor_scale_kn_weight], ids=lambda form: form.__name__)
def test_reference_kernel_folds_the_quantization(form, shape):
    if len(shape) == 3 and form in (int_mm_static_float_scale, int_mm_static_tensor_scale_kn_weight):
        pytest.skip("written for 2D inputs")
    x, w, w_scale, bias = operands(shape)
    if form is fp8_scaled_mm:
        w = fp8_weight(w)
    out, report = compile_and_run(form, x, w, w_scale, bias, kernel="reference")
    assert report.matches["activation quant folded into quant_scaled_mm"] == 1
    assert report.records[0].pattern.endswith(" + activation quant")
    assert report.ops_after[FOLDED] == 1 and report.ops_after["qfuse.scaled_mm.default"] == 0
    assert report.ops_after["aten.round.default"] == 0 and report.ops_after["aten.amax.default"] == 0
    assert_close(out, form(x, w, w_scale, bias))


def test_torch_kernel_leaves_the_quantization_to_inductor():
    x, w, w_scale, bias = operands((17, 64))
    _, report = compile_and_run(int_mm_linear, x, w, w_scale, bias, kernel="torch")
    assert report.ops_after[FOLDED] == 0 and report.ops_after["qfuse.scaled_mm.default"] == 1
    assert report.ops_after["aten.amax.default"] == 1


def scale_used_twice(x, w, w_scale, bias):
    s = x.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.clamp(torch.round(x / s), -128, 127).to(torch.int8)
    return torch._int_mm(q, w.t()).float() * s * w_scale, s * 2


def quantized_with_another_scale(x, w, w_scale, bias):
    s = x.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.clamp(torch.round(x / s), -128, 127).to(torch.int8)
    return torch._int_mm(q, w.t()).float() * (s * 2) * w_scale


@pytest.mark.parametrize("form, folds", [(scale_used_twice, True), (quantized_with_another_scale, False)])
def test_folding_only_when_the_scale_is_the_quantizers(form, folds):
    x, w, w_scale, bias = operands((9, 64))
    out, report = compile_and_run(form, x, w, w_scale, bias, kernel="reference")
    assert report.ops_after[FOLDED] == int(folds)
    expected = form(x, w, w_scale, bias)
    for got, want in zip(out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple) else (expected,)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def quantized_with_a_divisor_of_100(x, w, w_scale, bias):
    s = x.abs().amax(dim=-1, keepdim=True) / 100.0
    q = torch.clamp(torch.round(x / s), -128, 127).to(torch.int8)
    return torch._int_mm(q, w.t()).float() * s * w_scale


@pytest.mark.parametrize("form, reason", [
    (quantized_with_another_scale, "quantized with another scale than the one the GEMM rescales by"),
    (quantized_with_a_divisor_of_100, "the per-token scale is amax / 100.0, not amax / 127"),
])
def test_a_quantization_that_cannot_fold_says_why(form, reason):
    x, w, w_scale, bias = operands((9, 64))
    out, report = compile_and_run(form, x, w, w_scale, bias, kernel="reference")
    (record,) = report.records
    assert record.fused and report.ops_after[FOLDED] == 0
    assert "activation quant not folded: " in record.note and reason in record.note
    torch.testing.assert_close(out, form(x, w, w_scale, bias), rtol=1e-4, atol=1e-4)
