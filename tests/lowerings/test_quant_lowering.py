"""qfuse's Triton quantizer inside Inductor's generated code (GPU only; run on the GPU machine).

A dynamic per-token activation quant whose activation has no pointwise producer (a graph input, a
GEMM's output) becomes `qfuse::dynamic_quant`, launched from the generated code as a user-defined
Triton kernel: no extern call of the op, numerics equal to eager, dynamic M, one quant for an
activation several GEMMs read. A quant of silu(gate) * up becomes `qfuse::silu_mul_quant`, one
pass over gate and up; another pointwise producer keeps Inductor's fused reduction."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import qfuse
import torch.nn.functional as F

from qfuse.passes.forms.triton_quantizer import PATTERN as QUANT_KERNEL_PATTERN
from qfuse.passes.forms.triton_quantizer import QUANTIZER_NOTES
from qfuse.schemes import FP8_DTYPE
from tests.test_cuda import FP8_CAPABLE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
KERNEL_MARK = "_dynamic_quant_kernel"
EXTERN_CALL = "torch.ops.qfuse.dynamic_quant.default("
QUANT_KERNEL_NOTE = QUANTIZER_NOTES[torch.ops.qfuse.dynamic_quant.default]
SILU_MUL_NOTE = QUANTIZER_NOTES[torch.ops.qfuse.silu_mul_quant.default]
QMAX = {torch.int8: 127.0, FP8_DTYPE: 448.0}


def token_quant(x, dtype):
    """vLLM's torch fallback: bf16 amax, float32 scale clamped to eps, x.float() / s."""
    s = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-6) / QMAX[dtype]
    scaled = x.float() / s
    q = scaled.round().clamp(-128, 127) if dtype == torch.int8 else scaled.clamp(-448.0, 448.0)
    return q.to(dtype), s


def linear(x, w, w_scale, dtype, one=None):
    """`one`: the unit scales of fp8's `_scaled_mm` as a tensor the graph reads (a module's buffer in
    gpu_linear.QuantLinear), so that the GEMM's activation scale is s * one, not s."""
    q, s = token_quant(x, dtype)
    q2d = q.reshape(-1, q.shape[-1])
    if dtype == torch.int8:
        y = torch._int_mm(q2d, w.t()).float()
    else:
        one = torch.ones((), device=x.device) if one is None else one
        y = torch._scaled_mm(q2d, w.t(), one, one, out_dtype=torch.float32)
    return (y * s.reshape(-1, 1) * w_scale).to(torch.bfloat16).reshape(*x.shape[:-1], w.shape[0])


def weights(dtype, n=256, k=512):
    w = (torch.randn(n, k, device="cuda") * 40).clamp(-127, 127)
    return (w.round().to(torch.int8) if dtype == torch.int8 else w.to(FP8_DTYPE)), torch.rand(n, device="cuda") * 0.01


def compile_and_run(fn, *args, dynamic=None):
    marker = qfuse.graphs_compiled()
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(fn, backend="qfuse", dynamic=dynamic), *args)
    return out, "\n".join(code), qfuse.reports_since(marker)[-1]


def eager(fn, *args):
    """`fn` eagerly; cuBLAS's int8 GEMM takes more than 16 rows, so small M runs on the CPU."""
    if args[0].reshape(-1, args[0].shape[-1]).shape[0] > 16:
        return fn(*args)
    return fn(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)).cuda()


DTYPES = [torch.int8, pytest.param(FP8_DTYPE, marks=pytest.mark.skipif(not FP8_CAPABLE, reason="fp8 needs sm_89"))]


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("shape", [(2048, 512), (3, 700, 512)], ids=["M2048", "3D"])
def test_quant_runs_as_the_triton_quantizer_in_generated_code(dtype, shape):
    w, w_scale = weights(dtype)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    out, code, report = compile_and_run(linear, x, w, w_scale, dtype)
    assert KERNEL_MARK in code and EXTERN_CALL not in code
    assert report.matches[QUANT_KERNEL_PATTERN] == 1
    (record,) = report.fused
    assert QUANT_KERNEL_NOTE in record.note
    torch.testing.assert_close(out.float(), eager(linear, x, w, w_scale, dtype).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not FP8_CAPABLE, reason="fp8 needs sm_89")
def test_unit_scales_read_from_a_buffer_still_take_the_quantizer():
    w, w_scale = weights(FP8_DTYPE)
    x, one = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16), torch.ones((), device="cuda")
    out, code, report = compile_and_run(linear, x, w, w_scale, FP8_DTYPE, one)
    assert KERNEL_MARK in code and report.matches[QUANT_KERNEL_PATTERN] == 1
    torch.testing.assert_close(out.float(), linear(x, w, w_scale, FP8_DTYPE, one).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8"])
def test_the_quantizer_is_exact_inside_generated_code(dtype):
    """Its q equals eager's bit for bit: a GEMM against the identity reads q back."""
    k = 512
    eye = torch.eye(k, device="cuda")
    w = eye.to(torch.int8) if dtype == torch.int8 else eye.to(FP8_DTYPE)
    x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16) * 3
    x[5, 7] = 0.0
    x[9] = 0.0

    def read_back(x, w):
        q, s = token_quant(x, dtype)
        if dtype == torch.int8:
            return torch._int_mm(q, w.t()).float() * s
        one = torch.ones((), device=x.device)
        return torch._scaled_mm(q, w.t(), one, one, out_dtype=torch.float32) * s

    out, code, _ = compile_and_run(read_back, x, w)
    assert KERNEL_MARK in code
    q, s = token_quant(x, dtype)
    torch.testing.assert_close(out, q.float() * s, rtol=0, atol=0)


def test_dynamic_m_runs_one_compiled_graph():
    w, w_scale = weights(torch.int8)
    torch._dynamo.reset()
    compiled = torch.compile(linear, backend="qfuse")
    first = torch.randn(33, 512, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.mark_dynamic(first, 0)
    out, code = run_and_get_code(compiled, first, w, w_scale, torch.int8)
    assert KERNEL_MARK in "\n".join(code)
    torch.testing.assert_close(out.float(), eager(linear, first, w, w_scale, torch.int8).float(), rtol=1e-2, atol=1e-2)
    for m in (17, 300, 0):  # eager int8 GEMMs on CUDA take more than 16 rows
        x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        out = compiled(x, w, w_scale, torch.int8)
        if m:
            torch.testing.assert_close(out.float(), eager(linear, x, w, w_scale, torch.int8).float(), rtol=1e-2, atol=1e-2)
        else:
            assert out.shape == (0, 256)


def test_an_activation_read_by_two_gemms_is_quantized_once():
    w1, s1 = weights(torch.int8)
    w2, s2 = weights(torch.int8, n=128)

    def two(x):
        q, s = token_quant(x, torch.int8)
        a = torch._int_mm(q, w1.t()).float() * s * s1
        b = torch._int_mm(q, w2.t()).float() * s * s2
        return a.to(torch.bfloat16), b.to(torch.bfloat16)

    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)
    (a, b), code, report = compile_and_run(two, x)
    assert report.matches[QUANT_KERNEL_PATTERN] == 1 and all(QUANT_KERNEL_NOTE in r.note for r in report.fused)
    assert sum(".run(" in line and "dynamic_quant" in line for line in code.splitlines()) == 1, code
    ea, eb = two(x)
    torch.testing.assert_close(a.float(), ea.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(b.float(), eb.float(), rtol=1e-2, atol=1e-2)


def test_a_pointwise_producer_keeps_inductors_fused_quant():
    w, w_scale = weights(torch.int8)
    norm = torch.rand(512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(40, 512, device="cuda", dtype=torch.bfloat16)

    def normed(x):
        return linear(x * norm, w, w_scale, torch.int8)

    out, code, report = compile_and_run(normed, x)
    assert KERNEL_MARK not in code and report.matches[QUANT_KERNEL_PATTERN] == 0
    (record,) = report.fused
    assert "Inductor fuses the op that produces the activation" in record.note
    # the quant is Inductor's, fused with x * norm (unrounded to bf16 there, unlike eager): as Inductor computes it
    torch._dynamo.reset()
    torch.testing.assert_close(out.float(), torch.compile(normed)(x).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("merged", [False, True, "fp32_gate"], ids=["gate_up", "merged_gate_up", "fp32_gate"])
def test_silu_mul_quant_runs_in_generated_code(dtype, merged):
    """The down projection's input: silu(gate) * up quantized in one pass over gate and up, also where
    gate and up are the halves of one merged gate_up output (strided rows), and where the gate is
    float32 (a linear's output whose bf16 rounding Inductor dropped)."""
    w, w_scale = weights(dtype, n=256, k=512)

    def down(gate, up):
        return linear(F.silu(gate).to(up.dtype) * up, w, w_scale, dtype)

    def merged_down(gate_up):
        return down(gate_up[:, :512], gate_up[:, 512:])

    gate_up = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16) * 3
    gate, up = gate_up[:, :512].contiguous(), gate_up[:, 512:].contiguous()
    fn, args = {True: (merged_down, (gate_up,)), False: (down, (gate, up)), "fp32_gate": (down, (gate.float(), up))}[merged]
    out, code, report = compile_and_run(fn, *args)
    assert "_silu_mul_quant_kernel" in code and "torch.ops.qfuse.silu_mul_quant.default(" not in code
    (record,) = report.fused
    assert SILU_MUL_NOTE in record.note and report.matches[QUANT_KERNEL_PATTERN] == 1
    torch.testing.assert_close(out.float(), fn(*args).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(16, 512), (300, 512)], ids=["M16", "M300"])
def test_a_small_static_m_keeps_inductors_quant(shape):
    """Below MIN_ROWS the quantizer saves less GPU time than its launch costs on the host."""
    w, w_scale = weights(torch.int8)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    out, code, report = compile_and_run(linear, x, w, w_scale, torch.int8)
    assert KERNEL_MARK not in code and report.matches[QUANT_KERNEL_PATTERN] == 0
    (record,) = report.fused
    assert "below 2048 rows" in record.note, record.note


def test_an_eps_below_float32s_normal_range_keeps_inductors_quant():
    w, w_scale = weights(torch.int8)
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16)

    def tiny_eps(x):
        s = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-40) / 127.0
        q = (x.float() / s).round().clamp(-128, 127).to(torch.int8)
        return (torch._int_mm(q, w.t()).float() * s * w_scale).to(torch.bfloat16)

    out, code, report = compile_and_run(tiny_eps, x)
    assert KERNEL_MARK not in code and "below float32's normal range" in report.fused[0].note
