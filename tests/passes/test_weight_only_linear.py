"""Weight-only int8 linears (W8A16, a float activation) as model code writes them -> qfuse::weight_only_scaled_mm.

Two spellings, both common (docs/forms.md, "Weight-only forms"): the weight dequantized before the
linear (`F.linear(x, w.to(x.dtype) * s[:, None])`, recognised by `fake_quant_linear`) and the scale
applied after it (`(x @ w.t().to(x.dtype)) * s`, torchao's int8 weight-only fallback, recognised by
`reference_linear`). On CPU the torch kernel runs them on aten._weight_int8pack_mm, inside Inductor's
code, for bf16 activations with K a multiple of 16 (fp32 ran 4x slower than Inductor's own code at
M = 16, benchmarks/cpu_weight_only.py; torch 2.13's bf16 kernel crashes on other K): the rest is
recognised and reported with the reason. Checked against eager on odd shapes (M = 0, 1, 17, K = 1,
3D), with dynamic M (one compile per side of the 64-row bound), and with forms that must not be rewritten.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import compile_and_run, outputs_and_code_per_call

N = 48
WEIGHT_ONLY_OP = "qfuse.weight_only_scaled_mm.default"


def operands(shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = torch.randn(shape, generator=generator).to(dtype)
    w = torch.randint(-128, 128, (N, k), dtype=torch.int8, generator=generator)
    scale = (torch.rand(N, generator=generator) * 0.02 + 0.001).to(dtype)
    bias = torch.randn(N, generator=generator).to(dtype)
    return x, w, scale, bias


def dequantized_weight(x, w, scale, bias):
    return F.linear(x, w.to(x.dtype) * scale[:, None], bias)


def scale_after_the_matmul(x, w, scale, bias):
    return (x @ w.t().to(x.dtype)) * scale + bias


def per_tensor_scale(x, w, scale, bias):
    return F.linear(x, w.to(x.dtype) * 0.01, bias)


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("form, family", [
    (dequantized_weight, "fake_quant_linear"),
    (scale_after_the_matmul, "reference_linear"),
    (per_tensor_scale, "fake_quant_linear"),
], ids=lambda value: getattr(value, "__name__", value))
@pytest.mark.parametrize("shape", [(5, 64), (1, 64), (17, 64), (0, 64), (9, 1), (7, 40), (2, 3, 64), (100, 64)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_only_linears_fuse_and_match_eager(form, family, shape, dtype):
    if form is scale_after_the_matmul and dtype == torch.bfloat16 and shape[-1] % 16:
        pytest.skip("plain torch.compile crashes here (torch 2.13): Inductor's own weight-only pattern takes this "
                    "form before qfuse runs and calls the bf16 _weight_int8pack_mm, which segfaults when K % 16 != 0")
    args = operands(shape, dtype)
    with torch.no_grad():
        out, report = compile_and_run(form, *args)
        expected = form(*args)
    kind = "per-tensor" if form is per_tensor_scale else "per-channel"
    records = [record for record in report.records if record.family == family]
    if dtype == torch.bfloat16 and form is scale_after_the_matmul and not records:
        assert report.inductor_quantized, report.table()  # Inductor's own weight-only pattern took it first
    elif dtype == torch.bfloat16 and shape[-1] % 16 == 0:
        (record,) = records
        assert record.fused and record.scheme == f"bf16 x int8 {kind} (weight-only)", report.table()
        prefill = "dequantize + bf16 mm (M > 64" in record.lowered  # above 64 rows: faster than int8pack
        assert record.kernel == "torch" and ("_weight_int8pack_mm" in record.lowered or prefill), report.table()
        assert prefill == (expected.numel() // N > 64)
        assert report.ops_after[WEIGHT_ONLY_OP] == 1
    else:  # recognised, but no CPU kernel takes it: fp32 (slower than Inductor at M = 16), bf16 with K % 16
        (record,) = records
        assert not record.fused and record.scheme.endswith(f"x int8 {kind} (weight-only)"), report.table()
        assert record.reason.startswith("no kernel can run it") and report.ops_after[WEIGHT_ONLY_OP] == 0
    assert out.shape == expected.shape and out.dtype == expected.dtype
    tolerance = TOLERANCE[dtype] * max(1.0, expected.float().abs().max().item() if expected.numel() else 1.0)
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOLERANCE[dtype], atol=tolerance)


def test_dynamic_m_compiles_once_per_m_bucket():
    """A dynamic M is guarded on the 64-row bound (`qfuse.lowerings.ir.rows_at_most`): M <= 64 gets
    code with _weight_int8pack_mm, M > 64 code with Inductor's dequantize + bf16 mm, each compiled once;
    neither calls the op (no Python per call)."""
    args = operands((5, 64), torch.bfloat16)
    compiled = torch.compile(dequantized_weight, backend="qfuse")
    calls = [(torch.randn(rows, 64).to(torch.bfloat16), *args[1:]) for rows in (5, 100, 33, 2, 200)]
    torch._dynamo.mark_dynamic(calls[0][0], 0)  # M only: a dynamic weight size is not fused
    with torch.no_grad():
        results = outputs_and_code_per_call(compiled, calls)
    for (out, _), call in zip(results, calls):
        expected = dequantized_weight(*call).float()
        torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())
    codes = [code for _, code in results]
    assert [bool(code) for code in codes] == [True, True, False, False, False]  # one compile per bucket
    assert "_weight_int8pack_mm" in codes[0] and "_weight_int8pack_mm" not in codes[1]
    assert not any(f"torch.ops.{WEIGHT_ONLY_OP}(" in code for code in codes)


def test_an_unbacked_m_takes_the_path_that_is_right_at_any_m():
    """No hint, no guard (`rows_at_most`): an unbacked M counts as large, Inductor's dequantize + mm,
    compiled once for every M."""
    args = operands((5, 64), torch.bfloat16)
    compiled = torch.compile(dequantized_weight, backend="qfuse")
    calls = [(torch.randn(rows, 64).to(torch.bfloat16), *args[1:]) for rows in (5, 100, 3)]
    torch._dynamo.decorators.mark_unbacked(calls[0][0], 0)
    with torch.no_grad():
        results = outputs_and_code_per_call(compiled, calls)
    for (out, _), call in zip(results, calls):
        expected = dequantized_weight(*call).float()
        torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2 * expected.abs().max().item())
    assert [bool(code) for _, code in results] == [True, False, False]
    assert "extern_kernels.mm(" in results[0][1] and "_weight_int8pack_mm" not in results[0][1]


def scale_per_row_of_the_activation(x, w, scale, bias):
    return (x @ w.t().to(x.dtype)) * x.abs().amax(dim=-1, keepdim=True)


def no_scale(x, w, scale, bias):
    return x @ w.t().to(x.dtype)


@pytest.mark.parametrize("form, reason", [
    (scale_per_row_of_the_activation, "a factor scales the rows of the float activation"),
    (no_scale, "no dequantize scale is applied to its output"),
], ids=lambda value: getattr(value, "__name__", "reason"))
def test_forms_that_are_not_a_weight_only_linear_are_left_alone(form, reason):
    args = operands((5, 64), torch.float32)
    with torch.no_grad():
        out, report = compile_and_run(form, *args)
        expected = form(*args)
    assert report.ops_after[WEIGHT_ONLY_OP] == 0
    (record,) = [record for record in report.records if record.family == "reference_linear"]
    assert not record.fused and reason in record.reason, report.table()
    torch.testing.assert_close(out, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_no_kernel_takes_it_yet_and_the_graph_is_untouched():
    args = [tensor.cuda() for tensor in operands((5, 64), torch.bfloat16)]
    with torch.no_grad():
        out, report = compile_and_run(dequantized_weight, *args)
        expected = dequantized_weight(*args)
    (record,) = report.records
    assert not record.fused and record.reason.startswith("no kernel can run it"), report.table()
    torch.testing.assert_close(out, expected)
