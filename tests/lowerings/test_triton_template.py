"""The `triton` kernel as an Inductor template (GPU only; run on the GPU machine): no extern call of
qfuse's op in the generated code, the epilogue fused into the template's store, numerics equal to the
eager op for every scale kind, static and dynamic M (a tile and an fp8 kernel per M bucket), odd sizes, default mode and max-autotune."""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import qfuse
from qfuse.schemes import FP8_DTYPE
from tests.helpers import outputs_and_code_per_call
from tests.passes.test_reference_linear import dynamic_fp8, fp8_scaled_mm, fp8_weight, int_mm_linear, operands
from tests.test_cuda import FP8_CAPABLE, on_cpu, on_cuda as cuda

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TEMPLATE_MARK = "from qfuse.kernels.triton.scaled_mm import grouped_tile, scale_and_bias, scaled_dot"
EXTERN_CALL = "torch.ops.qfuse.scaled_mm.default("


def eager_int8(x, w, w_scale, bias):
    """int_mm_linear run eagerly on the CPU (CUDA's eager _int_mm rejects M <= 16)."""
    return int_mm_linear(*on_cpu(x, w, w_scale, bias)).cuda()


def last_kernel(code: str) -> str:
    """The name of the last kernel the generated wrapper launches."""
    return re.findall(r"(\w+)\.run\(", code)[-1]


def triton_code(fn, *args, **options):
    """Compile `fn` with qfuse (kernel triton), run it; (output, generated code, its last report)."""
    marker = qfuse.graphs_compiled()
    compiled = torch.compile(fn, backend="qfuse", options={"kernel": "triton", **options})
    out, code = run_and_get_code(compiled, *args)
    reports = qfuse.reports_since(marker)
    return out, "\n".join(code), reports[-1] if reports else None


@pytest.mark.parametrize("shape", [(1, 256), (17, 256), (3, 100, 256), (300, 512)], ids=["M1", "M17", "3D", "M300"])
def test_int8_linear_runs_as_a_template_with_its_epilogue_fused(shape):
    x, w, w_scale, bias = cuda(*operands(shape, n=136))
    out, code, report = triton_code(int_mm_linear, x, w, w_scale, bias)
    assert TEMPLATE_MARK in code and EXTERN_CALL not in code
    (record,) = report.fused
    assert record.lowered.startswith("Triton template"), record.lowered
    # the scales, bias and output cast are inside the template: no kernel runs after it
    assert last_kernel(code).startswith("triton_tem_"), code
    torch.testing.assert_close(out, eager_int8(x, w, w_scale, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not FP8_CAPABLE, reason="fp8 needs capability >= 8.9")
@pytest.mark.parametrize("shape", [(1, 256), (17, 256), (3, 100, 256)], ids=["M1", "M17", "3D"])
def test_fp8_linear_runs_as_a_template(shape):
    x, w, w_scale, bias = operands(shape, n=144)  # eager _scaled_mm needs N % 16 == 0
    x, w, w_scale, bias = cuda(x, fp8_weight(w), w_scale, bias)
    out, code, report = triton_code(fp8_scaled_mm, x, w, w_scale, bias)
    assert TEMPLATE_MARK in code and EXTERN_CALL not in code
    expected = fp8_scaled_mm(x, w, w_scale, bias).float()
    assert (out.float() - expected).norm() / expected.norm() < 1e-2


def test_dynamic_m_takes_every_batch_size():
    x, w, w_scale, bias = cuda(*operands((40, 256), n=136))
    compiled = torch.compile(int_mm_linear, backend="qfuse", options={"kernel": "triton"}, dynamic=True)
    for rows in (40, 1, 5, 33, 2):
        out = compiled(x[:rows], w, w_scale, bias)
        torch.testing.assert_close(out, eager_int8(x[:rows], w, w_scale, bias), rtol=1e-4, atol=1e-4)


def tile_rows(code: str) -> list[int]:
    """BLOCK_M of every qfuse template in the generated code."""
    return [int(rows) for rows in re.findall(r"BLOCK_M : tl.constexpr = (\d+)", code)]


def per_bucket(fn, rows_list, *weights, **options):
    """Compile `fn` with qfuse, M dynamic from the first call; per call: (output, its x, the code
    compiled for it: '' where an earlier compile served it), and the reports of the compiles."""
    marker = qfuse.graphs_compiled()
    compiled = torch.compile(fn, backend="qfuse", options=options or None)
    calls = [(torch.randn(rows, 256, device="cuda"), *weights) for rows in rows_list]
    torch._dynamo.mark_dynamic(calls[0][0], 0)
    results = outputs_and_code_per_call(compiled, calls)
    return [(out, call[0], code) for (out, code), call in zip(results, calls)], qfuse.reports_since(marker)


def test_dynamic_m_gets_the_tile_of_its_bucket():
    """A dynamic M is guarded on the tile table's bounds (16 and 128 rows): one compile per bucket,
    each with its own tile."""
    _, w, w_scale, bias = cuda(*operands((1, 256), n=136))
    results, _ = per_bucket(int_mm_linear, (5, 64, 300, 9, 100, 500), w, w_scale, bias, kernel="triton")
    for out, x, _ in results:  # a norm: among 10**5 activations a few round to the other int8 (eager runs on the CPU)
        expected = eager_int8(x, w, w_scale, bias)
        assert (out - expected).norm() / expected.norm() < 1e-3
    codes = [code for _, _, code in results]
    assert [bool(code) for code in codes] == [True, True, True, False, False, False]
    assert [tile_rows(code) for code in codes[:3]] == [[16], [64], [128]]


@pytest.mark.skipif(not FP8_CAPABLE or torch.cuda.get_device_capability() < (9, 0), reason="Hopper's fp8 choices")
@pytest.mark.parametrize("out", ["bf16", "fp32"])
def test_dynamic_m_fp8_runs_the_faster_kernel_of_each_bucket(out):
    """Kernel choice sees no M when M is dynamic; the lowering gives M <= 16 the Triton template, and
    above ATen's _scaled_mm on Hopper (cuBLAS with unit scales up to 128 rows; above, for a bf16 output,
    its row-wise CUTLASS GEMM), as kernel choice does for a static M."""
    x, w, w_scale, bias = operands((1, 256), n=144)
    _, w, w_scale, bias = cuda(x, fp8_weight(w), w_scale, bias)
    form = fp8_scaled_mm if out == "bf16" else _fp8_float32
    results, reports = per_bucket(form, (5, 300, 9, 64), w, w_scale, bias)
    for result, x, _ in results:
        expected = form(x, w, w_scale, bias).float()
        assert (result.float() - expected).norm() / expected.norm() < 1e-2
    # the form's float32 bias rules out ATen's row-wise GEMM: the pass takes the template, whose one
    # bucket bound is 16 rows (M = 64 runs the code compiled at M = 300: cuBLAS)
    assert [bool(code) for _, _, code in results] == [True, True, False, False]
    decode, above = (report.fused[0] for report in reports)
    assert TEMPLATE_MARK in results[0][2] and TEMPLATE_MARK not in results[1][2]
    assert "Triton template" in decode.lowered, decode.lowered
    how_it_ran = above.lowered.rsplit(": ", 1)[-1]  # after the reason a switched kernel gives
    assert how_it_ran.startswith(("ATen", "Inductor's own GEMM")) and "M above 16" in above.lowered, above.lowered


def _fp8_float32(x, w, w_scale, bias):
    """fp8_scaled_mm without the bf16 cast (ATen's row-wise CUTLASS GEMM writes bf16 only)."""
    q, s = dynamic_fp8(x.reshape(-1, x.shape[-1]))
    one = torch.ones((), dtype=torch.float32, device=x.device)
    y = torch._scaled_mm(q, w.to(FP8_DTYPE).t(), one, one, out_dtype=torch.float32)
    return (y * s * w_scale + bias).reshape(*x.shape[:-1], -1)


def _op(a, b, scale_a, scale_b, bias, out_dtype):
    return torch.ops.qfuse.scaled_mm(a, b, scale_a, scale_b, bias, None, None, out_dtype, "triton")


def _quantized(rows, cols, dtype):
    values = torch.randn(rows, cols, device="cuda")
    return values.mul(30).clamp(-127, 127).round().to(torch.int8) if dtype == torch.int8 else values.mul(30).to(FP8_DTYPE)


SCALES = {  # name -> (scale_a, scale_b) shapes for M = 70, K = 384, N = 260
    "tensor": ((), ()),
    "row_column": ((70, 1), (260,)),
    "block_activation": ((70, 3), (260,)),
    "block_weight": ((70, 1), (3, 3)),
    "block_both": ((70, 3), (3, 3)),
}


@pytest.mark.parametrize("dtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
@pytest.mark.parametrize("scales", list(SCALES))
def test_every_scale_kind_matches_the_eager_op(dtype, scales):
    if dtype == FP8_DTYPE and not FP8_CAPABLE:
        pytest.skip("fp8 needs capability >= 8.9")
    a, w = _quantized(70, 384, dtype), _quantized(260, 384, dtype)
    scale_a, scale_b = (torch.rand(shape, device="cuda") / 100 + 1e-3 for shape in SCALES[scales])
    bias = torch.randn(260, device="cuda", dtype=torch.bfloat16)
    out, code, _ = triton_code(_op, a, w.t(), scale_a, scale_b, bias, torch.bfloat16)
    assert TEMPLATE_MARK in code and EXTERN_CALL not in code
    expected = torch.ops.qfuse.scaled_mm(a, w.t(), scale_a, scale_b, bias, None, None, torch.float32, "reference")
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_k_not_a_multiple_of_16_stays_an_extern_call():
    x, w, w_scale, bias = cuda(*operands((20, 100), n=64))
    out, code, report = triton_code(int_mm_linear, x, w, w_scale, bias)
    assert EXTERN_CALL in code and TEMPLATE_MARK not in code
    assert "K is not a multiple of 16" in report.fused[0].lowered
    torch.testing.assert_close(out, eager_int8(x, w, w_scale, bias), rtol=1e-4, atol=1e-4)


def test_max_autotune_chooses_among_tiles(monkeypatch):
    monkeypatch.setenv("QFUSE_KERNEL", "triton")
    x, w, w_scale, bias = cuda(*operands((64, 256), n=128))
    marker = qfuse.graphs_compiled()
    compiled = torch.compile(int_mm_linear, backend="qfuse", mode="max-autotune-no-cudagraphs")
    out = compiled(x, w, w_scale, bias)
    (record,) = qfuse.reports_since(marker)[-1].fused
    assert record.lowered.startswith("Triton template, autotuned by Inductor among"), record.lowered
    torch.testing.assert_close(out, eager_int8(x, w, w_scale, bias), rtol=1e-4, atol=1e-4)


def test_the_next_pointwise_op_joins_the_template():
    x, w, w_scale, bias = cuda(*operands((64, 256), n=128))

    def linear_relu(x, w, w_scale, bias):
        return torch.relu(int_mm_linear(x, w, w_scale, bias)).to(torch.bfloat16)

    out, code, _ = triton_code(linear_relu, x, w, w_scale, bias)
    assert TEMPLATE_MARK in code and last_kernel(code).startswith("triton_tem_"), code
    torch.testing.assert_close(out, torch.relu(eager_int8(x, w, w_scale, bias)).to(torch.bfloat16))


SPLIT_K_MARK = "from qfuse.kernels.triton.weight_stream import k_range"


@pytest.mark.parametrize("dtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
@pytest.mark.parametrize("rows", [1, 5, 40, 128])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_narrow_n_splits_k_up_to_128_rows(dtype, rows, out_dtype):
    """Few column blocks (N = 256) over a deep K: the template writes each K range's unscaled sums
    (int32 for int8: exact), and their sum, the scales, the bias and the cast follow in Inductor's code."""
    if dtype == FP8_DTYPE and not FP8_CAPABLE:
        pytest.skip("fp8 needs capability >= 8.9")
    a, w = _quantized(rows, 16384, dtype), _quantized(256, 16384, dtype)
    scale_a, scale_b = torch.rand(rows, 1, device="cuda") / 100 + 1e-3, torch.rand(256, device="cuda") / 100 + 1e-3
    if rows > 1:
        scale_a[rows // 2] = float("inf")  # a non-finite activation scale makes its row nan, as in eager
    bias = torch.randn(256, device="cuda", dtype=out_dtype)
    out, code, _ = triton_code(_op, a, w.t(), scale_a, scale_b, bias, out_dtype)
    assert SPLIT_K_MARK in code and EXTERN_CALL not in code
    expected = torch.ops.qfuse.scaled_mm(a, w.t(), scale_a, scale_b, bias, None, None, torch.float32, "reference")
    assert out[rows // 2].isnan().all() == (rows > 1)
    tolerance = 1e-5 if dtype == torch.int8 and out_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance, equal_nan=True)


def test_prefill_shallow_k_and_block_scales_do_not_split_k():
    a, w = _quantized(40, 4096, torch.int8), _quantized(256, 4096, torch.int8)  # 16 steps of 256: not worth a split
    out, code, _ = triton_code(_op, a, w.t(), torch.rand(40, 1, device="cuda"), torch.rand(256, device="cuda"), None,
                               torch.bfloat16)
    assert TEMPLATE_MARK in code and SPLIT_K_MARK not in code
    a, w = _quantized(300, 16384, torch.int8), _quantized(256, 16384, torch.int8)
    out, code, _ = triton_code(_op, a, w.t(), torch.rand(300, 1, device="cuda"), torch.rand(256, device="cuda"), None,
                               torch.bfloat16)
    assert TEMPLATE_MARK in code and SPLIT_K_MARK not in code
    if FP8_CAPABLE:
        # K = 16384, N = 256: the [128, 2] block scale holds N values, and is still no per-column scale
        a, w = _quantized(8, 16384, FP8_DTYPE), _quantized(256, 16384, FP8_DTYPE)
        for scale_a in torch.rand(8, 128, device="cuda"), torch.rand(8, 1, device="cuda"):
            scale_b = torch.rand(128, 2, device="cuda")
            out, code, _ = triton_code(_op, a, w.t(), scale_a, scale_b, None, torch.bfloat16)
            assert TEMPLATE_MARK in code and SPLIT_K_MARK not in code
            expected = torch.ops.qfuse.scaled_mm(a, w.t(), scale_a, scale_b, None, None, None, torch.float32, "reference")
            assert (out.float() - expected).norm() / expected.norm() < 1e-2


def test_the_report_says_k_was_split():
    x, w, w_scale, bias = cuda(*operands((5, 16384), n=256))
    out, code, report = triton_code(int_mm_linear, x, w, w_scale, bias)
    (record,) = report.fused
    assert SPLIT_K_MARK in code and "K split in" in record.lowered, record.lowered
    expected = eager_int8(x, w, w_scale, bias)  # a norm: a few activations round to the other int8 on the CPU
    assert (out - expected).norm() / expected.norm() < 1e-3


@pytest.mark.skipif(not FP8_CAPABLE or torch.cuda.get_device_capability() < (9, 0), reason="Hopper's fp8 choices")
def test_dynamic_m_fp8_with_the_row_wise_gemm_as_choice_has_three_buckets():
    """Where the pass takes ATen's row-wise GEMM (no bias, bf16 out): M <= 16 the Triton template, up to
    128 rows cuBLAS with unit scales and the epilogue in Inductor's code, above the row-wise GEMM."""
    from tests.test_cuda import fp8_linear_without_bias

    x, w, w_scale, _ = operands((1, 256), n=144)
    _, w, w_scale = cuda(x, fp8_weight(w), w_scale)
    results, reports = per_bucket(fp8_linear_without_bias, (5, 300, 64), w, w_scale)
    for result, x, _ in results:
        expected = fp8_linear_without_bias(x, w, w_scale).float()
        assert (result.float() - expected).norm() / expected.norm() < 1e-2
    assert [bool(code) for _, _, code in results] == [True, True, True]
    decode, prefill, skinny = (report.fused[0] for report in reports)
    assert {decode.kernel, prefill.kernel, skinny.kernel} == {"cutlass"}  # the pass's choice; buckets switch
    assert "Triton template" in decode.lowered, decode.lowered
    assert prefill.lowered.startswith("ATen row-wise _scaled_mm (CUTLASS)"), prefill.lowered
    assert "M above 16" in skinny.lowered and skinny.lowered.endswith("fused pointwise code"), skinny.lowered
    assert "_scaled_mm(" in results[2][2] and TEMPLATE_MARK not in results[2][2]


PERSISTENT_MARK = "from qfuse.kernels.triton.persistent_mm import descriptor_product"
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _persistent_rows(extra: int = 0) -> int:
    from qfuse.kernels.triton.persistent_mm import MIN_M

    return MIN_M["int8"] + extra


@pytest.mark.skipif(not HOPPER, reason="the persistent template needs Hopper's TMA")
@pytest.mark.parametrize("shape", [(_persistent_rows(37), 256), (3, _persistent_rows(5), 512)], ids=["2D", "3D"])
def test_int8_at_large_m_runs_the_persistent_template_with_its_epilogue_fused(shape):
    """From MIN_M rows on Hopper: one program per multiprocessor walks the tiles (M and N not tile
    multiples here), and what follows joins the store inside its tile loop: the scales, bias and
    cast; in 2D also a residual add (in 3D Inductor leaves an add on the [B, S, N] view of the
    template's [M, N] output to its own kernel, for either template)."""
    x, w, w_scale, bias = cuda(*operands(shape, n=136))
    residual = torch.randn(*shape[:-1], 136, device="cuda") if len(shape) == 2 else torch.zeros((), device="cuda")

    def linear_add(x, w, w_scale, bias, residual):
        return (int_mm_linear(x, w, w_scale, bias) + residual).to(torch.bfloat16)

    form = linear_add if len(shape) == 2 else lambda x, w, w_scale, bias, _: int_mm_linear(x, w, w_scale, bias)
    out, code, report = triton_code(form, x, w, w_scale, bias, residual)
    assert PERSISTENT_MARK in code and TEMPLATE_MARK not in code and EXTERN_CALL not in code
    assert last_kernel(code).startswith("triton_tem_"), re.findall(r"(\w+)\.run\(", code)
    (record,) = report.fused
    assert record.lowered.startswith("Triton persistent TMA template"), record.lowered
    # a norm: a few activations round to the other int8 on the CPU
    expected = (eager_int8(x, w, w_scale, bias) + residual).to(out.dtype).float()
    assert (out.float() - expected).norm() / expected.norm() < 1e-3


@pytest.mark.skipif(not HOPPER, reason="the persistent template needs Hopper's TMA")
def test_dynamic_m_takes_the_persistent_template_from_its_bound():
    _, w, w_scale, bias = cuda(*operands((1, 256), n=136))
    results, reports = per_bucket(int_mm_linear, (_persistent_rows(100), 300, _persistent_rows(900)), w, w_scale,
                                  bias, kernel="triton")
    for out, x, _ in results:
        expected = eager_int8(x, w, w_scale, bias)
        assert (out - expected).norm() / expected.norm() < 1e-3
    codes = [code for _, _, code in results]
    assert [bool(code) for code in codes] == [True, True, False]
    assert PERSISTENT_MARK in codes[0] and TEMPLATE_MARK in codes[1] and PERSISTENT_MARK not in codes[1]
    assert "not the persistent template: M below" in reports[1].fused[0].lowered, reports[1].fused[0].lowered


@pytest.mark.skipif(not HOPPER, reason="the persistent template needs Hopper's TMA")
def test_max_autotune_benchmarks_the_persistent_template_with_the_tiles(monkeypatch):
    monkeypatch.setenv("QFUSE_KERNEL", "triton")
    x, w, w_scale, bias = cuda(*operands((_persistent_rows(), 256), n=128))
    marker = qfuse.graphs_compiled()
    compiled = torch.compile(int_mm_linear, backend="qfuse", mode="max-autotune-no-cudagraphs")
    out = compiled(x, w, w_scale, bias)
    (record,) = qfuse.reports_since(marker)[-1].fused
    assert record.lowered.startswith("Triton template, autotuned by Inductor among"), record.lowered
    assert "(the persistent TMA template among them)" in record.lowered, record.lowered
    expected = eager_int8(x, w, w_scale, bias)
    assert (out - expected).norm() / expected.norm() < 1e-3

