"""Triton W4A16: x @ w^T for an int4 weight packed eight to an int32 along K, dequantized in registers.

    words   packed [N, K / 8] int32, as GPTQ (v2) and compressed-tensors store it (any strides)
    q[n, k] = (words[n, k // 8] >> shifts[k % 8]) & 0xF         shifts: a stored int32 [8], or 4 * (k % 8)
    z[n, g] = 8, or (packed_zeros[n // 8, g] >> shifts[n % 8]) & 0xF
    w[n, k] = (q - z) * scales[n, k // group_size]              rounded once to x's dtype, as eager rounds it
    out     = x @ w^T (fp32 accumulation; fp32 x in IEEE fp32, as eager's matmul) + bias

(the formula of `qfuse::int4_weight_only_mm`, `qfuse.ops.int4_weight_only`). `(q - z) * s` is exact
in float32 (a 5-bit integer times a scale of at most 11 significant bits), so the tile handed to
`tl.dot` is, element for element, the weight eager dequantizes; only the order of the sum differs.

The same `int4_dot` main loop serves the eager launcher (`triton_int4_mm`, the op's extern call) and
the Inductor template (`qfuse.lowerings.int4_template`), which reads the model's stored tensors
directly: nothing is unpacked or repacked, and the weight costs nothing per call but its read.

The weight tile is loaded as [BLOCK_K, BLOCK_N] pointers into the words (eight rows of k share a
word; the repeats hit L1), so that one `tl.dot` takes it. A K step reads one scale per column when
it lies inside one group (`BLOCK_K` divides the group size, or one group spans K: per channel), else
one per element (groups narrower than the step). Tiles (`pick_int4_config`): at M <= 16 (decode)
the widest column block that still puts a program on most multiprocessors, since the time is how
fast the grid streams the weight; above, a tensor-core tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.base import DECODE_ROWS
from qfuse.kernels.triton.scaled_mm import grouped_tile, multiprocessors

NIBBLES = 8

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
PREFILL_TILE = (128, 128, 64, 8, 8, 3)
# M <= 16: (BLOCK_N, BLOCK_K, num_warps, num_stages) by the column-block width that fills the GPU.
DECODE_TILES = {128: (128, 128, 4, 4), 64: (64, 128, 4, 4), 32: (32, 256, 4, 4), 16: (16, 256, 2, 4)}
DECODE_GRID_FILL = 0.75
# Extra tiles Inductor benchmarks under max-autotune.
AUTOTUNE_TILES = (
    (16, 32, 256, 8, 4, 4), (16, 64, 128, 8, 4, 4), (16, 128, 128, 8, 4, 4), (32, 64, 128, 8, 4, 4),
    (64, 128, 64, 8, 4, 3), (128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 128, 32, 8, 4, 4),
)


@triton.jit
def int4_weight_tile(W, SHIFTS, S, Z, k0, offs_k, offs_n, mask_k, mask_n, stride_wn, stride_wk, stride_sn, stride_sg,
                     stride_zn, stride_zg, GROUP_SIZE: tl.constexpr, ONE_GROUP_PER_STEP: tl.constexpr,
                     HAS_SHIFTS: tl.constexpr, HAS_ZEROS: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr):
    """The dequantized [BLOCK_K, BLOCK_N] tile w^T[offs_k, offs_n] in DTYPE (zero where k >= K)."""
    words = tl.load(W + offs_n[None, :] * stride_wn + (offs_k // 8)[:, None] * stride_wk,
                    mask=mask_k[:, None] & mask_n[None, :], other=0)
    if HAS_SHIFTS:
        shift = tl.load(SHIFTS + offs_k % 8)
    else:
        shift = (offs_k % 8) * 4
    q = (words >> shift[:, None]) & 0xF
    if ONE_GROUP_PER_STEP:
        group = k0 // GROUP_SIZE
        scale = tl.load(S + offs_n * stride_sn + group * stride_sg, mask=mask_n, other=0.0)[None, :]
        zero_rows = offs_n // 8
        zero_offsets = zero_rows * stride_zn + group * stride_zg
        zero_mask = mask_n
        zero_shift_index = offs_n % 8
    else:
        groups = (offs_k // GROUP_SIZE)[:, None]
        scale = tl.load(S + offs_n[None, :] * stride_sn + groups * stride_sg,
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        zero_offsets = (offs_n // 8)[None, :] * stride_zn + groups * stride_zg
        zero_mask = mask_k[:, None] & mask_n[None, :]
        zero_shift_index = (offs_n % 8)[None, :]
    if HAS_ZEROS:
        if HAS_SHIFTS:
            zero_shift = tl.load(SHIFTS + zero_shift_index)
        else:
            zero_shift = zero_shift_index * 4
        zero = (tl.load(Z + zero_offsets, mask=zero_mask, other=0) >> zero_shift) & 0xF
        if ONE_GROUP_PER_STEP:
            zero = zero[None, :]
    else:
        zero = 8
    w = ((q - zero).to(tl.float32) * scale.to(tl.float32)).to(DTYPE)
    if not EVEN_K:
        w = tl.where(mask_k[:, None], w, tl.zeros_like(w))
    return w


@triton.jit
def int4_dot(X, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, K, stride_xm, stride_xk, stride_wn, stride_wk,
             stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE: tl.constexpr, ONE_GROUP_PER_STEP: tl.constexpr,
             HAS_SHIFTS: tl.constexpr, HAS_ZEROS: tl.constexpr, EVEN_K: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] tile of x @ w^T (the module docstring's formula, before bias)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = int4_weight_tile(W, SHIFTS, S, Z, k0, offs_k, offs_n, mask_k, mask_n, stride_wn, stride_wk, stride_sn,
                             stride_sg, stride_zn, stride_zg, GROUP_SIZE, ONE_GROUP_PER_STEP, HAS_SHIFTS, HAS_ZEROS,
                             EVEN_K, x.dtype)
        if x.dtype == tl.float32:  # eager's fp32 matmul is IEEE fp32, not TF32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def _int4_mm_kernel(X, W, SHIFTS, S, Z, BIAS, OUT, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_sn,
                    stride_sg, stride_zn, stride_zg, stride_om, stride_on, GROUP_SIZE: tl.constexpr,
                    ONE_GROUP_PER_STEP: tl.constexpr, HAS_SHIFTS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = int4_dot(X, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, K, stride_xm, stride_xk, stride_wn, stride_wk,
                   stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE, ONE_GROUP_PER_STEP, HAS_SHIFTS, HAS_ZEROS,
                   EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(OUT.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def step_meta(block_k: int, group_size: int, k: int) -> dict:
    """The constexprs that depend on the K step: whether a step lies in one group, whether K needs masks."""
    return dict(ONE_GROUP_PER_STEP=group_size % block_k == 0 or group_size >= k, EVEN_K=k % block_k == 0,
                GROUP_SIZE=group_size)


def pick_int4_config(m: int, n: int, multiprocessor_count: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) for M rows and N columns."""
    if m > DECODE_ROWS:
        return PREFILL_TILE
    widths = sorted(DECODE_TILES, reverse=True)
    width = next((w for w in widths if triton.cdiv(n, w) >= DECODE_GRID_FILL * multiprocessor_count), widths[-1])
    block_n, block_k, num_warps, num_stages = DECODE_TILES[width]
    return DECODE_ROWS, block_n, block_k, 1, num_warps, num_stages


def fit_block_k(block_k: int, group_size: int, k: int) -> int:
    """`block_k`, halved while a K step would straddle groups it could avoid (at least 16)."""
    while block_k > 16 and group_size % block_k and group_size < k:
        block_k //= 2
    return block_k


def triton_int4_mm(x: torch.Tensor, packed: torch.Tensor, shifts: torch.Tensor | None, scales: torch.Tensor,
                   packed_zeros: torch.Tensor | None, bias: torch.Tensor | None, group_size: int,
                   out_dtype: torch.dtype, config=None) -> torch.Tensor:
    """x [M, K] @ w^T + bias as `out_dtype`, w the int4 weight of the module docstring."""
    m, k = x.shape
    n = packed.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if m == 0:
        return out
    if n == 0 or k == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(out_dtype).expand(m, n))
    block_m, block_n, block_k, group_m, num_warps, num_stages = config or pick_int4_config(m, n, multiprocessors(x.device))
    block_k = fit_block_k(block_k, group_size, k)
    zeros = packed_zeros if packed_zeros is not None else packed
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _int4_mm_kernel[grid](
        x, packed, shifts if shifts is not None else packed, scales, zeros, bias if bias is not None else scales, out,
        m, n, k, *x.stride(), *packed.stride(), *scales.stride(), *zeros.stride(), *out.stride(),
        HAS_SHIFTS=shifts is not None, HAS_ZEROS=packed_zeros is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps,
        num_stages=num_stages, **step_meta(block_k, group_size, k),
    )
    return out
