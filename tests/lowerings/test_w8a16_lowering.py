"""`qfuse::weight_only_scaled_mm` on the `triton` kernel at prefill (M > 16) lowers to Inductor's own
dequantize + mm on the stored weight, on any device: checked here on the CPU against float64 and the
eager op, int8 and fp8 weights, one-value / per-column / 128 x 128 block scales (N and K no multiples
of 128), bias, 3D, static and dynamic M (one compile per M bucket). The decode template is GPU-only
(tests/lowerings/test_w8a16_template.py); a weight zero point stays an extern call, with its reason."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from qfuse.lowerings import register_lowerings
from tests.helpers import outputs_and_code_per_call
from tests.kernels import test_triton_w8a16
from tests.kernels.test_triton_w8a16 import float64_reference

EXTERN_CALL = "torch.ops.qfuse.weight_only_scaled_mm.default("
FP8 = torch.float8_e4m3fn
ON_A_GPU_MACHINE = pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "the extern call runs the Triton kernel on CPU tensors, which only Triton's interpreter takes; on a GPU "
    "tests/lowerings/test_w8a16_template.py checks the same on CUDA"))


def weight_and_scale(*args):
    """The kernel tests' weight and scale, on the CPU (those tests put them on the GPU where there is one)."""
    b, scale = test_triton_w8a16.weight_and_scale(*args)
    return b.cpu(), None if scale is None else scale.cpu()


def op_call(b, scale, bias, azp_b=None):
    def linear(x):
        return torch.ops.qfuse.weight_only_scaled_mm(x, b, scale, bias, azp_b, x.dtype, "triton")
    return linear


def assert_matches(out, x, b, scale, bias, tolerance):
    reference = float64_reference(x.reshape(-1, x.shape[-1]), b, scale, bias).reshape(out.shape)
    scale_of = reference.abs().max().item()
    assert (out.double() - reference).abs().max().item() <= 2 * tolerance * scale_of


@pytest.mark.parametrize("weight_dtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("kind", ["tensor", "column", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_is_inductors_dequantize_and_mm(weight_dtype, kind, dtype):
    assert register_lowerings()
    b, scale = weight_and_scale(weight_dtype, kind, 200, 136)
    bias = torch.randn(136)
    x = torch.randn(2, 20, 200).to(dtype)
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(op_call(b, scale, bias)), x)
    assert EXTERN_CALL not in "\n".join(code)
    assert out.shape == (2, 20, 136) and out.dtype == dtype
    assert_matches(out, x, b, scale, bias, 1e-5 if dtype == torch.float32 else 2**-7)


@ON_A_GPU_MACHINE
def test_dynamic_m_compiles_once_per_m_bucket():
    """A dynamic M is guarded on 16 rows: above, Inductor's dequantize + mm; at most 16, the decode
    template, which needs CUDA: here an extern call of the op. Each bucket is compiled once."""
    assert register_lowerings()
    b, scale = weight_and_scale(FP8, "block", 256, 136)
    compiled = torch.compile(op_call(b, scale, None))
    torch._dynamo.reset()
    calls = [(torch.randn(m, 256),) for m in (40, 3, 100, 9)]
    torch._dynamo.mark_dynamic(calls[0][0], 0)
    results = outputs_and_code_per_call(compiled, calls)
    for (out, _), (x,) in zip(results, calls):
        assert_matches(out, x, b, scale, None, 1e-5)
    codes = [code for _, code in results]
    assert [bool(code) for code in codes] == [True, True, False, False]
    assert EXTERN_CALL not in codes[0] and EXTERN_CALL in codes[1]


@ON_A_GPU_MACHINE
def test_dynamic_weight_sizes_stay_an_extern_call():
    assert register_lowerings()
    b, scale = weight_and_scale(FP8, "block", 256, 136)
    torch._dynamo.reset()
    x = torch.randn(40, 256)
    out, code = run_and_get_code(torch.compile(op_call(b, scale, None), dynamic=True), x)
    assert EXTERN_CALL in "\n".join(code)
    assert_matches(out, x, b, scale, None, 1e-5)


def test_a_weight_zero_point_stays_an_extern_call():
    assert register_lowerings()
    b, scale = weight_and_scale(torch.int8, "column", 64, 32)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="symmetric weights"):  # the extern call runs the op, which refuses it
        torch.compile(op_call(b, scale, None, torch.ones(32, dtype=torch.int32)))(torch.randn(20, 64))
