"""Triton W8A16: x @ (b * scale_b) for an int8 or fp8 e4m3fn weight, converted in registers.

    b        [K, N] int8 / fp8 e4m3fn, any strides (a stored [N, K] weight comes as its `.t()` view
             and is read along K, as stored)
    scale_b  one value or one per column [1, N]: applied to the float32 sum after the main loop
             (`scaled_mm.scale_and_bias`), or one per 128 x 128 block [ceil(K / 128), ceil(N / 128)]:
             applied to the weight tile in each K step, rounded once to x's dtype as eager's
             dequantize `(b.float() * s).to(x.dtype)` rounds it
    out      x @ w + bias, float32 accumulation (IEEE fp32 for an fp32 x), cast to out_dtype

(the formula of `qfuse::weight_only_scaled_mm`, `qfuse.ops.weight_only`, without a zero point). An
int8 or fp8 e4m3fn value is exact in bf16, fp16 and fp32, so without block scales the tile handed
to `tl.dot` is the stored weight itself; only the order of the sum and where the scale rounds differ
from a model that dequantizes before its matmul.

This is vLLM's Marlin fp8 row (fp8 weights, bf16 / fp16 activations: for decode, and for GPUs
without fp8 tensor cores) and the GPU side of the fp8 block W8A16 checkpoints. The main loop is the
weight stream of `weight_stream`: a [BLOCK_N, BLOCK_K] tile of the weight, contiguous along K, is
the left operand of acc^T [BLOCK_N, BLOCK_M] += w @ x^T; at decode K is split (`split_k`) so that
the few column blocks reach every multiprocessor. The same `w8a16_dot` serves the eager launcher
(`triton_w8a16_mm`, the op's extern call) and the Inductor template (`qfuse.lowerings.triton.w8a16`),
which reads the model's stored weight and scale directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.base import DECODE_ROWS
from qfuse.kernels.triton.tile import GpuTable, Tile
from qfuse.kernels.triton.scaled_mm import (BLOCK_SCALE, NO_SCALE, SCALE_GROUP, TENSOR_SCALE, VECTOR_SCALE,
                                            multiprocessors, scale_and_bias)
from qfuse.kernels.triton.weight_stream import (accumulate, activation_tile, batched_split_k, bucket_of,
                                                empty_result, fit_block_k, split_k, split_k_tile, step_meta,
                                                sum_splits)

_BLOCK, _GROUP = tl.constexpr(BLOCK_SCALE), tl.constexpr(SCALE_GROUP)

# Tiles. Decode: the best (tile, split) pair at M = 1 (`python benchmarks/gpu_weight_only.py --tune
# --form fp8-block --ms 1`), or close to it, at each of the three shapes, with K not split. Splitting K
# (two programs a multiprocessor, as the int4 kernel does) was slower there, so K is split only when the
# column blocks leave more than half of the multiprocessors idle (`DECODE_PROGRAMS_PER_SM`, a small N)
# (measured: docs/benchmarks.md, "W8A16: fp8 weights, bf16 activations").
DECODE_TILE = Tile(DECODE_ROWS, 32, 512, 1, 4, 3)
DECODE_PROGRAMS_PER_SM = 0.5
# Batched decode (16 < M <= TEMPLATE_MAX_ROWS), by M bucket: (tile, programs a multiprocessor that K is
# split up to: `weight_stream.batched_split_k`). BLOCK_M covers M (the MMA's N), so each weight tile is
# read once for every row. Each the fastest (tile, split) pair, or close to it, at the three Llama
# shapes with an int8 per-channel weight (`python benchmarks/gpu_weight_only.py --tune --form
# int8-channel --ms 32,64,128,256`). Compiled, the template beat Inductor's dequantize + mm at 64 and
# 128 rows but not at 256 (two row blocks), so it stops at 128
# (measured: docs/benchmarks.md, "torchao's int8 weight-only on the GPU, and W8A16 batched decode").
BATCHED_TILES = GpuTable(H100={
    32: (Tile(32, 32, 512, 1, 4, 3), 0.5),
    64: (Tile(64, 64, 128, 1, 4, 3), 2),
    128: (Tile(128, 64, 128, 1, 4, 3), 2),
})
TEMPLATE_MAX_ROWS = max(BATCHED_TILES)
PREFILL_TILE = Tile(128, 128, 64, 8, 8, 3)
# Extra decode tiles Inductor benchmarks under max-autotune (the next best of the search).
AUTOTUNE_TILES = (Tile(16, 32, 256, 1, 4, 3), Tile(16, 64, 256, 1, 4, 3), Tile(16, 128, 128, 1, 4, 3),
                  Tile(16, 128, 256, 1, 8, 3))


@triton.jit
def eight_bit_weight_tile(B, SB, k0, K, offs_n, mask_n, stride_bk, stride_bn, stride_sbk, stride_sbn,
                          BLOCKED: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, EVEN_K: tl.constexpr,
                          DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile w[offs_n, k0:k0 + BLOCK_K] in DTYPE (zero where k >= K), times its
    block scales when BLOCKED (GROUPS_PER_STEP 128-blocks of K a step)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    pointers = B + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk
    if EVEN_K:  # masked fp8 loads need a float fill in the interpreter
        w = tl.load(pointers, mask=mask_n[:, None], other=0.0)
    else:
        w = tl.load(pointers, mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)
    # fp8 -> bf16 through float32: the direct conversion made the per-channel tile slower
    # (measured: docs/benchmarks.md, "W8A16: fp8 weights, bf16 activations")
    w = w.to(tl.float32)
    if BLOCKED:
        groups = k0 // _GROUP + tl.arange(0, GROUPS_PER_STEP)
        scale = tl.load(SB + groups[None, :] * stride_sbk + (offs_n // _GROUP)[:, None] * stride_sbn,
                        mask=mask_n[:, None] & (groups * _GROUP < K)[None, :], other=0.0)
        w = tl.reshape(w, (BLOCK_N, GROUPS_PER_STEP, BLOCK_K // GROUPS_PER_STEP)) * scale[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
    return w.to(DTYPE)


@triton.jit
def w8a16_dot(X, B, SB, offs_m, offs_n, mask_m, mask_n, K, k_start, k_end, stride_xm, stride_xk, stride_bk, stride_bn,
              stride_sbk, stride_sbn, SCALE_B: tl.constexpr, GROUPS_PER_STEP: tl.constexpr, EVEN_K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] tile of x @ b over k in [k_start, k_end), block scales applied
    (one-value and per-column scales, and the bias, are the caller's: `scale_and_bias`)."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x_t = activation_tile(X, k0 + tl.arange(0, BLOCK_K), offs_m, mask_m, K, stride_xm, stride_xk, EVEN_K)
        w = eight_bit_weight_tile(B, SB, k0, K, offs_n, mask_n, stride_bk, stride_bn, stride_sbk, stride_sbn,
                                  SCALE_B == _BLOCK, GROUPS_PER_STEP, EVEN_K, x_t.dtype, BLOCK_N, BLOCK_K)
        acc = accumulate(w, x_t, acc)
    return tl.trans(acc)


@triton.jit
def _w8a16_mm_kernel(X, B, SB, BIAS, OUT, M, N, K, stride_xm, stride_xk, stride_bk, stride_bn, stride_sbk, stride_sbn,
                     stride_os, stride_om, stride_on, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr,
                     GROUPS_PER_STEP: tl.constexpr, EVEN_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """OUT[pid_k] = the split's partial x @ w, scaled (+ bias when there is one split)."""
    offs_m, offs_n, mask_m, mask_n, pid_k, k_start, k_end = split_k_tile(M, N, K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K,
                                                                          GROUP_M)
    acc = w8a16_dot(X, B, SB, offs_m, offs_n, mask_m, mask_n, K, k_start, k_end, stride_xm, stride_xk, stride_bk,
                    stride_bn, stride_sbk, stride_sbn, SCALE_B, GROUPS_PER_STEP, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = scale_and_bias(acc, offs_m, offs_n, mask_m, mask_n, X, SB, BIAS, 0, stride_sbn, 0, SCALE_B, HAS_BIAS)
    tl.store(OUT + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def scale_kind(scale_b: torch.Tensor | None, k: int, n: int) -> int:
    """How `scale_b` (as `qfuse::weight_only_scaled_mm` normalises it) applies: none, one value,
    per column [1, N], or per block [ceil(K / 128), ceil(N / 128)]."""
    if scale_b is None:
        return NO_SCALE
    if scale_b.numel() == 1:
        return TENSOR_SCALE
    return VECTOR_SCALE if tuple(scale_b.shape) == (1, n) else BLOCK_SCALE


def pick_w8a16_config(m: int) -> Tile:
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) for M rows."""
    if m <= DECODE_ROWS:
        return DECODE_TILE
    return BATCHED_TILES[bucket_of(m, BATCHED_TILES)][0] if m <= TEMPLATE_MAX_ROWS else PREFILL_TILE


def batched_splits(bucket: int, n: int, k: int, block_k: int, multiprocessor_count: int) -> int:
    """K splits at batched decode (M's bucket `bucket`): `weight_stream.batched_split_k` at the bucket's
    tile (its BLOCK_K `block_k`, fitted to block scales) and programs a multiprocessor (`BATCHED_TILES`)."""
    tile, programs_per_sm = BATCHED_TILES[bucket]
    return batched_split_k(bucket, n, k, (*tile[:2], block_k), programs_per_sm, multiprocessor_count)


def kernel_meta(kind: int, block_k: int, k: int) -> dict:
    """The constexprs of a call: the scale's kind and the K step's (128-blocks a step, masks)."""
    step = step_meta(block_k, SCALE_GROUP, k)
    groups_per_step = step["GROUPS_PER_STEP"] if kind == BLOCK_SCALE else 1
    return dict(SCALE_B=kind, GROUPS_PER_STEP=groups_per_step, EVEN_K=step["EVEN_K"])


def triton_w8a16_mm(x: torch.Tensor, b: torch.Tensor, scale_b: torch.Tensor | None, bias: torch.Tensor | None,
                    out_dtype: torch.dtype, config=None, splits: int | None = None) -> torch.Tensor:
    """x [M, K] @ (b * scale_b) + bias as `out_dtype` (module docstring). `b` may hold more than K
    rows (zero padding): only the first K are read."""
    (m, k), n = x.shape, b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return empty_result(m, n, bias, out_dtype, x.device)
    kind = scale_kind(scale_b, k, n)
    block_m, block_n, block_k, group_m, num_warps, num_stages = config or pick_w8a16_config(m)
    if kind == BLOCK_SCALE:
        block_k = fit_block_k(block_k, SCALE_GROUP, k)
    if not splits and DECODE_ROWS < m <= TEMPLATE_MAX_ROWS and config is None:
        splits = batched_splits(bucket_of(m, BATCHED_TILES), n, k, block_k, multiprocessors(x.device))
    splits = splits or split_k(m, n, k, block_n, block_k, multiprocessors(x.device), DECODE_PROGRAMS_PER_SM)
    out = torch.empty(splits, m, n, device=x.device, dtype=out_dtype if splits == 1 else torch.float32)
    scale = scale_b.to(torch.float32) if scale_b is not None else x
    scale_strides = scale.stride() if kind == BLOCK_SCALE else (0, scale.stride(-1) if kind == VECTOR_SCALE else 0)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), splits)
    _w8a16_mm_kernel[grid](
        x, b, scale, bias if bias is not None else x, out, m, n, k, *x.stride(), *b.stride(), *scale_strides,
        *out.stride(), HAS_BIAS=bias is not None and splits == 1, SPLIT_K=splits, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages, **kernel_meta(kind, block_k, k),
    )
    return out[0] if splits == 1 else sum_splits(out, bias, out_dtype)
