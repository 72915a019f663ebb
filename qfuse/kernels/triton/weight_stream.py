"""What qfuse's weight-only Triton kernels share: the activation side of the main loop and split K.

A weight-only linear at decode (M <= 16) is a stream of the weight from HBM: each kernel
(`int4_mm`: int4 words; `w8a16_mm`: int8 / fp8 bytes) dequantizes its [BLOCK_N, BLOCK_K] weight
tile in registers and multiplies it as the left operand, acc^T [BLOCK_N, BLOCK_M] += w @ x^T, the
weight on the wide side of the tensor-core shape. The pieces here are that loop's other half:

    activation_tile   x^T [BLOCK_K, BLOCK_M] of one K step (masked along K only when K needs it)
    accumulate        acc += w @ x^T, in IEEE fp32 for an fp32 x (eager's fp32 matmul is not TF32)
    k_range           split `pid_k`'s whole K steps
    split_k_tile      an eager launch's program: its tile of the output, its split, its K range
    split_k           how many K ranges a decode call splits into, so that the few column blocks of
                      a small N still reach every multiprocessor; their partial sums [SPLIT_K, M, N]
                      (float32; int32 in the W8A8 template, `qfuse.lowerings.triton.template`) are
                      added after (`sum_splits` in eager, Inductor's code in a template)
    batched_split_k   the same at batched decode (16 < M <= 256), where the partial sums grow with M:
                      splits only while the programs stay within a budget a multiprocessor (every
                      template's rule there, and the nibble planes' at decode too)
    bucket_of         the bound of M's bucket among a kernel's tile buckets
    fit_block_k       a K step that holds whole scale groups along K or lies in one (int4 groups of g,
    step_meta         fp8 blocks of 128), and the constexprs that say so
    packed_zero_points  int4 zero points packed eight rows to an int32, by the zero convention
                      (`int4_mm` and `int4_planes`)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qfuse.kernels.base import DECODE_ROWS
from qfuse.kernels.triton.scaled_mm import grouped_tile

DECODE_PROGRAMS_PER_SM = 2  # the int4 kernel's; each kernel measures its own (`split_k`)
MAX_SPLIT_K = 16


@triton.jit
def activation_tile(X, offs_k, offs_m, mask_m, K, stride_xm, stride_xk, EVEN_K: tl.constexpr):
    """x[offs_m, offs_k] transposed: [BLOCK_K, BLOCK_M], zero outside M (and K)."""
    if EVEN_K:
        return tl.load(X + offs_k[:, None] * stride_xk + offs_m[None, :] * stride_xm, mask=mask_m[None, :], other=0.0)
    return tl.load(X + offs_k[:, None] * stride_xk + offs_m[None, :] * stride_xm,
                   mask=(offs_k < K)[:, None] & mask_m[None, :], other=0.0)


@triton.jit
def accumulate(w, x_t, acc):
    """acc [BLOCK_N, BLOCK_M] + w [BLOCK_N, BLOCK_K] @ x_t [BLOCK_K, BLOCK_M] (w already in x's dtype)."""
    if x_t.dtype == tl.float32:  # eager's fp32 matmul is IEEE fp32, not TF32
        return tl.dot(w, x_t, acc, input_precision="ieee")
    return tl.dot(w, x_t, acc)


@triton.jit
def packed_zero_points(Z, SHIFTS, offs_n, groups, mask, stride_zn, stride_zg, HAS_SHIFTS: tl.constexpr,
                       ZERO_ADD: tl.constexpr, ZERO_WRAP: tl.constexpr):
    """z [BLOCK_N, len(groups)] of zero points packed as int32 [N / 8, K / g]: row n at shift SHIFTS[n % 8]
    (4 * (n % 8) without SHIFTS), plus ZERO_ADD after the mask, or before it with ZERO_WRAP."""
    if HAS_SHIFTS:
        zero_shift = tl.load(SHIFTS + offs_n % 8)
    else:
        zero_shift = (offs_n % 8) * 4
    words = tl.load(Z + (offs_n // 8)[:, None] * stride_zn + groups[None, :] * stride_zg, mask=mask, other=0)
    words = words >> zero_shift[:, None]
    if ZERO_WRAP:
        return (words + ZERO_ADD) & 0xF
    return (words & 0xF) + ZERO_ADD


@triton.jit
def k_range(K, pid_k, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_start, k_end) of split `pid_k`: whole K steps, as even as they go."""
    steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_start = pid_k * steps * BLOCK_K
    return k_start, tl.minimum(K, k_start + steps * BLOCK_K)


@triton.jit
def split_k_tile(M, N, K, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """This program's tile of an eager launch on grid (tiles, SPLIT_K): rows, columns, their masks,
    its split and the split's [k_start, k_end)."""
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start, k_end = k_range(K, pid_k, SPLIT_K, BLOCK_K)
    return offs_m, offs_n, offs_m < M, offs_n < N, pid_k, k_start, k_end


def split_k(m: int, n: int, k: int, block_n: int, block_k: int, multiprocessor_count: int,
            programs_per_sm: float = DECODE_PROGRAMS_PER_SM, max_rows: int = DECODE_ROWS,
            min_steps_per_split: int = 1) -> int:
    """How many K ranges a call splits into: up to `max_rows` rows (decode), enough for
    `programs_per_sm` programs a multiprocessor from its column blocks (a power of two, each range
    at least `min_steps_per_split` K steps); else 1."""
    if m > max_rows:
        return 1
    column_blocks = triton.cdiv(n, block_n)
    wanted = triton.cdiv(int(programs_per_sm * multiprocessor_count), column_blocks)
    splits = 1
    while splits * 2 <= min(wanted, MAX_SPLIT_K, triton.cdiv(k, block_k) // min_steps_per_split):
        splits *= 2
    return splits


def bucket_of(m: int, bounds) -> int:
    """The bound of M's bucket: the first of the ascending `bounds` that M fits under; 0 above them all."""
    return next((bound for bound in bounds if m <= bound), 0)


def batched_split_k(rows: int, n: int, k: int, tile, programs_per_sm: float, multiprocessor_count: int,
                    min_steps_per_split: int = 1) -> int:
    """K splits at batched decode (`rows`: M, or the bound of M's bucket): a power of two while the grid's
    programs (row blocks x column blocks x splits) stay within `programs_per_sm` a multiprocessor, rounded
    down (rounded up, the splits took longer: docs/benchmarks.md, "Measurements first quoted in code
    comments"); at most MAX_SPLIT_K, each split at least `min_steps_per_split` of `tile`'s K steps."""
    block_m, block_n, block_k, *_ = tile
    wanted = int(programs_per_sm * multiprocessor_count) // (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n))
    splits = 1
    while splits * 2 <= min(wanted, MAX_SPLIT_K, triton.cdiv(k, block_k) // min_steps_per_split):
        splits *= 2
    return splits


def step_meta(block_k: int, group_size: int, k: int) -> dict:
    """The constexprs that depend on the K step: how many groups a step holds, whether K needs masks."""
    groups_per_step = block_k // group_size if group_size < k and block_k > group_size else 1
    return dict(GROUPS_PER_STEP=groups_per_step, EVEN_K=k % block_k == 0, GROUP_SIZE=group_size)


def fit_block_k(block_k: int, group_size: int, k: int) -> int:
    """`block_k`, halved (to 16 at least) until it divides the group size or the group size divides it
    (a step then holds whole groups, or lies in one); any step when one group spans K."""
    while block_k > 16 and group_size < k and group_size % block_k and block_k % group_size:
        block_k //= 2
    return block_k


def sum_splits(partial: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The [M, N] result from the float32 partial sums [SPLIT_K, M, N] (bias not yet added)."""
    total = partial.sum(0)
    return (total if bias is None else total + bias.float()).to(out_dtype)


def empty_result(m: int, n: int, bias: torch.Tensor | None, out_dtype: torch.dtype, device) -> torch.Tensor:
    """The result of a call with nothing to sum (M, N or K = 0): zeros, plus the bias where there are rows."""
    out = torch.zeros(m, n, device=device, dtype=out_dtype)
    return out if bias is None or m == 0 else out.copy_(bias.to(out_dtype).expand(m, n))
