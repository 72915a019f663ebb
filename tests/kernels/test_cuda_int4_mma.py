"""The CUDA W4A16 decode kernel's layout (`qfuse.kernels.cuda.int4_mma`), checked on the CPU: `repack`'s words
read the way the kernel's lanes read them into mma.m16n8k16's A and B fragments give eager's linear.

The emulation follows the PTX fragment layout of mma.m16n8k16 (lane l = 4 g + t: A rows g and g + 8, k slots
2t, 2t + 1, 2t + 8, 2t + 9; B column g, the same slots) and the .cu file's dequantize: nibble pairs
(bits 0 / 16, 4 / 20, 8 / 24, 12 / 28) to a0, a1, a2, a3, lane t's B for step s at k = 16 t + 4 s + 0..3.
The kernel itself runs on the GPU machine (tests/lowerings/test_int4_template.py's GPU cases)."""

import pytest
import torch

from qfuse.kernels.cuda.int4_mma import repack, why_not_shape


def emulated_mma(x: torch.Tensor, words: torch.Tensor, pairs: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M <= 8, K] @ w^T in float64, reading `words` and `pairs` as the kernel's lanes do."""
    m, k = x.shape
    tiles, chunks = words.shape[:2]
    n = tiles * 16
    halves = pairs.view(torch.int16).view(torch.bfloat16).reshape(pairs.shape[0], n, 2).double()
    scale, minus_zero = halves[..., 0], halves[..., 1]
    out = torch.zeros(n, 8, dtype=torch.float64)
    columns = torch.zeros(k, 8, dtype=torch.float64)
    columns[:, :m] = x.double().t()
    for tile in range(tiles):
        for chunk in range(chunks):
            group = chunk * 64 // group_size
            for step in range(4):
                a, b = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    word = int(words[tile, chunk, lane, step]) & 0xFFFFFFFF
                    nibble = [(word >> (4 * j)) & 0xF for j in range(8)]
                    k0 = chunk * 64 + 16 * t + 4 * step
                    for (row, slot), j in {(g, 2 * t): 0, (g, 2 * t + 1): 4, (g + 8, 2 * t): 1, (g + 8, 2 * t + 1): 5,
                                           (g, 2 * t + 8): 2, (g, 2 * t + 9): 6, (g + 8, 2 * t + 8): 3,
                                           (g + 8, 2 * t + 9): 7}.items():
                        n_row = tile * 16 + row
                        value = (128 + nibble[j] + minus_zero[group, n_row]) * scale[group, n_row]
                        a[row, slot] = float(value.to(torch.bfloat16))  # rounded once, as eager
                    for slot, e in ((2 * t, 0), (2 * t + 1, 1), (2 * t + 8, 2), (2 * t + 9, 3)):
                        b[slot, g] = columns[k0 + e, g]
                out[tile * 16: tile * 16 + 16] += a @ b
    return out[:, :m].t()


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("group_size", [64, 128])
def test_the_lanes_read_eagers_linear_from_the_repacked_weight(zero_points, group_size):
    generator = torch.Generator().manual_seed(0)
    n, k, m = 32, 128, 3
    values = torch.randint(-8, 8, (k, n), generator=generator, dtype=torch.int8)
    scale = (torch.rand(k // group_size, n, generator=generator) / 16).to(torch.bfloat16)
    zero = torch.randint(-8, 8, (k // group_size, n), generator=generator, dtype=torch.int8) if zero_points else None
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    words, pairs = repack(values, scale, zero)
    assert words.shape == (n // 16, k // 64, 32, 4) and words.dtype == torch.int32 and pairs.shape == (k // group_size, n)
    group = torch.arange(k) // group_size
    z = zero.to(torch.int32)[group] if zero_points else 0
    w = ((values.to(torch.int32) - z).to(torch.bfloat16) * scale[group]).double()  # [K, N], eager's rounding
    torch.testing.assert_close(emulated_mma(x, words, pairs, group_size), x.double() @ w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n, k, group_size, reason", [
    (4096, 4096, 128, ""), (4096, 4096, 4096, ""), (4104, 4096, 128, "N is not a multiple of 16"),
    (4096, 4128, 32, "K is not a multiple of 64"), (4096, 4096, 32, "groups of 32"),
])
def test_the_shapes_it_takes(n, k, group_size, reason):
    assert why_not_shape(n, k, group_size).startswith(reason) and bool(why_not_shape(n, k, group_size)) == bool(reason)


def test_bad_input_is_named_before_any_launch():
    from qfuse.kernels import get_kernel
    from qfuse.kernels.cuda.int4_mma import int4_mma

    values = torch.zeros(128, 32, dtype=torch.int8)
    scale = torch.ones(1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="groups of 32"):
        repack(torch.zeros(128, 32, dtype=torch.int8), torch.ones(4, 32, dtype=torch.bfloat16), None)
    weight = get_kernel("cuda").prepare_int4_weight(values, scale, None)
    assert weight.packing == "int4_mma_bf16"
    with pytest.raises(ValueError, match="prepared for int4_mma_bf16, and x is torch.float16"):
        get_kernel("cuda").weight_only_apply(torch.zeros(1, 128, dtype=torch.float16), weight, None, torch.float16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        int4_mma(torch.zeros(17, 128, dtype=torch.bfloat16), weight.data, weight.scale, None, 128, torch.bfloat16)
