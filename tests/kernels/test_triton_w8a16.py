"""The Triton W8A16 kernel (`qfuse.kernels.triton.w8a16_mm`) against float64 and the peer fp8 models.

Without a GPU it runs in Triton's interpreter (fp16 in place of bf16: the interpreter's bf16 dot is
wrong, tests/kernels/test_triton_int4.py). Covered: int8 and fp8 e4m3fn weights; no scale, one value,
per column and 128 x 128 block scales; tiles holding two blocks a step or lying in one; K split;
K and N no multiples of the step or the block; M = 0 / 1 / 17 and 3D through the op; a padded
prepared weight; the scale kinds read from the normalised shapes; a weight zero point refused.
"""

import pytest
import torch

pytest.importorskip("triton")

import qfuse.ops  # noqa: F401, E402  (registers torch.ops.qfuse)
from qfuse.kernels.triton.scaled_mm import BLOCK_SCALE, NO_SCALE, TENSOR_SCALE, VECTOR_SCALE  # noqa: E402
from qfuse.kernels.triton.w8a16_mm import (DECODE_TILE, PREFILL_TILE, batched_splits, pick_w8a16_config,  # noqa: E402
                                           scale_kind, triton_w8a16_mm)
from tests.helpers import slow_when_interpreted  # noqa: E402
from tests.peers.weight_only_models import fp8_weight_only  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8, FP16, FP32 = torch.float8_e4m3fn, torch.float16, torch.float32
HALF = torch.bfloat16 if DEVICE == "cuda" else FP16
TOLERANCE = {torch.bfloat16: 2**-7, FP16: 2**-10, FP32: 1e-5}


def weight_and_scale(weight_dtype, kind, k, n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    if weight_dtype == torch.int8:
        b = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8).t()
    else:
        b = (torch.randn(n, k, generator=generator) * 64).clamp(-448, 448).to(FP8).t()
    scale = {
        "none": None,
        "tensor": torch.tensor(0.003),
        "column": torch.rand(1, n, generator=generator) / 100 + 1e-3,
        "block": torch.rand(-(-k // 128), -(-n // 128), generator=generator) / 100 + 1e-3,
    }[kind]
    return b.to(DEVICE), None if scale is None else scale.to(DEVICE)


def float64_reference(x, b, scale, bias):
    k, n = b.shape
    w = b.double()
    if scale is not None:
        expanded = scale.double()
        if scale.dim() == 2 and tuple(scale.shape) != (1, n):
            expanded = expanded.repeat_interleave(128, 0).repeat_interleave(128, 1)[:k, :n]
        w = w * expanded
    out = x.double() @ w
    return out if bias is None else out + bias.double()


def assert_close(out, reference, dtype):
    if reference.numel() == 0:
        return
    scale = reference.abs().max().item()
    assert (out.double() - reference).abs().max().item() <= 2 * TOLERANCE[dtype] * max(scale, 1e-30)


@pytest.mark.parametrize("weight_dtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("kind", ["none", "tensor", "column", "block"])
@pytest.mark.parametrize("dtype", [HALF, FP32])
def test_matches_float64(weight_dtype, kind, dtype):
    b, scale = weight_and_scale(weight_dtype, kind, 384, 200)
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    bias = torch.randn(200).to(DEVICE)
    out = triton_w8a16_mm(x, b, scale, bias, dtype)
    assert out.dtype == dtype and out.shape == (5, 200)
    assert_close(out, float64_reference(x, b, scale, bias), dtype)


@slow_when_interpreted
@pytest.mark.parametrize("config", [(16, 32, 256, 1, 4, 2), (16, 64, 64, 1, 4, 2), (32, 16, 16, 8, 2, 1)],
                         ids=["two_blocks_a_step", "step_in_a_block", "small"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("kind", ["column", "block"])
def test_tiles_and_k_splits(config, splits, m, kind):
    b, scale = weight_and_scale(FP8, kind, 300, 136, seed=2)  # K and N no multiples of the step or the block
    x = torch.randn(m, 300, generator=torch.Generator().manual_seed(3)).to(HALF).to(DEVICE)
    out = triton_w8a16_mm(x, b, scale, None, FP32, config=config, splits=splits)
    assert_close(out, float64_reference(x, b, scale, None), HALF)


def test_block_scales_round_the_weight_once_to_the_activation_dtype():
    """As eager's `(w.float() * s).to(x.dtype)`: the peer's own forward, to the last bit of its weight."""
    model = fp8_weight_only(HALF, "block_repeat", in_features=256, out_features=136).to(DEVICE)
    model.weight_scale = model.weight_scale.to(DEVICE)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(HALF).to(DEVICE)
    out = triton_w8a16_mm(x, model.weight.t(), model.weight_scale.t(), model.bias, HALF)
    eager = model(x)
    exact = x.double() @ model.dequantized_weight().to(HALF).double().t() + model.bias.double()
    assert_close(out, exact, HALF)
    assert_close(out, eager.double(), HALF)


def test_only_the_first_k_rows_of_a_padded_weight_are_read():
    b, scale = weight_and_scale(torch.int8, "column", 40, 24)
    padded = torch.cat([b, torch.full((8, 24), 127, dtype=torch.int8, device=DEVICE)])  # garbage past K
    x = torch.randn(2, 40).to(DEVICE)
    assert_close(triton_w8a16_mm(x, padded, scale, None, FP32), float64_reference(x, b, scale, None), FP32)


def test_scale_kinds_and_tiles():
    assert scale_kind(None, 256, 300) == NO_SCALE
    assert scale_kind(torch.tensor(1.0), 256, 300) == TENSOR_SCALE
    assert scale_kind(torch.ones(1, 300), 256, 300) == VECTOR_SCALE
    assert scale_kind(torch.ones(2, 3), 256, 300) == BLOCK_SCALE
    assert pick_w8a16_config(16) == DECODE_TILE and pick_w8a16_config(129) == PREFILL_TILE
    assert [pick_w8a16_config(m)[0] for m in (17, 32, 33, 100, 128)] == [32, 32, 64, 128, 128]  # batched decode
    # K split while the programs stay within the bucket's programs a multiprocessor (H100: 132)
    shapes = ((4096, 4096), (4096, 14336), (14336, 4096))
    assert [[batched_splits(bucket, n, k, 128, 132) for n, k in shapes] for bucket in (32, 64, 128)] == [
        [1, 1, 1], [4, 4, 1], [4, 4, 1]]


@pytest.mark.parametrize("shape", [(0, 256), (1, 256), (17, 256), (2, 3, 256)], ids=["M0", "M1", "M17", "3D"])
@pytest.mark.parametrize("kind", ["column", "block"])
def test_the_op_on_the_triton_kernel(shape, kind):
    b, scale = weight_and_scale(FP8, kind, 256, 136, seed=5)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(6)).to(HALF).to(DEVICE)
    bias = torch.randn(136).to(HALF).to(DEVICE)
    out = torch.ops.qfuse.weight_only_scaled_mm(x, b, scale, bias, None, HALF, "triton")
    assert out.shape == (*shape[:-1], 136) and out.dtype == HALF
    reference = float64_reference(x.reshape(-1, 256), b, scale, bias).reshape(out.shape)
    assert_close(out, reference, HALF)


def test_a_weight_zero_point_is_refused_with_its_reason():
    b, scale = weight_and_scale(torch.int8, "column", 64, 32)
    x = torch.randn(2, 64).to(DEVICE)
    with pytest.raises(ValueError, match="symmetric weights"):
        torch.ops.qfuse.weight_only_scaled_mm(x, b, scale, None, torch.ones(32, dtype=torch.int32, device=DEVICE),
                                              FP32, "triton")


def test_decode_splits_k_only_where_the_column_blocks_leave_half_the_gpu_idle():
    from qfuse.kernels.triton.w8a16_mm import DECODE_PROGRAMS_PER_SM
    from qfuse.kernels.triton.weight_stream import split_k

    _, block_n, block_k, *_ = DECODE_TILE
    assert split_k(1, 4096, 4096, block_n, block_k, 132, DECODE_PROGRAMS_PER_SM) == 1  # 128 blocks: measured best
    assert split_k(1, 14336, 4096, block_n, block_k, 132, DECODE_PROGRAMS_PER_SM) == 1
    assert split_k(1, 1024, 4096, block_n, block_k, 132, DECODE_PROGRAMS_PER_SM) == 2  # 32 blocks for 132 SMs
    assert split_k(1024, 1024, 4096, block_n, block_k, 132, DECODE_PROGRAMS_PER_SM) == 1  # prefill: never
