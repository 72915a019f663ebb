"""eager_roundings: a float16 / bfloat16 quantizer left in Inductor's code rounds its scale and quotient as eager
does, so the int8 activation of a fused linear is eager's, where float32 arithmetic would put a q one step off: on a
GPU (the triton kernel) and on the CPU (the torch kernel, whose epilogue reads the scale realized in its dtype)."""

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from qfuse.config import pass_skipping_caches_off
from qfuse.passes.forms.eager_roundings import quantizer_nodes
from qfuse.platform import CUDA_INT_MM_MIN_ROWS
from tests.helpers import compile_and_run

DEVICE, KERNEL = ("cuda", "triton") if torch.cuda.is_available() else ("cpu", "torch")


def quantize(x, by_reciprocal=False):
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-5) / 127
    quotient = x * (1 / scale) if by_reciprocal else x / scale
    return quotient.round().clamp(-128, 127).to(torch.int8), scale


def quantize_in_float32(x, by_reciprocal=False):
    """The same chain in float32, rounded once at the end: what Inductor's fused code computes unless told."""
    return quantize(x.float(), by_reciprocal)[0]


def rows_that_round_apart(dtype, by_reciprocal, rows=4, k=32):
    """Activation rows whose eager q differs from the float32 chain's in at least one place."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        x = torch.randn(64, k, generator=generator).to(dtype)
        apart = (quantize(x, by_reciprocal)[0] != quantize_in_float32(x, by_reciprocal)).any(-1)
        if apart.sum() >= rows:
            return x[apart][:rows]
    raise AssertionError("no row rounds apart")


def linear_returning_q(x, w, w_scale):
    q, s = quantize(x)
    padded = F.pad(q, (0, 0, 0, CUDA_INT_MM_MIN_ROWS - q.shape[0]))  # CUDA _int_mm wants more than 16 rows
    acc = torch._int_mm(padded, w.t())[: q.shape[0]]
    return acc.to(x.dtype) * s * w_scale, q


def fake_quant_linear(x, w, w_scale, by_reciprocal):
    q, s = quantize(x, by_reciprocal)
    return (q.to(x.dtype) * s) @ (w.to(x.dtype) * w_scale[:, None]).t()


@pytest.mark.parametrize("by_reciprocal", [False, True], ids=["divide", "reciprocal"])
def test_the_quantizer_is_the_chain_from_q_back_to_x(by_reciprocal):
    def model(x):
        return quantize(torch.relu(x), by_reciprocal)[0]
    graph = make_fx(model)(torch.randn(4, 32, dtype=torch.float16)).graph
    q = graph.find_nodes(op="output")[0].args[0]
    targets = {str(node.target).split(".")[1] for node in quantizer_nodes(q)}
    assert {"round", "amax", "abs"} <= targets and ("div" in targets or "mul" in targets)
    assert "relu" not in targets  # x's own producer is not the quantizer's


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_int8_activation_is_eagers(dtype):
    x = rows_that_round_apart(dtype, by_reciprocal=False).to(DEVICE)
    w = torch.randint(-127, 128, (16, 32), dtype=torch.int8, device=DEVICE)
    w_scale = (torch.rand(16, device=DEVICE) / 100).to(dtype)
    with torch.no_grad(), pass_skipping_caches_off():
        (_, q), report = compile_and_run(linear_returning_q, x, w, w_scale, kernel=KERNEL)
    assert len(report.fused) == 1
    assert torch.equal(q, linear_returning_q(x, w, w_scale)[1])
    assert not torch.equal(q, quantize_in_float32(x))  # the rows tell eager's roundings from float32's


@pytest.mark.parametrize("by_reciprocal", [False, True], ids=["divide", "reciprocal"])
def test_a_float16_fake_quant_is_eagers_to_the_output_rounding(by_reciprocal):
    """The fake quant's q feeds the int8 GEMM: a q one step off moves its row's outputs by a whole step."""
    x = rows_that_round_apart(torch.float16, by_reciprocal).to(DEVICE)
    generator = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (16, 32), generator=generator).to(torch.int8).to(DEVICE)
    w_scale = (torch.rand(16, generator=generator) / 100).to(torch.float16).to(DEVICE)
    with torch.no_grad(), pass_skipping_caches_off():
        out, report = compile_and_run(fake_quant_linear, x, w, w_scale, by_reciprocal, kernel=KERNEL)
    assert len(report.fused) == 1
    expected = fake_quant_linear(x, w, w_scale, by_reciprocal)
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3 * expected.abs().max().item())


STATIC_SCALE = 0.05  # a float32 scale of no dimensions, on x's device


def static_fake_quant_linear(x, w, w_scale):
    s = torch.tensor(STATIC_SCALE, device=x.device)
    q = (x / s).round().clamp(-128, 127).to(torch.int8)
    return (q.to(x.dtype) * s) @ (w.to(x.dtype) * w_scale[:, None]).t(), q


def rows_a_float16_scale_rounds_apart(rows=4, k=64):
    """float16 rows whose q from x / float16(0.05) (eager's CUDA kernel) differs from x / 0.05 somewhere (both
    quotients rounded to float16)."""
    generator = torch.Generator().manual_seed(2)
    scale16 = float(torch.tensor(STATIC_SCALE).half())
    for _ in range(100):
        x = (torch.randn(256, k, generator=generator) * 2).to(torch.float16)
        apart = ((x.float() / scale16).half().round() != (x.float() / STATIC_SCALE).half().round()).any(-1)
        if apart.sum() >= rows:
            return x[apart][:rows]
    raise AssertionError("no row rounds apart")


def test_a_float32_scale_of_no_dimensions_divides_as_eager_does():
    """Session 39's GPU run (seed 46): eager's CUDA kernel reads the scale converted to the quotient's float16;
    the CPU's divides by the float32 value. The rows tell the two apart on the GPU."""
    x = rows_a_float16_scale_rounds_apart().to(DEVICE)
    generator = torch.Generator().manual_seed(3)
    w = torch.randint(-127, 128, (16, 64), generator=generator).to(torch.int8).to(DEVICE)
    w_scale = (torch.rand(16, generator=generator) / 100).to(torch.float16).to(DEVICE)
    with torch.no_grad(), pass_skipping_caches_off():
        (out, q), report = compile_and_run(static_fake_quant_linear, x, w, w_scale, kernel=KERNEL)
    assert len(report.fused) == 1
    expected, eager_q = static_fake_quant_linear(x, w, w_scale)
    assert torch.equal(q, eager_q)
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3 * expected.abs().max().item())
