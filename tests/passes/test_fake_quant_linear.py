"""fake_quant_linear: float linears of fake-quantized operands (QAT, compressed-tensors, hand-written
QDQ in plain torch) become a real int8 / fp8 qfuse::scaled_mm, and match eager."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import FLOAT_WRITTEN_INT8, compile_and_run

FP8 = torch.float8_e4m3fn
K, N = 64, 48


def stored_weight(seed=0):
    generator = torch.Generator().manual_seed(seed)
    w_int = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
    w_scale = torch.rand(N, 1, generator=generator) * 0.01 + 0.001
    return w_int, w_scale, torch.randn(N, generator=generator)


def issue_form(x, w_int, w_scale, bias, s=0.05, zp=3):
    """x̂ = (clamp(round(x / s) + zp) - zp) * s, ŵ = w_int.float() * w_s, F.linear(x̂, ŵ)."""
    x_hat = (torch.clamp(torch.round(x / s) + zp, -128, 127) - zp) * s
    return F.linear(x_hat, w_int.float() * w_scale, bias)


def dynamic_per_token(x, w_int, w_scale, bias):
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-6) / 127
    x_hat = torch.clamp(torch.round(x / s), -127, 127) * s
    return F.linear(x_hat, w_int.float() * w_scale, bias)


def clamp_before_round_with_tensor_bounds(x, w_int, w_scale, bias):
    """compressed-tensors' spelling: divide, clamp with 0-dim tensor bounds, then round."""
    s = x.abs().amax() / 127.5
    low, high = torch.tensor(-128.0), torch.tensor(127.0)
    x_hat = torch.round(torch.clamp(x / s, low, high)) * s
    return F.linear(x_hat, w_int.float() * w_scale, bias)


def weight_fake_quantized_each_call(x, w_int, w_scale, bias):
    """Both operands fake-quantized from float (a QAT / compressed-tensors 'qdq' state)."""
    w = w_int.float() * w_scale + 1e-4
    w_hat = torch.round(torch.clamp(w / w_scale, -128, 127)) * w_scale
    s = x.abs().amax(-1, keepdim=True) / 127
    x_hat = torch.round(torch.clamp(x / s, -128, 127)) * s
    return F.linear(x_hat, w_hat, bias)


def uint8_activation(x, w_int, w_scale, bias):
    s, zp = 0.03, 128
    x_hat = (torch.clamp(torch.round(x / s) + zp, 0, 255) - zp) * s
    return F.linear(x_hat, w_int.float() * w_scale, bias)


def fp8_round_trip(x, w_int, w_scale, bias):
    s = x.abs().amax(-1, keepdim=True) / 448
    x_hat = (x / s).clamp(-448, 448).to(FP8).to(x.dtype) * s
    w_fp8 = (w_int.float() * 3).to(FP8)
    return F.linear(x_hat, w_fp8.to(x.dtype) * w_scale, bias)


FORMS = {
    issue_form: "int8 static-tensor asym x per-channel",
    dynamic_per_token: "int8 dyn-token x per-channel",
    clamp_before_round_with_tensor_bounds: "int8 dyn-tensor x per-channel",
    weight_fake_quantized_each_call: "int8 dyn-token x per-channel",
    uint8_activation: "int8 static-tensor x per-channel",  # zero point 128: symmetric once shifted to int8
    fp8_round_trip: "fp8 dyn-token x per-channel",
}


@pytest.mark.parametrize("shape", [(1, K), (9, K), (2, 5, K)], ids=["M1", "M9", "3D"])
@pytest.mark.parametrize("form", list(FORMS), ids=lambda form: form.__name__)
def test_fake_quant_linear_fuses_and_matches_eager(form, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    w_int, w_scale, bias = stored_weight()
    with torch.no_grad():
        out, report = compile_and_run(form, x, w_int, w_scale, bias, **FLOAT_WRITTEN_INT8)
        expected = form(x, w_int, w_scale, bias)
    (record,) = report.records
    assert record.fused and record.family == "fake_quant_linear", record.reason
    if shape[0] != 1 or len(shape) == 3:
        assert record.scheme == FORMS[form]
    assert report.ops_after["aten.addmm.default"] + report.ops_after["aten.mm.default"] == 0
    tolerance = 2e-2 if form is fp8_round_trip else 1e-4
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("shape", [(1, K), (9, K), (2, 5, K)], ids=["M1", "M9", "3D"])
def test_a_bf16_fake_quant_is_matched_through_inductors_float32_clamp(shape):
    """In bf16 Inductor rounds in bf16, clamps in float32 and casts back: the values are still
    integers in int8's range, and the linear is int8 W8A8 (within verify mode's 1e-2 of eager, which
    rounds the dequantized operands to bf16 before its GEMM)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w_int, w_scale, bias = stored_weight()
    w_scale, bias = w_scale.to(torch.bfloat16), bias.to(torch.bfloat16)

    def bf16_dynamic_per_token(x, w_int, w_scale, bias):
        s = x.abs().amax(-1, keepdim=True).clamp(min=1e-5) / 127
        return F.linear(torch.clamp(torch.round(x / s), -128, 127) * s, w_int.to(x.dtype) * w_scale, bias)

    with torch.no_grad():
        out, report = compile_and_run(bf16_dynamic_per_token, x, w_int, w_scale, bias, **FLOAT_WRITTEN_INT8)
        expected = bf16_dynamic_per_token(x, w_int, w_scale, bias)
    (record,) = report.records
    assert record.fused and record.family == "fake_quant_linear", record
    assert record.scheme == ("int8 dyn-tensor x per-channel" if shape[0] == 1 else "int8 dyn-token x per-channel")
    error = (out.double() - expected.double()).norm() / expected.double().norm()
    assert error < 1e-2, error


def test_an_fp8_cast_of_the_integers_is_not_taken_as_exact():
    """fp8 rounds int8's integers (e4m3 turns 127 into 128, e5m2 keeps 2 mantissa bits): a fake quant
    cast through fp8 is no int8 activation, and must not fuse as one."""
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(1))
    w_int, w_scale, bias = stored_weight()

    def through_e5m2(x, w_int, w_scale, bias):
        s = x.abs().amax(-1, keepdim=True) / 127
        q = torch.clamp(torch.round(x / s), -128, 127).to(torch.float8_e5m2).to(x.dtype)
        return F.linear(q * s, w_int.float() * w_scale, bias)

    with torch.no_grad():
        out, report = compile_and_run(through_e5m2, x, w_int, w_scale, bias)
        expected = through_e5m2(x, w_int, w_scale, bias)
    assert all(not record.scheme.startswith("int8 dyn") for record in report.records if record.fused), report.records
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_a_weight_quantized_each_call_skips_kernels_that_repack():
    x = torch.randn(9, K)
    w_int, w_scale, bias = stored_weight()
    with torch.no_grad():
        _, report = compile_and_run(weight_fake_quantized_each_call, x, w_int, w_scale, bias, **FLOAT_WRITTEN_INT8)
    (record,) = report.records
    assert record.kernel == "torch"
    from qfuse.kernels import get_kernel
    from qfuse.platform import current_platform

    if get_kernel("onednn").is_supported(current_platform("cpu"))[0]:
        assert "quantized anew on every call" in record.rejected_kernels["onednn"], record.rejected_kernels


def round_without_clamp(x, w_int, w_scale, bias):
    return F.linear(torch.round(x / 0.05) * 0.05, w_int.float() * w_scale, bias)


def fractional_bounds(x, w_int, w_scale, bias):
    return F.linear(torch.clamp(torch.round(x / 0.05), -100.5, 100.5) * 0.05, w_int.float() * w_scale, bias)


def weight_only(x, w_int, w_scale, bias):
    return F.linear(x, w_int.float() * w_scale, bias)


def scale_along_k(x, w_int, w_scale, bias):
    s = torch.arange(K) / K + 0.5
    return F.linear(torch.clamp(torch.round(x / s), -128, 127) * s, w_int.float() * w_scale, bias)


NOT_PROVABLY_INT8 = "the activation is rounded like a fake quant, but not provably into int8"


def compile_unfused(form):
    """(out, eager out, the fake_quant_linear record) of `form` compiled on a [9, K] input: no
    qfuse::scaled_mm may come out of it."""
    x = torch.randn(9, K)
    w_int, w_scale, bias = stored_weight()
    with torch.no_grad():
        out, report = compile_and_run(form, x, w_int, w_scale, bias)
        expected = form(x, w_int, w_scale, bias)
    assert report.ops_after["qfuse.scaled_mm.default"] == 0
    (record,) = [record for record in report.records if record.family == "fake_quant_linear"]
    return out, expected, record


@pytest.mark.parametrize("form, note", [
    (round_without_clamp, NOT_PROVABLY_INT8),  # the values may leave int8
    (fractional_bounds, NOT_PROVABLY_INT8),
    (weight_only, ""),
], ids=lambda value: getattr(value, "__name__", "note"))
def test_a_float_activation_is_recognised_as_weight_only(form, note):
    """An int8 weight and an activation that is not provably int8: a weight-only linear (W8A16). On CPU
    no kernel takes an fp32 one (int8pack is slower than Inductor there), and the record says so."""
    out, expected, record = compile_unfused(form)
    assert record.scheme == "fp32 x int8 per-channel (weight-only)", record
    assert not record.fused and record.reason.startswith("no kernel can run it"), record
    assert note in record.note
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_a_scale_along_k_is_left_alone():
    """A scale per K cannot leave the GEMM."""
    out, expected, record = compile_unfused(scale_along_k)
    assert not record.fused and "dequantized per channel along axis 1, not per token" in record.reason
    torch.testing.assert_close(out, expected)
