"""The torch-kernel lowering of qfuse::scaled_mm: Inductor's own GEMM plus a fused IR epilogue,
numerically the same as the extern op; other kernels stay extern calls."""

import dataclasses

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from qfuse.kernels.array_ops import TORCH_OPS
from qfuse.kernels.torch_native import FLOAT32_INT8_MIN_ROWS, int8_matmul_in_float32
from qfuse.platform import current_platform
from tests.passes.test_pt2e_linear import QDQLinear
from tests.passes.test_reference_linear import fp8_scaled_mm, fp8_weight, int_mm_linear, operands

#: what the torch kernel calls for an int8 GEMM of M >= FLOAT32_INT8_MIN_ROWS, by whether the CPU has int8 dot
#: instructions: `_int_mm`, else float32 GEMMs (`int8_matmul_in_float32`)
INT8_GEMM_CODE = {True: "extern_kernels._int_mm", False: "extern_kernels.mm"}


@pytest.fixture(params=[True, False], ids=["int8_dots", "no_int8_dots"])
def int8_dots(request, monkeypatch):
    """The torch kernel and its lowering on a CPU with (True) or without int8 dot instructions."""
    def platform(device_type):
        found = current_platform(device_type)
        if device_type != "cpu" or request.param == found.cpu_has_int8_dot_products:
            return found
        return dataclasses.replace(found, cpu_has_avx512_vnni=request.param, cpu_has_amx=False)
    for module in ("qfuse.kernels.torch_native", "qfuse.lowerings.torch_native"):
        monkeypatch.setattr(f"{module}.current_platform", platform)
    return request.param


def compiled_code(fn, *args, **options):
    compiled = torch.compile(fn, backend="qfuse", options=options or None)
    out, (code, *_) = run_and_get_code(compiled, *args)
    return out, code


@pytest.mark.parametrize("shape", [(1, 64), (2, 7, 64)], ids=["M1", "3D"])
def test_torch_kernel_lowers_to_int_mm_and_a_fused_epilogue(shape, int8_dots):
    x, w, w_scale, bias = operands(shape)
    out, code = compiled_code(int_mm_linear, x, w, w_scale, bias, kernel="torch")
    rows = x.numel() // x.shape[-1]
    assert INT8_GEMM_CODE[int8_dots or rows < FLOAT32_INT8_MIN_ROWS] in code and "qfuse.scaled_mm" not in code
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
def test_zero_points_in_the_lowering_are_exact(case, int8_dots):
    model, x = QDQLinear(**case), torch.randn(2, 9, 64)
    with torch.no_grad():
        out, code = compiled_code(model, x, kernel="torch")
        expected = model(x)
        extern, _ = compiled_code(model, x, kernel="reference")
    assert INT8_GEMM_CODE[int8_dots] in code and "qfuse.scaled_mm" not in code
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


@pytest.mark.parametrize("k", [1024, 1025, 3000])
def test_int8_products_summed_in_float32_are_exact(k):
    """Odd products near the largest (-127 x -127 = 16129, some -128 x -127): a K = 1024 chunk stays below 2^24,
    exact in float32; longer K adds chunks in int32, as _int_mm's accumulator does. One float32 GEMM over all of
    a K = 3000 is not exact, however it orders its sums: the exact sum is odd and above 2^24, where float32 holds
    even numbers only (the test sees a missing chunking)."""
    a = torch.full((3, k), -127, dtype=torch.int8)
    a[:, ::5] = -128
    a[:, 1] = -126  # an even product: an odd count of odd ones
    b = torch.full((k, 5), -127, dtype=torch.int8)
    expected = (a.to(torch.int64) @ b.to(torch.int64)).to(torch.int32)
    assert torch.equal(int8_matmul_in_float32(a, b, k, TORCH_OPS), expected)
    if k == 3000:
        assert int(expected[0, 0]) % 2 and abs(int(expected[0, 0])) > 2**24
        assert not torch.equal(TORCH_OPS.float32_mm_as_int32(a, b), expected)


@pytest.mark.parametrize("shape", [(FLOAT32_INT8_MIN_ROWS - 1, 64), (FLOAT32_INT8_MIN_ROWS, 2100), (2, 9, 1500)],
                         ids=["below", "chunks", "3D"])
def test_without_int8_dot_instructions_the_int8_gemm_is_float32_gemms(shape, int8_dots):
    """Where `_int_mm` is emulated (no AVX-512 VNNI / AMX) the lowering from 8 rows runs float32 GEMMs of K <= 1024
    chunks: the same int32 sums (`test_int8_products_summed_in_float32_are_exact`), the same epilogue."""
    x, w, w_scale, bias = operands(shape)
    out, code = compiled_code(int_mm_linear, x, w, w_scale, bias, kernel="torch")
    rows = x.numel() // x.shape[-1]
    floats = not int8_dots and rows >= FLOAT32_INT8_MIN_ROWS
    assert INT8_GEMM_CODE[not floats] in code and INT8_GEMM_CODE[floats] not in code
    assert code.count("extern_kernels.mm(") == (-(-shape[-1] // 1024) if floats else 0)
    torch.testing.assert_close(out, int_mm_linear(x, w, w_scale, bias), rtol=1e-5, atol=1e-5)
