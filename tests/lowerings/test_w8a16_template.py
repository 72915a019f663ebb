"""The Triton W8A16 kernel as an Inductor template (GPU only; run on the GPU machine): the fp8 weight-only
peer forms (per channel, 128 x 128 blocks by repeat_interleave or a blocked view) and an int8 one
compile at decode and batched decode (up to 128 rows, a tile per M bucket) to one template kernel that
reads the stored weight and scale (no extern call of qfuse's op, no dequantized weight), and above
to Inductor's own dequantize + mm; numerics equal
to eager in bf16 / fp32, bias, 3D, static and dynamic M, default mode, max-autotune and CUDA
graphs, the next pointwise op fused into the store."""

import pytest
import torch

from qfuse.kernels.triton.w8a16_mm import BATCHED_TILES, TEMPLATE_MAX_ROWS
from tests.helpers import assert_close_to_eager, assert_one_compile_per_m_bucket, compile_and_get_code
from tests.peers.weight_only_models import fp8_weight_only, hand_written_int8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TEMPLATE_MARK = "from qfuse.kernels.triton.w8a16_mm import w8a16_dot"
EXTERN_CALL = "torch.ops.qfuse.weight_only_scaled_mm.default("
BF16, FP32 = torch.bfloat16, torch.float32


def cuda_model(dtype, scales, **sizes):
    return fp8_weight_only(dtype, scales, **sizes).cuda()


@pytest.mark.parametrize("dtype", [BF16, FP32])  # fp16: not rewritten (tests/passes/test_fp8_weight_only.py)
@pytest.mark.parametrize("scales", ["channel", "block_repeat", "block_view"])
def test_fp8_forms_run_as_the_template_at_decode(dtype, scales):
    model = cuda_model(dtype, scales, in_features=512, out_features=384)
    x = torch.randn(5, 512, device="cuda", dtype=dtype)
    with torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    assert TEMPLATE_MARK in code and EXTERN_CALL not in code
    (record,) = report.fused
    assert record.kernel == "triton" and record.lowered.startswith("Triton template"), record.lowered


@pytest.mark.parametrize("shape", [(1, 256), (2, 3, 256), (17, 256), (100, 256), (3, 70, 256), (300, 256)],
                         ids=["M1", "3D_decode", "M17", "M100", "3D", "M300"])
@pytest.mark.parametrize("sizes", [dict(in_features=256, out_features=384), dict(in_features=256, out_features=200)],
                         ids=["even", "N200"])
def test_decode_is_the_template_and_prefill_inductors_dequantize_and_mm(shape, sizes):
    model = cuda_model(BF16, "block_repeat", **sizes)
    x = torch.randn(*shape, device="cuda", dtype=BF16)
    with torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    (record,) = report.fused
    assert EXTERN_CALL not in code
    if x.numel() // 256 <= TEMPLATE_MAX_ROWS:  # decode and batched decode
        assert TEMPLATE_MARK in code and record.lowered.startswith("Triton template"), record.lowered
    else:
        assert TEMPLATE_MARK not in code and record.lowered.startswith("Inductor's own dequantize + mm"), record.lowered


def test_int8_weight_only_runs_as_the_template():
    model = hand_written_int8(BF16, scale_after_matmul=False, in_features=256, out_features=128).cuda()
    x = torch.randn(2, 3, 256, device="cuda", dtype=BF16)
    with torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    (record,) = report.fused
    assert record.kernel == "triton" and TEMPLATE_MARK in code and EXTERN_CALL not in code, report.table()


def test_dynamic_m_compiles_once_per_m_bucket():
    assert_one_compile_per_m_bucket(cuda_model(BF16, "block_repeat"), TEMPLATE_MARK, EXTERN_CALL,
                                    bounds=(16, *BATCHED_TILES))


@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "reduce-overhead"])
def test_modes(mode):
    model = cuda_model(BF16, "block_repeat")
    x = torch.randn(16, 256, device="cuda", dtype=BF16)
    with torch.no_grad():
        out, code, _ = compile_and_get_code(model, x, mode=mode)
        assert_close_to_eager(out, model, x)
    assert TEMPLATE_MARK in code and EXTERN_CALL not in code


def test_the_cast_and_next_op_fuse_into_the_store():
    model = cuda_model(BF16, "channel", in_features=4096, out_features=256)

    def block(x):
        return torch.nn.functional.silu(model(x)) * 2

    x = torch.randn(8, 4096, device="cuda", dtype=BF16)
    with torch.no_grad():
        out, code, report = compile_and_get_code(block, x)
        expected = torch.nn.functional.silu(model(x)) * 2
    split = "K split" in report.fused[0].lowered  # the sum of the splits is one more kernel, with the silu in it
    assert code.count(".run(") == (2 if split else 1), code
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
