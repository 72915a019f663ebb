"""Triton scaled matmul: C = (A_q @ B_q) * scale_a * scale_b + bias, cast to bf16 / fp16 / fp32.

    A_q [M, K] int8 or fp8 e4m3, B_q [K, N] of the same dtype, any strides ([N, K] weights come
    as a transposed view). int8 accumulates in int32, fp8 in fp32 (tl.dot).
    scale_a: none, one value, per row [M, 1], or per row and 128-group of K [M, ceil(K/128)]
    scale_b: none, one value, per column [1, N], or per 128x128 block [ceil(K/128), ceil(N/128)]
    Block (DeepSeek-style) scales apply per K step: acc += dot(a, b) * sa[m, g] * sb[g, n // 128],
    with BLOCK_K dividing 128 so that a K step never straddles two scale groups.
    Offsets are int64 where M * K or K * N may exceed 2**31; M, N, K need not be block multiples.

Block sizes (`pick_config`): for M <= 16 the tile width that fills the GPU with column blocks
(`DECODE_TILES`, measured by `benchmarks/gpu_decode.py`), above that a table per M bucket
(`CONFIGS`, chosen by `benchmarks/gpu_triton.py --tune-only`); in the table's first bucket a narrower
tile where the table's would leave multiprocessors without a column block (`SKINNY_TILE`,
`benchmarks/explorations/gpu_skinny_tiles.py`). docs/benchmarks.md has the numbers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from qfuse.kernels.base import DECODE_ROWS
from qfuse.kernels.triton.tile import GpuTable, Tile

# How a scale applies (host side), and the same values as globals the kernel may read.
NO_SCALE, TENSOR_SCALE, VECTOR_SCALE, BLOCK_SCALE = 0, 1, 2, 3
SCALE_GROUP = 128
_TENSOR, _VECTOR, _BLOCK = tl.constexpr(TENSOR_SCALE), tl.constexpr(VECTOR_SCALE), tl.constexpr(BLOCK_SCALE)
_GROUP = tl.constexpr(SCALE_GROUP)

# (max M of the bucket) -> Tile, chosen by `python benchmarks/gpu_triton.py --tune-only`: per dtype,
# the best geomean over (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)} at M = 128 and 4096
# (measured: docs/benchmarks.md, "gpu_triton: Triton kernels on an H200").
# fp8 tiles of 64+ rows use Hopper's wgmma, which accumulates fp8 products in reduced precision
# (about 2**-13 relative per K block, as cuBLAS does without fast accumulation).
CONFIGS = GpuTable(H200={
    "int8": {128: Tile(64, 128, 128, 8, 8, 4), 2**62: Tile(128, 128, 128, 8, 8, 3)},
    "fp8": {128: Tile(64, 128, 128, 8, 8, 4), 2**62: Tile(128, 128, 128, 8, 8, 4)},
})

# 16 < M <= 128 (the table's first bucket): where the table's tile gives fewer than GRID_FILL of the
# multiprocessors a column block (its 32 blocks at N = 4096), the narrower, deeper SKINNY_TILE, faster
# there because its column blocks reach more multiprocessors. Column blocks alone decide, so the eager
# kernel (real M) and the template (the bucket's bound) agree. At N = 14336 the table's tile stays: it
# is close to the best tile tried
# (measured: docs/benchmarks.md, "gpu_skinny_tiles: the W8A8 tile for 16 < M <= 128").
SKINNY_TILE = Tile(64, 64, 256, 8, 4, 3)

# Extra tiles Inductor benchmarks under max-autotune (qfuse.lowerings.triton.template), beside the
# table's tile for M: wider and taller tiles for large M, narrower ones for small N.
AUTOTUNE_TILES: tuple[Tile, ...] = (
    Tile(128, 128, 128, 8, 8, 3), Tile(64, 128, 128, 8, 8, 4), Tile(128, 256, 128, 8, 8, 3), Tile(256, 128, 128, 8, 8, 3),
    Tile(128, 128, 64, 8, 4, 4), Tile(64, 64, 128, 8, 4, 4), Tile(32, 64, 256, 8, 4, 4), Tile(16, 64, 256, 8, 4, 4),
    SKINNY_TILE,
)

# M <= 16 (decode) reads the weight once and does little else: the time is how fast the column
# blocks pull the weight from HBM, so the grid must reach every multiprocessor. BLOCK_N is the widest
# tile whose column blocks cover GRID_FILL of the multiprocessors (else the narrowest), with
# (BLOCK_K, num_warps, num_stages) per dtype: more blocks read more of HBM's bandwidth at N = 4096
# (measured: docs/benchmarks.md, "Measurements first quoted in code comments").
DECODE_M = DECODE_ROWS
GRID_FILL = 0.75
DECODE_TILES = GpuTable(H200={
    128: {"fp8": (256, 4, 4), "int8": (256, 4, 4)},
    64: {"fp8": (256, 4, 4), "int8": (256, 4, 4)},
    32: {"fp8": (1024, 4, 4), "int8": (512, 4, 6)},
    16: {"fp8": (512, 2, 6), "int8": (512, 2, 6)},
})


@triton.jit
def scale_and_bias(out, offs_m, offs_n, mask_m, mask_n, scale_a_ptr, scale_b_ptr, bias_ptr, stride_sam, stride_sbn,
                   SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out (float32) * scale_a * scale_b + bias for one-value and per-row / per-column scales (block
    scales were applied in the main loop). Loads [BLOCK_M] / [BLOCK_N] vectors, not broadcast tiles.
    `+ (sa - sa)`: a row whose scale_a is inf or nan is nan, as in eager (torch_native.nan_where_not_finite)."""
    if SCALE_A == _TENSOR:
        sa = tl.load(scale_a_ptr)
        out = out * sa + (sa - sa)
    elif SCALE_A == _VECTOR:
        sa = tl.load(scale_a_ptr + offs_m * stride_sam, mask=mask_m, other=0.0)[:, None]
        out = out * sa + (sa - sa)
    if SCALE_B == _TENSOR:
        out *= tl.load(scale_b_ptr)
    elif SCALE_B == _VECTOR:
        out *= tl.load(scale_b_ptr + offs_n * stride_sbn, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    return out


@triton.jit
def _scale_bias_store(out, offs_m, offs_n, mask_m, mask_n, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
                      stride_cm, stride_cn, stride_sam, stride_sbn,
                      SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The epilogue of the eager kernels: `scale_and_bias`, cast, store to C."""
    out = scale_and_bias(out, offs_m, offs_n, mask_m, mask_n, scale_a_ptr, scale_b_ptr, bias_ptr, stride_sam, stride_sbn,
                         SCALE_A, SCALE_B, HAS_BIAS)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def tile_in_group_order(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of output tile number `tile`: GROUP_M row blocks share a column
    block, for L2 reuse of B."""
    blocks_m, blocks_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * blocks_n
    first_m = (tile // group_size) * GROUP_M
    rows_in_group = min(blocks_m - first_m, GROUP_M)
    return first_m + (tile % group_size) % rows_in_group, (tile % group_size) // rows_in_group


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's (row block, column block), the grid one program per tile, cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)."""
    return tile_in_group_order(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def scaled_dot(
    a_ptr, b_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, mask_m, mask_n, k_start, k_end,
    stride_am, stride_ak, stride_bk, stride_bn, stride_sam, stride_sak, stride_sbk, stride_sbn,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, BLOCKED: tl.constexpr, IS_INT8: tl.constexpr,
    PROMOTE_EVERY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The main loop: A[offs_m, k_start:k_end] @ B[k_start:k_end, offs_n] as a [BLOCK_M, BLOCK_N] tile
    (the whole K, or one split's range: `k_start` a multiple of BLOCK_K), with block scales applied
    per K group when BLOCKED. int8 without block scales returns the exact int32 sum; the rest float32.
    Shared by the eager kernel below and the Inductor templates (qfuse.lowerings.triton.template)."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    if IS_INT8 and not BLOCKED:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    partial = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    steps = 0
    for k0 in range(k_start, k_end, BLOCK_K):
        mask_k = offs_k < k_end - (k0 - k_start)
        if IS_INT8:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        else:  # masked fp8 loads need a float fill in the interpreter
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if BLOCKED:
            block_sum = tl.dot(a, b).to(tl.float32)
            group = k0 // _GROUP
            if SCALE_A == _BLOCK:
                block_sum *= tl.load(scale_a_ptr + offs_m * stride_sam + group * stride_sak, mask=mask_m, other=0.0)[:, None]
            if SCALE_B == _BLOCK:
                sb = tl.load(scale_b_ptr + group * stride_sbk + (offs_n // _GROUP) * stride_sbn, mask=mask_n, other=0.0)
                block_sum *= sb[None, :]
            acc += block_sum
        elif PROMOTE_EVERY == 1:
            acc += tl.dot(a, b)
        else:  # tensor-core accumulation in `partial`, promoted into acc every PROMOTE_EVERY steps
            partial = tl.dot(a, b, partial)
            steps += 1
            if steps % PROMOTE_EVERY == 0:
                acc += partial
                partial = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if PROMOTE_EVERY > 1:
        acc += partial
    return acc


@triton.jit
def _scaled_mm_kernel(
    a_ptr, b_ptr, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbk, stride_sbn,
    SCALE_A: tl.constexpr, SCALE_B: tl.constexpr, BLOCKED: tl.constexpr, HAS_BIAS: tl.constexpr,
    IS_INT8: tl.constexpr, PROMOTE_EVERY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = scaled_dot(a_ptr, b_ptr, scale_a_ptr, scale_b_ptr, offs_m, offs_n, mask_m, mask_n, 0, K,
                     stride_am, stride_ak, stride_bk, stride_bn, stride_sam, stride_sak, stride_sbk, stride_sbn,
                     SCALE_A, SCALE_B, BLOCKED, IS_INT8, PROMOTE_EVERY, BLOCK_M, BLOCK_N, BLOCK_K)
    _scale_bias_store(acc.to(tl.float32), offs_m, offs_n, mask_m, mask_n, c_ptr, scale_a_ptr, scale_b_ptr, bias_ptr,
                      stride_cm, stride_cn, stride_sam, stride_sbn, SCALE_A, SCALE_B, HAS_BIAS)


def tile_buckets(is_fp8: bool) -> list[int]:
    """The M bounds at which `pick_config` changes tile, ascending (M above the last: the last tile).
    Within a bucket the tile depends on N only."""
    return [DECODE_M, *sorted(CONFIGS["fp8" if is_fp8 else "int8"])[:-1]]


def pick_config(m: int, n: int, is_fp8: bool, blocked: bool, multiprocessor_count: int) -> Tile:
    """The tile of an [M, K] x [K, N] call."""
    label = "fp8" if is_fp8 else "int8"
    if m <= DECODE_M:
        widths = sorted(DECODE_TILES, reverse=True)
        block_n = next((w for w in widths if triton.cdiv(n, w) >= GRID_FILL * multiprocessor_count), widths[-1])
        block_k, num_warps, num_stages = DECODE_TILES[block_n][label]
        config = Tile(DECODE_M, block_n, block_k, 8, num_warps, num_stages)
    else:
        bound, config = next((bound, config) for bound, config in sorted(CONFIGS[label].items()) if m <= bound)
        if bound == min(CONFIGS[label]) and triton.cdiv(n, config.block_n) < GRID_FILL * multiprocessor_count:
            config = SKINNY_TILE
    if blocked and SCALE_GROUP % config.block_k:
        config = config._replace(block_k=SCALE_GROUP)
    return config


def _scale_kind(scale: torch.Tensor | None, vector_shape: tuple[int, int]) -> int:
    """How a scale, normalised by the op, applies: none, one value, per row / column, per block."""
    if scale is None:
        return NO_SCALE
    if scale.numel() == 1:
        return TENSOR_SCALE
    return VECTOR_SCALE if tuple(scale.shape) == vector_shape else BLOCK_SCALE


def _strides(scale: torch.Tensor | None) -> tuple[int, int]:
    if scale is None or scale.dim() < 2:
        return 0, 0
    return scale.stride(0), scale.stride(1)


PROMOTE_K = 512  # K elements between promotions of the fp8 accumulator (4 steps of a 128-deep tile)


def promote_every(dtype: torch.dtype, out_dtype: torch.dtype, block_k: int) -> int:
    """K steps of `block_k` between promotions of the fp8 tensor-core accumulator into the float32 sum.

    Hopper accumulates fp8 products in reduced precision. Promoting every step (1) is as exact as
    cuBLAS's default; every 512 of K (4 steps of 128) is faster, with a relative error below what a bf16 /
    fp16 output rounds away anyway (measured: docs/benchmarks.md, "Measurements first quoted in code
    comments"). The interval is kept in K, so a deeper tile promotes after fewer steps.
    int8 accumulates exactly in int32 and needs no promotion; block scales promote every step."""
    if dtype == torch.float8_e4m3fn and out_dtype in (torch.bfloat16, torch.float16):
        return max(1, PROMOTE_K // block_k)
    return 1


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: Triton's interpreter on CPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def output_and_float32_scales(a, b, scale_a, scale_b, out_dtype):
    """The [M, N] output to fill, and the scales as float32 (what the kernels' epilogues load)."""
    c = torch.empty((a.shape[0], b.shape[1]), device=a.device, dtype=out_dtype)
    return c, *(None if scale is None else scale.to(torch.float32) for scale in (scale_a, scale_b))


def triton_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype, config=None, promote=None):
    """Launch the kernel for normalised operands (a [M, K], b [K, N], scales as the op passes them).

    `config` (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) overrides the table and
    `promote` the fp8 promotion interval (`promote_every`): the benchmark scripts use them."""
    (m, k), n = a.shape, b.shape[1]
    c, sa, sb = output_and_float32_scales(a, b, scale_a, scale_b, out_dtype)
    if c.numel() == 0:
        return c
    kind_a, kind_b = _scale_kind(sa, (m, 1)), _scale_kind(sb, (1, n))
    block_m, block_n, block_k, group_m, num_warps, num_stages = config or pick_config(
        m, n, a.dtype != torch.int8, BLOCK_SCALE in (kind_a, kind_b), multiprocessors(a.device)
    )
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    dummy = c  # never read when the constexpr kind says so
    _scaled_mm_kernel[grid](
        a, b, c, sa if sa is not None else dummy, sb if sb is not None else dummy,
        bias if bias is not None else dummy,
        m, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        *_strides(sa), *_strides(sb),
        SCALE_A=kind_a, SCALE_B=kind_b, BLOCKED=BLOCK_SCALE in (kind_a, kind_b), HAS_BIAS=bias is not None, IS_INT8=a.dtype == torch.int8,
        PROMOTE_EVERY=1 if BLOCK_SCALE in (kind_a, kind_b) else promote or promote_every(a.dtype, out_dtype, block_k),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        num_warps=num_warps, num_stages=num_stages,
    )
    return c
