"""Triton W4A16: x @ w^T for an int4 weight packed eight to an int32 along K, dequantized in registers.

    words   packed [N, K / 8] int32, as GPTQ (v2) and compressed-tensors store it (any strides: the
            transposed AutoGPTQ [K / 8, N] words too), or [K, N / 8] packed along N (AWQ)
    q[n, k] = (words[n, k // 8] >> shifts[k % 8]) & 0xF         shifts: a stored int32 [8], or 4 * (k % 8)
            = (words[k, n // 8] >> shifts[n % 8]) & 0xF         packed along N
    z[n, g] = 8, or (packed_zeros[n // 8, g] >> shifts[n % 8]) & 0xF, plus one by the zero convention
    w[n, k] = (q - z) * scales[n, k // group_size]              rounded once to x's dtype, as eager rounds it
    out     = x @ w^T (fp32 accumulation; fp32 x in IEEE fp32, as eager's matmul) + bias

(the formula of `qfuse::int4_weight_only_mm`, `qfuse.ops.int4_weight_only`). `(q - z) * s` is exact
in float32 (a 5-bit integer times a scale of at most 11 significant bits), so the tile handed to
`tl.dot` is, element for element, the weight eager dequantizes; only the order of the sum differs.
The op's int8 storage (torchao's intx: int8 [N, K] values, int8 zero points [N, K / g], `INT8_VALUES`)
is read value by value, whatever the values: a 9-bit difference times a bf16 / fp16 scale is still
exact in float32, and with float32 scales the one float32 rounding is eager's own.

The same `int4_dot` main loop serves the eager launcher (`triton_int4_mm`, the op's extern call) and
the Inductor template (`qfuse.lowerings.triton.int4`), which reads the model's stored tensors
directly: nothing is unpacked or repacked, and the weight costs nothing per call but its read.

A K step loads the words as they are stored, a [BLOCK_N, BLOCK_K / 8] tile contiguous along K,
unpacks them against the eight shifts into [BLOCK_N, BLOCK_K] (k = 8 * word + nibble), scales them
per group as [BLOCK_N, groups, group] (`BLOCK_K` and the group size divide one another, or one
group spans K: per channel) and multiplies as the left operand: acc^T [BLOCK_N, BLOCK_M] +=
w [BLOCK_N, BLOCK_K] @ x^T, the weight on the wide side of the tensor-core shape at decode.
The other structures tried were slower: the words as [BLOCK_K, BLOCK_N] pointers (eight k rows to a
word) load uncoalesced, and the nibble-split form (eight dots a step on k = 8 j + i) and the x @ w^T
orientation lost to this one at prefill and at every decode shape
(measured at decode: docs/benchmarks.md, "gpu_weight_only: W4A16 on the GPU").

Decode (M <= 16) has too few column blocks to keep the multiprocessors busy (N = 4096 in 64-wide
blocks is 64 programs for 132 multiprocessors), so K is split in `split_k` ranges whose float32
partial sums [SPLIT_K, M, N] are added after (`triton_int4_mm`; the template leaves the sum, the bias
and the cast to Inductor's code). It still reads the weight far below HBM bandwidth, as every other
structure tried did, and so beats the bf16 matmul by less than the int4 bytes would allow. Decode
calls whose K steps of 128 lie in one scale group (GPTQ g128, per channel) run on the nibble-plane
loop instead (`int4_planes`), in the eager launcher and as the lowering's template. Prefill runs on
Inductor's mm instead, the weight dequantized in front of it by `int4_weight_tile` in a template of its own
(`qfuse.lowerings.triton.dequantize`): this kernel takes several times cuBLAS's time there (both measured:
docs/benchmarks.md, "gpu_weight_only: W4A16 on the GPU").

AWQ's words, packed along N, are loaded as stored too, a [BLOCK_K, BLOCK_N / 8] tile unpacked along N
and transposed in registers: faster than Inductor at decode, but slower than the GPTQ tile at
14336 x 4096 (measured: docs/benchmarks.md, "AWQ (H100, 2026-11-25)").

No `g_idx` (GPTQ's act order) here: the op sorts the weight's rows by group once for this eager
launcher, and the lowering leaves act order to Inductor's code, because reading the stored words
in K order needs every column's scale and zero point gathered: a version that did was slower than
Inductor's dequantize + mm at decode (measured: docs/benchmarks.md, "AutoGPTQ with act order").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.base import DECODE_ROWS
from qfuse.kernels.triton.tile import GpuTable, Tile
from qfuse.kernels.int4_words import ZERO_CONVENTIONS
from qfuse.kernels.triton.int4_planes import PLANE_MAX_ROWS, takes_planes, triton_int4_planes_mm
from qfuse.kernels.triton.scaled_mm import multiprocessors
from qfuse.kernels.triton.weight_stream import (accumulate, activation_tile, batched_split_k, bucket_of,
                                                empty_result, fit_block_k, packed_zero_points, split_k, split_k_tile,
                                                step_meta, sum_splits)

PREFILL_TILE = Tile(128, 256, 128, 8, 8, 3)
# M <= 16: one tile, K split until there are DECODE_PROGRAMS_PER_SM programs a multiprocessor. The
# best of 24 (tile, split) pairs at each of the three Llama shapes
# (measured: docs/benchmarks.md, "Measurements first quoted in code comments").
DECODE_TILE = Tile(DECODE_ROWS, 64, 256, 1, 4, 3)
# Extra decode tiles Inductor benchmarks under max-autotune.
AUTOTUNE_TILES = (Tile(16, 32, 256, 1, 4, 3), Tile(16, 64, 128, 1, 4, 3), Tile(16, 128, 128, 1, 8, 3),
                  Tile(16, 64, 512, 1, 8, 3))
# Batched decode (16 < M <= 128) on words packed along N (AWQ) and on int8 storage (torchao's intx), by M
# bucket; K split while the programs stay within BATCHED_PROGRAMS_PER_SM a multiprocessor
# (`weight_stream.batched_split_k`). Each the fastest of 24 (tile, split) pairs at the three Llama shapes,
# about twice Inductor's dequantize + mm at M = 32, on intx too but behind the best at 32 rows
# (measured: docs/benchmarks.md, "Measurements first quoted in code comments"). Words packed along
# K that do not take the plane template (groups of 32 or 64) were not measured there: they keep the
# template at decode only.
BATCHED_TILES = GpuTable(H100={32: Tile(32, 64, 256, 1, 4, 3), 64: Tile(64, 64, 128, 1, 4, 3),
                               128: Tile(128, 64, 128, 1, 4, 3)})
BATCHED_PROGRAMS_PER_SM = 2


@triton.jit
def int4_weight_tile(W, SHIFTS, S, Z, k0, K, offs_n, mask_n, stride_wn, stride_wk, stride_sn, stride_sg, stride_zn,
                     stride_zg, GROUP_SIZE: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, HAS_SHIFTS: tl.constexpr,
                     HAS_ZEROS: tl.constexpr, ZERO_ADD: tl.constexpr, ZERO_WRAP: tl.constexpr,
                     PACKED_ALONG_N: tl.constexpr, INT8_VALUES: tl.constexpr, EVEN_K: tl.constexpr,
                     DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dequantized [BLOCK_N, BLOCK_K] tile w[offs_n, k0:k0 + BLOCK_K] in DTYPE (zero where k >= K).
    Strides are per n and per k word: [N, K / 8] words, or [K, N / 8] when PACKED_ALONG_N (AWQ); per n
    and per k value for INT8_VALUES (int8 [N, K], signed, zero points int8 [N, K / g] or none)."""
    nibble = tl.arange(0, 8)
    if HAS_SHIFTS:
        shift = tl.load(SHIFTS + nibble)
    else:
        shift = nibble * 4
    if INT8_VALUES:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            q = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk, mask=mask_n[:, None], other=0)
        else:
            q = tl.load(W + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                        mask=mask_n[:, None] & (offs_k < K)[None, :], other=0)
        q = q.to(tl.int32)
    elif PACKED_ALONG_N:  # a [BLOCK_K, BLOCK_N / 8] tile of words, unpacked along N into [BLOCK_K, BLOCK_N]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_word = tl.min(offs_n, axis=0) // 8 + tl.arange(0, BLOCK_N // 8)
        mask_word = tl.max(tl.reshape(mask_n.to(tl.int32), (BLOCK_N // 8, 8)), axis=1) > 0
        words = tl.load(W + offs_k[:, None] * stride_wk + offs_word[None, :] * stride_wn,
                        mask=(offs_k < K)[:, None] & mask_word[None, :], other=0)
        q = tl.trans(tl.reshape((words[:, :, None] >> shift[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N)))
    else:
        offs_word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        if EVEN_K:  # no mask along K: the loads stay 16-byte vectors
            words = tl.load(W + offs_n[:, None] * stride_wn + offs_word[None, :] * stride_wk, mask=mask_n[:, None],
                            other=0)
        else:
            words = tl.load(W + offs_n[:, None] * stride_wn + offs_word[None, :] * stride_wk,
                            mask=mask_n[:, None] & (offs_word * 8 < K)[None, :], other=0)
        q = (words[:, :, None] >> shift[None, None, :]) & 0xF
    q = tl.reshape(q, (BLOCK_N, GROUPS_PER_STEP, BLOCK_K // GROUPS_PER_STEP))
    groups = k0 // GROUP_SIZE + tl.arange(0, GROUPS_PER_STEP)
    mask = mask_n[:, None] & (groups * GROUP_SIZE < K)[None, :]
    scale = tl.load(S + offs_n[:, None] * stride_sn + groups[None, :] * stride_sg, mask=mask, other=0.0)
    if HAS_ZEROS and INT8_VALUES:
        zero = tl.load(Z + offs_n[:, None] * stride_zn + groups[None, :] * stride_zg, mask=mask, other=0)
        zero = zero.to(tl.int32)[:, :, None]
    elif HAS_ZEROS:
        zero = packed_zero_points(Z, SHIFTS, offs_n, groups, mask, stride_zn, stride_zg, HAS_SHIFTS, ZERO_ADD,
                                  ZERO_WRAP)[:, :, None]
    elif INT8_VALUES:
        zero = 0
    else:
        zero = 8
    w = ((q - zero).to(tl.float32) * scale.to(tl.float32)[:, :, None]).to(DTYPE)
    w = tl.reshape(w, (BLOCK_N, BLOCK_K))
    if not EVEN_K:
        w = tl.where((k0 + tl.arange(0, BLOCK_K) < K)[None, :], w, tl.zeros_like(w))
    return w


@triton.jit
def int4_dot(X, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, K, k_start, k_end, stride_xm, stride_xk, stride_wn,
             stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE: tl.constexpr,
             GROUPS_PER_STEP: tl.constexpr, HAS_SHIFTS: tl.constexpr, HAS_ZEROS: tl.constexpr, ZERO_ADD: tl.constexpr,
             ZERO_WRAP: tl.constexpr, PACKED_ALONG_N: tl.constexpr, INT8_VALUES: tl.constexpr, EVEN_K: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] tile of x @ w^T over k in [k_start, k_end) (before bias)."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x_t = activation_tile(X, k0 + tl.arange(0, BLOCK_K), offs_m, mask_m, K, stride_xm, stride_xk, EVEN_K)
        w = int4_weight_tile(W, SHIFTS, S, Z, k0, K, offs_n, mask_n, stride_wn, stride_wk, stride_sn, stride_sg,
                             stride_zn, stride_zg, GROUP_SIZE, GROUPS_PER_STEP, HAS_SHIFTS, HAS_ZEROS, ZERO_ADD,
                             ZERO_WRAP, PACKED_ALONG_N, INT8_VALUES, EVEN_K, x_t.dtype, BLOCK_N, BLOCK_K)
        acc = accumulate(w, x_t, acc)
    return tl.trans(acc)


@triton.jit
def _int4_mm_kernel(X, W, SHIFTS, S, Z, BIAS, OUT, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_sn,
                    stride_sg, stride_zn, stride_zg, stride_os, stride_om, stride_on, GROUP_SIZE: tl.constexpr,
                    GROUPS_PER_STEP: tl.constexpr, HAS_SHIFTS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    ZERO_ADD: tl.constexpr, ZERO_WRAP: tl.constexpr, PACKED_ALONG_N: tl.constexpr,
                    INT8_VALUES: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """OUT[pid_k] = the split's partial x @ w^T (+ bias when there is one split)."""
    offs_m, offs_n, mask_m, mask_n, pid_k, k_start, k_end = split_k_tile(M, N, K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K,
                                                                          GROUP_M)
    acc = int4_dot(X, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, K, k_start, k_end, stride_xm, stride_xk,
                   stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE, GROUPS_PER_STEP,
                   HAS_SHIFTS, HAS_ZEROS, ZERO_ADD, ZERO_WRAP, PACKED_ALONG_N, INT8_VALUES, EVEN_K, BLOCK_M, BLOCK_N,
                   BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def weight_meta(has_shifts: bool, has_zeros: bool, zero_convention: str, packed_along_n: bool,
                int8_values: bool = False) -> dict:
    """The constexprs that say how the stored weight reads (the op's formula, `qfuse.ops.int4_weight_only`)."""
    zero_add, zero_wrap = ZERO_CONVENTIONS[zero_convention]
    return dict(HAS_SHIFTS=has_shifts, HAS_ZEROS=has_zeros, ZERO_ADD=zero_add, ZERO_WRAP=zero_wrap,
                PACKED_ALONG_N=packed_along_n, INT8_VALUES=int8_values)


def pick_int4_config(m: int) -> Tile:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) for M rows."""
    return DECODE_TILE if m <= DECODE_ROWS else PREFILL_TILE


def triton_int4_mm(x: torch.Tensor, packed: torch.Tensor, shifts: torch.Tensor | None, scales: torch.Tensor,
                   packed_zeros: torch.Tensor | None, bias: torch.Tensor | None, group_size: int,
                   out_dtype: torch.dtype, config=None, splits: int | None = None,
                   zero_convention: str = "stored", packed_along_n: bool = False) -> torch.Tensor:
    """x [M, K] @ w^T + bias as `out_dtype`, w the int4 weight of the module docstring (or int8
    storage: `packed` int8 [N, K] values and `packed_zeros` int8 [N, K / g], read as they are)."""
    m, k = x.shape
    n = scales.shape[0]
    if m == 0 or n == 0 or k == 0:
        return empty_result(m, n, bias, out_dtype, x.device)
    sms = multiprocessors(x.device)
    if config is None and m <= PLANE_MAX_ROWS and takes_planes(k, group_size, packed_along_n, packed.dtype == torch.int8):
        return triton_int4_planes_mm(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype, sms,
                                     splits=splits, zero_convention=zero_convention)
    batched = config is None and (packed_along_n or packed.dtype == torch.int8) and DECODE_ROWS < m <= max(BATCHED_TILES)
    bucket = bucket_of(m, BATCHED_TILES) if batched else 0
    block_m, block_n, block_k, group_m, num_warps, num_stages = config or BATCHED_TILES.get(bucket) or pick_int4_config(m)
    block_k = fit_block_k(block_k, group_size, k)
    if not splits and batched:
        splits = batched_split_k(bucket, n, k, (block_m, block_n, block_k), BATCHED_PROGRAMS_PER_SM, sms)
    splits = splits or split_k(m, n, k, block_n, block_k, sms)
    out = torch.empty(splits, m, n, device=x.device, dtype=out_dtype if splits == 1 else torch.float32)
    zeros = packed_zeros if packed_zeros is not None else packed
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), splits)
    _int4_mm_kernel[grid](
        x, packed, shifts if shifts is not None else packed, scales, zeros, bias if bias is not None else scales, out,
        m, n, k, *x.stride(), *(packed.stride()[::-1] if packed_along_n else packed.stride()), *scales.stride(),
        *zeros.stride(), *out.stride(),
        HAS_BIAS=bias is not None and splits == 1, SPLIT_K=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages, **step_meta(block_k, group_size, k),
        **weight_meta(shifts is not None, packed_zeros is not None, zero_convention, packed_along_n,
                      packed.dtype == torch.int8),
    )
    return out[0] if splits == 1 else sum_splits(out, bias, out_dtype)
