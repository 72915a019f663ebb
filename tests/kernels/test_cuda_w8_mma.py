"""The CUDA 8-bit decode kernel's layout (`qfuse.kernels.cuda.w8_mma`), checked on the CPU: `repack`'s words read
the way the kernel's lanes read them into the A and B fragments of mma.m16n8k32 (W8A8) and of two
mma.m16n8k16 (W8A16) give eager's product.

The emulation follows the PTX fragment layouts (lane l = 4 g + t; m16n8k32: a0..a3 rows g, g + 8, g, g + 8 at
k slots 4t..4t+3, 4t..4t+3, 16+4t.., 16+4t..; m16n8k16: a0..a3 rows g, g + 8, g, g + 8 at slots 2t, 2t+1 |
2t+8, 2t+9; B column g at the same slots) and the .cu file's header: which word and bytes feed which
register, which k of x a slot holds. The kernel itself runs on the GPU machine (tests/kernels/test_cuda_gpu.py)."""

import dataclasses

import pytest
import torch

from qfuse.kernels.cuda.w8_mma import repack, why_not_shape
from qfuse.schemes import FP8_DTYPE


def _values(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, C, 32 lanes, 4 words, 4 bytes] float64 values of the stored bytes."""
    return words.contiguous().view(torch.uint8).view(dtype).double().reshape(*words.shape, 4)


def _emulation(x: torch.Tensor, words: torch.Tensor, dtype: torch.dtype):
    """(the stored values [T, C, 32, 4, 4], x's rows as the MMA's 8 B columns [K, 8], the float64 sums [N, 8])."""
    columns = torch.zeros(x.shape[1], 8, dtype=torch.float64)
    columns[:, :x.shape[0]] = x.double().t()
    return _values(words, dtype), columns, torch.zeros(words.shape[0] * 16, 8, dtype=torch.float64)


def emulated_k32(x: torch.Tensor, words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [M <= 8, K] @ w^T, reading `words` as the lanes of mma.m16n8k32 do."""
    values, columns, out = _emulation(x, words, dtype)
    tiles, chunks = words.shape[:2]
    for tile in range(tiles):
        for chunk in range(chunks):
            a, b = torch.zeros(16, 32, dtype=torch.float64), torch.zeros(32, 8, dtype=torch.float64)
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for register in range(4):  # a_i: row g + 8 (i & 1), slots 4t + e (+ 16 for i >= 2)
                    for e in range(4):
                        a[g + 8 * (register & 1), 4 * t + e + 16 * (register >> 1)] = values[tile, chunk, lane, register, e]
                for e in range(4):  # b0: slots 4t + e = k 8t + e; b1: slots 16 + 4t + e = k 8t + 4 + e
                    b[4 * t + e, g] = columns[32 * chunk + 8 * t + e, g]
                    b[16 + 4 * t + e, g] = columns[32 * chunk + 8 * t + 4 + e, g]
            out[16 * tile: 16 * tile + 16] += a @ b
    return out[:, :x.shape[0]].t()


def emulated_k16(x: torch.Tensor, words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [M <= 8, K] @ w^T, reading `words` as the lanes of two mma.m16n8k16 a chunk do (step s: a0 | a2 the
    low | high bytes of word 2s, a1 | a3 of word 2s + 1; b0 | b1 x at k 8t + 4s + 0, 1 | 2, 3)."""
    values, columns, out = _emulation(x, words, dtype)
    tiles, chunks = words.shape[:2]
    for tile in range(tiles):
        for chunk in range(chunks):
            for step in range(2):
                a, b = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    for register, (word, high) in enumerate(((2 * step, 0), (2 * step + 1, 0), (2 * step, 1),
                                                             (2 * step + 1, 1))):
                        row, slot = g + 8 * (register & 1), 2 * t + 8 * (register >> 1)
                        a[row, slot] = values[tile, chunk, lane, word, 2 * high]
                        a[row, slot + 1] = values[tile, chunk, lane, word, 2 * high + 1]
                    k0 = 32 * chunk + 8 * t + 4 * step
                    b[2 * t, g], b[2 * t + 1, g] = columns[k0, g], columns[k0 + 1, g]
                    b[2 * t + 8, g], b[2 * t + 9, g] = columns[k0 + 2, g], columns[k0 + 3, g]
                out[16 * tile: 16 * tile + 16] += a @ b
    return out[:, :x.shape[0]].t()


@pytest.mark.parametrize("emulated", [emulated_k32, emulated_k16])
@pytest.mark.parametrize("dtype", [torch.int8, FP8_DTYPE])
def test_the_lanes_read_eagers_product_from_the_repacked_weight(emulated, dtype):
    generator = torch.Generator().manual_seed(0)
    n, k, m = 32, 64, 5
    if dtype == torch.int8:
        w = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
    else:
        w = (torch.randn(n, k, generator=generator) * 50).to(dtype)
    b = w.t()  # the [K, N] view the ops hand a kernel
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    words = repack(b)
    assert words.shape == (n // 16, k // 32, 32, 4) and words.dtype == torch.int32
    torch.testing.assert_close(emulated(x, words, dtype), x.double() @ b.double(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n, k, reason", [
    (4096, 4096, ""), (4096, 32, ""), (4104, 4096, "N is not a multiple of 16"), (4096, 4112, "K is not a multiple of 32"),
])
def test_the_shapes_it_takes(n, k, reason):
    assert why_not_shape(n, k).startswith(reason) and bool(why_not_shape(n, k)) == bool(reason)


@pytest.mark.parametrize("m, n, int8_activations, shape", [
    (1, 4096, True, (1, 16, 2)), (1, 4096, False, (1, 16, 8)), (8, 14336, False, (2, 8, 8)), (16, 4096, False, (1, 16, 2)),
    (1, 14336, True, (2, 8, 4)), (16, 14336, False, (2, 4, 4)), (1, 8208, True, (1, 4, 4)), (32, 4096, False, (1, 8, 2)),
    (32, 28672, False, (1, 4, 2)), (64, 4096, False, (2, 4, 4)), (64, 8208, False, (1, 4, 4))])
def test_the_launch_rule(m, n, int8_activations, shape):
    """Two row tiles a block only for an even number of at least 512 tiles (N = 8208 has 513: one tile a block,
    or its last 16 rows would have no block); 8 chunks ahead up to 8 rows but for int8 activations; above 16 rows
    one tile on 8 warps (4 past 1024 tiles), above 32 two tiles (an even number) on 4."""
    from qfuse.kernels.cuda.w8_mma import launch_shape

    assert launch_shape(m, n, int8_activations) == shape


def test_the_weight_is_prepared_once_and_its_scale_read_per_call():
    """The preparation leaves the weight scale out (`reads_weight_scale_per_call`): a scale the model computes on
    every call (a new tensor each time: torchao's bf16 linears cast a float32 one) reuses the one prepared weight,
    with that call's scale attached."""
    from qfuse.kernels import get_kernel
    from qfuse.kernels.prepared import prepare_once

    kernel = get_kernel("cuda")
    b, stored = torch.randint(-128, 128, (64, 32), dtype=torch.int8), torch.rand(1, 32)
    first = prepare_once(kernel, b, stored.to(torch.bfloat16), None)
    second_scale = (stored * 2).to(torch.bfloat16)
    second = prepare_once(kernel, b, second_scale, None)
    assert first.data is second.data and torch.equal(first.data, repack(b))
    assert second.scale is second_scale and first.scale is not second_scale


def test_bad_input_is_named_before_any_launch():
    from qfuse.kernels import get_kernel

    cuda = get_kernel("cuda")
    with pytest.raises(ValueError, match="K is not a multiple of 32"):
        repack(torch.zeros(48, 32, dtype=torch.int8))
    with pytest.raises(ValueError, match="symmetric weights"):
        cuda.prepare_weight(torch.zeros(64, 32, dtype=torch.int8), None, torch.zeros(1, 32, dtype=torch.int32))
    blocks = dataclasses.replace(cuda.prepare_weight(torch.zeros(256, 256, dtype=FP8_DTYPE), None, None),
                                 scale=torch.ones(2, 2))  # the scale a call attaches (read per call)
    with pytest.raises(ValueError, match="block scales"):
        cuda.apply(torch.zeros(1, 256, dtype=FP8_DTYPE), blocks, None, None, None, torch.bfloat16)
    as_many_as_columns = dataclasses.replace(cuda.prepare_weight(torch.zeros(16384, 256, dtype=torch.int8), None, None),
                                             scale=torch.ones(128, 2))  # [K / 128, N / 128]: 256 values, N of them
    with pytest.raises(ValueError, match="block scales"):
        cuda.apply(torch.zeros(1, 16384, dtype=torch.int8), as_many_as_columns, None, None, None, torch.bfloat16)
    weight = cuda.prepare_weight(torch.zeros(64, 32, dtype=torch.int8), torch.ones(1, 32), None)
    with pytest.raises(ValueError, match="W8A16 GEMM takes a bf16 or fp16 activation, not fp32"):
        cuda.weight_only_apply(torch.zeros(1, 64, dtype=torch.float32), weight, None, torch.bfloat16)
    with pytest.raises(ValueError, match="one activation scale or one a row"):
        cuda.apply(torch.zeros(2, 64, dtype=torch.int8), weight, torch.ones(2, 2), None, None, torch.bfloat16)


# --- on the GPU machine: the kernel against the reference math (skipped without CUDA) -----------------------

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FP8_CAPABLE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
#: (M, N, K): each number of 8-column tiles of B (1, 2, 4, 8), two launches (M > 64), one and two row tiles a block
#: (8192: two; 16400, 1025 tiles, and 8208, 513: one; at 64 rows too), Llama's shapes
SIZES = [(1, 16, 32), (5, 48, 96), (9, 64, 4096), (16, 4096, 4096), (17, 1024, 14336), (40, 32, 256), (64, 4096, 512),
         (70, 48, 128), (3, 16400, 64), (2, 8192, 64), (64, 8192, 64), (64, 8208, 64)]
ROUNDING = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}


def _weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
    return (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(dtype)


def _assert_within_rounding(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Within two roundings of the output dtype of the largest value; inf and nan where the reference has them."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    finite = expected.isfinite()
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out[~finite & ~expected.isnan()],
                                                                       expected[~finite & ~expected.isnan()])
    scale = expected[finite].float().abs().max().item() if finite.any() else 0.0
    assert (out[finite].float() - expected[finite].float()).abs().max().item() <= 2 * ROUNDING[out.dtype] * scale


@GPU
@pytest.mark.parametrize("dtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
@pytest.mark.parametrize("m, n, k", SIZES)
@pytest.mark.parametrize("scales, bias_dtype, out_dtype", [
    ("row", None, torch.bfloat16), ("tensor", torch.float32, torch.float16), ("row_bf16", torch.bfloat16, torch.float32),
    ("none", torch.bfloat16, torch.bfloat16)])
def test_w8a8_on_the_gpu_is_the_reference_math(dtype, m, n, k, scales, bias_dtype, out_dtype):
    from qfuse.kernels import get_kernel, reference_math

    if dtype == FP8_DTYPE and not FP8_CAPABLE:
        pytest.skip("fp8 needs capability >= 8.9")
    torch.manual_seed(0)
    a, b = _weight(m, k, dtype), _weight(n, k, dtype).t()
    scale_a = {"row": torch.rand(m, 1, device="cuda") / 100, "tensor": torch.tensor(0.01, device="cuda"),
               "row_bf16": (torch.rand(m, 1, device="cuda") / 100).to(torch.bfloat16), "none": None}[scales]
    scale_b = None if scales == "none" else torch.rand(1, n, device="cuda") / 100
    bias = None if bias_dtype is None else torch.randn(n, device="cuda").to(bias_dtype)
    cuda = get_kernel("cuda")
    out = cuda.apply(a, cuda.prepare_weight(b, scale_b, None), scale_a, bias, None, out_dtype)
    _assert_within_rounding(out, reference_math.scaled_mm(a, b, scale_a, scale_b, bias, None, None, out_dtype))


@GPU
@pytest.mark.parametrize("weight_dtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m, n, k", SIZES)
@pytest.mark.parametrize("scale, bias", [("channel", True), ("tensor", False), ("none", False)])
def test_w8a16_on_the_gpu_is_the_reference_math(weight_dtype, dtype, m, n, k, scale, bias):
    from qfuse.kernels import get_kernel, reference_math

    if weight_dtype == FP8_DTYPE and not FP8_CAPABLE:
        pytest.skip("fp8 needs capability >= 8.9")
    torch.manual_seed(0)
    x, b = torch.randn(m, k, device="cuda", dtype=dtype), _weight(n, k, weight_dtype).t()
    scale_b = {"channel": (torch.rand(1, n, device="cuda") / (64 * k**0.5)).to(dtype),
               "tensor": torch.tensor(1 / (64 * k**0.5), device="cuda"), "none": None}[scale]
    bias = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    cuda = get_kernel("cuda")
    out = cuda.weight_only_apply(x, cuda.prepare_weight(b, scale_b, None), bias, dtype)
    _assert_within_rounding(out, reference_math.weight_only_scaled_mm(x, b, scale_b, bias, None, dtype))


@GPU
@pytest.mark.skipif(not FP8_CAPABLE, reason="fp8 needs capability >= 8.9")
def test_inf_and_nan_follow_the_reference():
    """A NaN in an fp8 weight makes its column NaN (the conversion keeps it), an inf in x its row inf or NaN,
    an infinite activation scale its row NaN, as eager's math has them."""
    from qfuse.kernels import get_kernel, reference_math

    torch.manual_seed(0)
    m, n, k = 3, 32, 64
    w = _weight(n, k, FP8_DTYPE)
    w[5, 7] = float("nan")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x[1, 3] = float("inf")
    cuda = get_kernel("cuda")
    out = cuda.weight_only_apply(x, cuda.prepare_weight(w.t(), None, None), None, torch.bfloat16)
    expected = reference_math.weight_only_scaled_mm(x, w.t(), None, None, None, torch.bfloat16)
    assert out[:, 5].isnan().all()
    _assert_within_rounding(out, expected)
    a = _weight(m, k, FP8_DTYPE)
    scale_a = torch.tensor([[0.5], [float("inf")], [0.25]], device="cuda")
    out = cuda.apply(a, cuda.prepare_weight(_weight(n, k, FP8_DTYPE).t(), None, None), scale_a, None, None, torch.float32)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()
