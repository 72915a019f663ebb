"""The torch-kernel lowering of qfuse::scaled_mm: Inductor's own GEMM plus a fused IR epilogue,
numerically the same as the extern op; other kernels stay extern calls."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from tests.passes.test_pt2e_linear import QDQLinear
from tests.passes.test_reference_linear import fp8_scaled_mm, fp8_weight, int_mm_linear, operands


def compiled_code(fn, *args, **options):
    compiled = torch.compile(fn, backend="qfuse", options=options or None)
    out, (code, *_) = run_and_get_code(compiled, *args)
    return out, code


@pytest.mark.parametrize("shape", [(1, 64), (2, 7, 64)], ids=["M1", "3D"])
def test_torch_kernel_lowers_to_int_mm_and_a_fused_epilogue(shape):
    x, w, w_scale, bias = operands(shape)
    out, code = compiled_code(int_mm_linear, x, w, w_scale, bias, kernel="torch")
    assert "extern_kernels._int_mm" in code and "qfuse.scaled_mm" not in code
    torch.testing.assert_close(out, int_mm_linear(x, w, w_scale, bias), rtol=1e-5, atol=1e-5)


def test_reference_kernel_stays_an_extern_call():
    x, w, w_scale, bias = operands((5, 64))
    out, code = compiled_code(int_mm_linear, x, w, w_scale, bias, kernel="reference", patterns=["reference_linear"])
    assert "torch.ops.qfuse.scaled_mm.default" in code and "_int_mm" not in code
    torch.testing.assert_close(out, int_mm_linear(x, w, w_scale, bias), rtol=1e-5, atol=1e-5)


def test_fp8_on_cpu_lowers_to_a_float32_mm():
    x, w, w_scale, bias = operands((9, 64))
    w = fp8_weight(w)
    out, code = compiled_code(fp8_scaled_mm, x, w, w_scale, bias)
    assert "qfuse.scaled_mm" not in code and "_scaled_mm" not in code
    torch.testing.assert_close(out.float(), fp8_scaled_mm(x, w, w_scale, bias).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", [dict(), dict(dtype=torch.uint8), dict(activation="per_token"),
                                  dict(weight_zero_point=2)], ids=["int8", "uint8", "per_token", "weight_zp"])
def test_zero_points_in_the_lowering_are_exact(case):
    model, x = QDQLinear(**case), torch.randn(2, 9, 64)
    with torch.no_grad():
        out, code = compiled_code(model, x, kernel="torch")
        expected = model(x)
        extern, _ = compiled_code(model, x, kernel="reference")
    assert "extern_kernels._int_mm" in code and "qfuse.scaled_mm" not in code
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, extern, rtol=1e-5, atol=1e-5)


def test_onednn_per_token_epilogue_is_inductor_ir():
    """qlinear takes one activation scale: the per-token scale, bias and cast go to fused IR."""
    from qfuse.kernels import get_kernel
    from qfuse.platform import current_platform

    supported, reason = get_kernel("onednn").is_supported(current_platform("cpu"))
    if not supported:
        pytest.skip(reason)
    x, w, w_scale, bias = operands((2, 7, 64))
    out, code = compiled_code(int_mm_linear, x, w, w_scale, bias, kernel="onednn")
    assert "torch.ops.qfuse.scaled_mm.default" in code and "_int_mm" not in code
    assert "None, torch.float32, 'onednn')" in code  # qlinear alone: no activation scale, no bias
    torch.testing.assert_close(out, int_mm_linear(x, w, w_scale, bias), rtol=1e-5, atol=1e-5)
