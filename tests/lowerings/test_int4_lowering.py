"""`qfuse::int4_weight_only_mm` on the `triton` kernel at prefill (M > 16) lowers to Inductor's own
dequantize + mm on the stored words, on any device: checked here on the CPU against the peer GPTQ
model's eager forward, symmetric and with zero points, stored and computed shifts, bias, static and
dynamic M (one compile per M bucket), GPTQ's act order (scales and zero points gathered by g_idx), zero points stored minus one
AutoGPTQ's transposed tensors and AWQ's words packed along N (the decode template is GPU-only:
tests/lowerings/test_int4_template.py); torchao's int8 storage at prefill, and on a GPU at decode."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import qfuse
from qfuse.kernels import int4_cpu
from qfuse.lowerings import register_lowerings
from tests.helpers import DEQUANTIZE_MARK, decode_template_in, outputs_and_code_per_call
from tests.peers.weight_only_models import autogptq_int4, awq_int4, gptq_packed_int4, torchao_intx_int4

EXTERN_CALL = "torch.ops.qfuse.int4_weight_only_mm.default("


def op_call(model, shifts):
    def linear(x):
        return torch.ops.qfuse.int4_weight_only_mm(x, model.qweight, shifts, model.scales, model.qzeros, model.bias,
                                                   model.group_size, x.dtype, "triton")
    return linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("stored_shifts", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])  # 128: the plane template's buckets on a GPU, not on CPU
def test_prefill_is_inductors_dequantize_and_mm(dtype, symmetric, stored_shifts, group_size):
    assert register_lowerings()
    model = gptq_packed_int4(dtype, group_size=group_size, symmetric=symmetric)
    x = torch.randn(2, 20, 256).to(dtype)
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(op_call(model, model.shifts if stored_shifts else None)), x)
    assert EXTERN_CALL not in "\n".join(code)
    expected = model(x)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "the decode bucket's extern call runs the Triton kernel on CPU tensors, which only Triton's interpreter "
    "takes; on a GPU tests/lowerings/test_int4_template.py checks the buckets"))
def test_dynamic_m_compiles_once_per_m_bucket():
    """A dynamic M is guarded on 16 rows: above, Inductor's dequantize + mm; at most 16, the decode
    template, which needs CUDA: here an extern call of the op. Each bucket is compiled once."""
    assert register_lowerings()
    model = gptq_packed_int4(torch.float32, group_size=64, symmetric=False)
    compiled = torch.compile(op_call(model, model.shifts))
    torch._dynamo.reset()
    calls = [(torch.randn(m, 256),) for m in (40, 3, 100, 7)]
    torch._dynamo.mark_dynamic(calls[0][0], 0)
    results = outputs_and_code_per_call(compiled, calls)
    for (out, _), (x,) in zip(results, calls):
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-4)
    codes = [code for _, code in results]
    assert [bool(code) for code in codes] == [True, True, False, False]
    assert EXTERN_CALL not in codes[0] and EXTERN_CALL in codes[1]


def test_a_dynamic_m_above_the_cpu_kernels_rows_is_inductors_dequantize_and_mm():
    """On the CPU the int4 kernels are slower than Inductor's dequantize + mm above `int4_cpu.MAX_ROWS` rows (a static
    M there is not fused): a dynamic M is guarded on it, the kernel's extern call below, Inductor's own code above,
    each bucket compiled once. (Before, a dynamic M ran the kernel at every M.)"""
    assert register_lowerings()
    model = gptq_packed_int4(torch.bfloat16, group_size=128).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="qfuse", dynamic=True)
    calls = [(torch.randn(m, 256).to(torch.bfloat16),) for m in (3, 200, 128, 300)]
    marker = qfuse.graphs_compiled()
    with torch.no_grad():
        results = outputs_and_code_per_call(compiled, calls)
        for (out, _), (x,) in zip(results, calls):
            expected = model(x)
            torch.testing.assert_close(out, expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item())
    codes = [code for _, code in results]
    assert [bool(code) for code in codes] == [True, True, False, False]
    assert "qfuse.int4_weight_only_mm" in codes[0] and "qfuse" not in codes[1]
    above = [record for report in qfuse.reports_since(marker) for record in report.fused][-1]
    assert above.lowered.startswith("Inductor's own dequantize + mm (M above 128 (a dynamic M, guarded): ")
    assert f"torch: at M = {int4_cpu.MAX_ROWS + 1} the CPU int4 kernels are slower" in above.lowered


@pytest.mark.parametrize("form", ["act_order_plus_one", "autogptq_plus_one_mod_16", "awq_packed_along_n"])
def test_act_order_and_zero_conventions_in_ir(form):
    assert register_lowerings()
    if form == "act_order_plus_one":
        model = gptq_packed_int4(torch.float32, group_size=64, act_order=True, symmetric=False, zeros_minus_one=True)
        model.qzeros[0, 0] |= 0xF  # a zero point of 16
        operands = (model.qweight, model.shifts, model.scales, model.qzeros, model.bias, 64)
        g_idx, convention = model.g_idx, "plus_one"
    elif form == "autogptq_plus_one_mod_16":
        model = autogptq_int4(torch.float32, group_size=64, act_order=True)
        operands = (model.qweight.t(), model.wf.reshape(8), model.scales.t(), model.qzeros.t(), model.bias, 64)
        g_idx, convention = model.g_idx, "plus_one_mod_16"
    else:
        model = awq_int4(torch.float32, group_size=64, unpack_order="shifts")
        operands = (model.qweight, model.shifts, model.scales.t(), model.qzeros.t(), model.bias, 64)
        g_idx, convention = None, "stored"

    def linear(x):
        return torch.ops.qfuse.int4_weight_only_mm(x, *operands, x.dtype, "triton", g_idx, convention,
                                                   form == "awq_packed_along_n")

    x = torch.randn(40, 256)
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(linear), x)
    assert EXTERN_CALL not in "\n".join(code)
    expected = model(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device, rows", [("cpu", 40), pytest.param("cuda", 40, marks=NEEDS_CUDA),
                                          pytest.param("cuda", 3, marks=NEEDS_CUDA)], ids=["cpu", "cuda", "cuda_decode"])
@pytest.mark.parametrize("zero_points, values", [("zero", "int4"), ("wide", "int8"), ("none", "int4")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_storage_lowers_as_the_words_do(dtype, zero_points, values, device, rows):
    """torchao's intx (int4 values one per int8, int8 zero points, any int8 values): on a GPU the
    words template reads the values at decode and batched decode (up to `int4_mm.BATCHED_TILES`'
    128 rows); on the CPU at 40 rows Inductor's dequantize + mm."""
    from qfuse.kernels.triton.int4_mm import BATCHED_TILES

    assert register_lowerings()
    model = torchao_intx_int4(dtype, group_size=32, zero_points=zero_points, values=values).to(device)

    def linear(x):
        return torch.ops.qfuse.int4_weight_only_mm(x, model.qdata, None, model.scale, model.zero_point, model.bias,
                                                   model.group_size, x.dtype, "triton")

    x = torch.randn(rows, 256).to(device=device, dtype=dtype)
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(linear), x)
    code = "\n".join(code)
    assert EXTERN_CALL not in code and decode_template_in(code) == (device == "cuda" and rows <= max(BATCHED_TILES))
    assert DEQUANTIZE_MARK not in code  # the CPU's prefill: Inductor's own dequantize
    expected = model(x)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())
