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

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import qfuse
from qfuse.config import pass_skipping_caches_off
from qfuse.platform import current_platform
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


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@pytest.mark.parametrize("form, family", [
    (dequantized_weight, "fake_quant_linear"),
    (scale_after_the_matmul, "reference_linear"),
    (per_tensor_scale, "fake_quant_linear"),
], ids=lambda value: getattr(value, "__name__", value))
@pytest.mark.parametrize("shape", [(5, 64), (1, 64), (17, 64), (0, 64), (9, 1), (7, 40), (2, 3, 64), (100, 64)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_weight_only_linears_fuse_and_match_eager(form, family, shape, dtype):
    # bf16 scale-after: Inductor's own weight-only pattern takes it first (`woq_int8`, whose bf16
    # _weight_int8pack_mm segfaults at K % 16 != 0 in plain torch.compile); qfuse takes it back
    args = operands(shape, dtype)
    with torch.no_grad():
        out, report = compile_and_run(form, *args)
        expected = form(*args)
    kind = "per-tensor" if form is per_tensor_scale else "per-channel"
    records = [record for record in report.records if record.family == family]
    assert not report.inductor_quantized, report.table()
    if dtype == torch.bfloat16 and shape[-1] % 16 == 0:
        (record,) = records
        assert record.fused and record.scheme == f"bf16 x int8 {kind} (weight-only)", report.table()
        prefill = "dequantize + mm (M > 64" in record.lowered  # above 64 rows: faster than int8pack
        assert record.kernel == "torch" and ("_weight_int8pack_mm" in record.lowered or prefill), report.table()
        assert prefill == (expected.numel() // N > 64)
        assert report.ops_after[WEIGHT_ONLY_OP] == 1
    else:  # recognised, but no CPU kernel takes it: fp32 (slower than Inductor at M = 16), fp16, bf16 with K % 16
        (record,) = records
        assert not record.fused and record.scheme.endswith(f"x int8 {kind} (weight-only)"), report.table()
        assert record.reason.startswith("no kernel can run it") and report.ops_after[WEIGHT_ONLY_OP] == 0
    assert out.shape == expected.shape and out.dtype == expected.dtype
    tolerance = TOLERANCE[dtype] * max(1.0, expected.float().abs().max().item() if expected.numel() else 1.0)
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOLERANCE[dtype], atol=tolerance)


@pytest.mark.parametrize("bf16_dot_products", [True, False], ids=["bf16-cpu", "no-bf16-cpu"])
def test_prefill_multiplies_in_float32_where_the_cpu_has_no_bf16_dot_products(monkeypatch, bf16_dot_products):
    """Above 64 rows the weight is dequantized (rounded to bf16, as the op's math) and multiplied in bf16, or, on a
    CPU without bf16 dot products (where a bf16 mm is emulated, several times slower), upcast to float32: the same
    products, exact in float32, and the same float32 sums."""
    from qfuse.lowerings import torch_native

    cpu = dataclasses.replace(current_platform("cpu"), cpu_has_avx512_bf16=bf16_dot_products, cpu_has_amx=False)
    monkeypatch.setattr(torch_native, "current_platform", lambda device_type: cpu if device_type == "cpu" else
                        current_platform(device_type))
    args = operands((100, 64), torch.bfloat16)
    marker = qfuse.graphs_compiled()
    with torch.no_grad(), pass_skipping_caches_off():
        out, (code,) = run_and_get_code(torch.compile(dequantized_weight, backend="qfuse"), *args)
        expected = dequantized_weight(*args)
    (record,) = qfuse.reports_since(marker)[-1].records
    assert record.lowered.endswith(" in bf16" if bf16_dot_products else "where a bf16 mm is emulated"), record.lowered
    (mm_output,) = re.findall(r"extern_kernels\.mm\(.*out=(buf\d+)\)", code)
    dtype = re.search(rf"{mm_output} = empty_strided_cpu\(.*?(torch\.\w+)\)", code).group(1)
    assert dtype == ("torch.bfloat16" if bf16_dot_products else "torch.float32"), code
    torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2 * expected.abs().max().item())


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
    (scale_per_row_of_the_activation, "is computed from the activation's inputs: an ordinary consumer of the output"),
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


def torchao_int8_weight_only(x, w, scale, bias):
    """torchao's int8 weight-only linear (`_linear_fp_act_int8_weight_impl`): 2D, the scale in x's dtype."""
    return torch.mm(x.reshape(-1, x.shape[-1]), w.t().to(x.dtype)).reshape(*x.shape[:-1], -1) * scale.to(x.dtype)


def scale_cast_in_the_graph(x, w, scale, bias):
    return torch.mm(x, w.t().to(x.dtype)) * scale.float().to(x.dtype)


def per_tensor(x, w, scale, bias):
    return torch.mm(x, w.t().to(x.dtype)) * scale[:1]


def gpt_fast_int8(x, w, scale, bias):
    """gpt-fast's WeightOnlyInt8Linear: F.linear on the converted weight, then the scale (3D x: Inductor's
    first woq pattern, with the reshapes)."""
    return F.linear(x, w.to(dtype=x.dtype)) * scale


@pytest.mark.parametrize("form, shape, dynamic", [
    (torchao_int8_weight_only, (5, 64), False), (torchao_int8_weight_only, (100, 64), False),
    (torchao_int8_weight_only, (7, 40), False), (scale_cast_in_the_graph, (5, 64), False),
    (scale_cast_in_the_graph, (7, 40), False), (per_tensor, (5, 64), False), (per_tensor, (100, 64), False),
    (gpt_fast_int8, (2, 9, 64), False), (gpt_fast_int8, (2, 9, 64), True),
], ids=lambda value: getattr(value, "__name__", str(value)))
def test_linears_inductors_weight_only_pattern_takes_are_taken_back(form, shape, dynamic):
    """Inductor's `woq_int8` pattern takes these bf16 forms before qfuse runs (to _weight_int8pack_mm,
    which in plain torch.compile crashes at K % 16 != 0 and raises for a per-tensor scale); qfuse puts each
    back (`passes/core/inductor_woq.py`) and fuses it, or at K % 16 != 0 leaves it to Inductor's dequantize +
    mm: equal to eager."""
    args = operands(shape, torch.bfloat16)
    if dynamic:
        torch._dynamo.mark_dynamic(args[0], 1)
    with torch.no_grad():
        out, report = compile_and_run(form, *args)
        expected = form(*args)
    (record,) = report.records
    assert report.reclaimed_from_inductor == [record.node] and not report.inductor_quantized, report.table()
    assert "taken back from Inductor's int8 weight-only pattern" in record.note, report.table()
    assert record.fused == (shape[-1] % 16 == 0), report.table()
    tolerance = TOLERANCE[torch.bfloat16] * expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=TOLERANCE[torch.bfloat16], atol=tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", [dequantized_weight, torchao_int8_weight_only], ids=lambda form: form.__name__)
@pytest.mark.parametrize("rows", [5, 100, 300])
def test_on_the_gpu_the_triton_kernel_takes_it(form, rows):
    """On CUDA the `triton` kernel: its template up to 128 rows, Inductor's dequantize + mm above; never
    Inductor's _weight_int8pack_mm (on an H100 17-36x slower than the bf16 matmul at 16 rows)."""
    from torch._inductor.utils import run_and_get_code

    args = [tensor.cuda() for tensor in operands((rows, 64), torch.bfloat16)]
    marker = qfuse.graphs_compiled()
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(form, backend="qfuse"), *args)
        expected = form(*args)
    (record,) = qfuse.reports_since(marker)[-1].records
    assert record.fused and record.kernel == "triton", record
    assert "_weight_int8pack_mm" not in "\n".join(code)
    assert record.lowered.startswith("Triton template" if rows <= 128 else "Inductor's own dequantize + mm"), record.lowered
    torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2 * expected.float().abs().max().item())


def swiglu_of_scaled_matmuls(x, w1, s1, w3, s3):
    """torchao's int8 weight-only form in a SwiGLU: at M = 1, `silu(gate)` is [1, N], the shape of a weight scale."""
    gate = (x @ w1.t().to(x.dtype)) * s1
    up = (x @ w3.t().to(x.dtype)) * s3
    return F.silu(gate) * up


def routed_scaled_matmul(x, w1, s1, w3, s3):
    """A router's weight of each token times an expert's output (MoE): at M = 1 it is [1, 1], one value."""
    gate = torch.sigmoid(x.sum(-1, keepdim=True))
    return (x @ w3.t().to(x.dtype)) * s3 * gate


def _weight_scales_of_the_fused_ops(fn, *args):
    """(output, the scale argument of each qfuse::weight_only_scaled_mm in the generated code)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="qfuse", options={"kernel": "reference"})
    out, (code, *_) = run_and_get_code(compiled, *args)
    calls = re.findall(r"weight_only_scaled_mm\.default\((.*)\)\n", code)
    return out, [re.sub(r"\([^()]*\)", "", re.sub(r"\([^()]*\)", "", call)).split(", ")[2] for call in calls]


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("form, linears", [(swiglu_of_scaled_matmuls, 2), (routed_scaled_matmul, 1)],
                         ids=["swiglu", "routed"])
def test_a_factor_computed_from_the_activation_is_no_weight_scale(form, linears, rows):
    """At M = 1 `silu(gate) * up` multiplies up's output by a [1, N] tensor, which broadcasts like a per-column
    weight scale, and a router's weight of the one token is one value, like a per-tensor one: both are computed
    from the activation, so the linear ends before them (a weight scale is prepared once with its weight; these
    change with every input)."""
    _, w1, s1, _ = operands((rows, 64), torch.float32, seed=1)
    x, w3, s3, _ = operands((rows, 64), torch.float32, seed=2)
    out, scales = _weight_scales_of_the_fused_ops(form, x, w1, s1, w3, s3)
    assert len(scales) == linears and all(name.startswith("arg") for name in scales), scales  # the stored scales
    torch.testing.assert_close(out, form(x, w1, s1, w3, s3), rtol=1e-4, atol=1e-4)
