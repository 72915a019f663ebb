"""The W4A16 decode loop on nibble planes: int4 words used as stored, with no reshape of the weight tile.

A K step of PLANE_STEP = 128 values is 16 words a row; word j holds k = 8 j + i in its nibble i.
`int4_mm.int4_dot` unpacks a step into [BLOCK_N, 128] in k order, a 3D broadcast and a reshape
that Triton lowers to register shuffles and shared-memory round trips: about 10.6 SASS instructions
per weight value on an H100, which held the decode kernel to a third of HBM bandwidth. Here plane
i = nibble i of every word, a [BLOCK_N, 16] tile in the words' own layout, is multiplied by the
activation's matching rows, so the dequantized tile goes to the tensor cores as it is:

    acc^T [BLOCK_N, M] += sum over i of  w_i [BLOCK_N, 16] @ xp[k0 + 16 i : k0 + 16 i + 16, :M]
    xp[m, k0 + 16 i + j] = x[m, k0 + 8 j + i]            (`permute_planes`, once per call)

A step lies inside one scale group (groups of a multiple of 128, or one per row: `takes_planes`),
so scale and zero point are one value per row. With bf16 / fp16 activations whose scales have their
dtype (`paired`), planes i and i + 4 are dequantized together, two values per 32-bit register:

    t = nibble_lo | nibble_hi << 16 | MAGIC     the half-float pair (MAGIC + q_lo, MAGIC + q_hi):
                                                MAGIC = 128 (bf16) or 1024 (fp16), whose ulp is 1
    t = fma(t, 1, -(MAGIC + z))                 q - z, exact
    t = fma(t, s, -0)                           (q - z) * s rounded once, as eager's `(q - z).to(dtype) * s`

which is about 6 SASS instructions a value. Otherwise (float32 activations, scales in another dtype,
or no GPU: Triton's interpreter) each plane is dequantized in float32 as `int4_dot` does, still
without the reshape. Both are eager's values exactly; only the order of the sum differs.

Measured on an H100 (GPTQ g128, decode, docs/benchmarks.md "nibble planes"): the eager launcher
(`int4_mm.triton_int4_mm` takes this loop where `takes_planes`) runs 15.6-17.2 / 28.0-32.5 /
30.5-35.1 µs a linear at N x K = 4096 x 4096 / 14336 x 4096 / 4096 x 14336, the permute and the
split sum included, where `int4_dot` ran 16.8-17.6 / 47.4-49.0 / 42.1-42.7. As an Inductor template
it lost to `int4_dot`'s at two of the three shapes, so the lowering keeps that one
(`qfuse.lowerings.int4_weight_only`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qfuse.kernels.base import DECODE_ROWS
from qfuse.kernels.triton.weight_stream import MAX_SPLIT_K, packed_zero_points, split_k_tile, sum_splits

PLANE_STEP = 128  # K values a step: 16 words a row, a tl.dot of K = 16 a plane
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): the best 64-wide tile of 48 on an H100
# (within 6% of the best at every decode shape), at the split `plane_splits` picks.
PLANE_TILE = (DECODE_ROWS, 64, PLANE_STEP, 1, 4, 3)
MIN_STEPS_PER_SPLIT = 8

# t = the low halves of word $2 >> $5 and >> $6 side by side (prmt), masked to a nibble each, OR
# MAGIC: the pair (MAGIC + q_lo, MAGIC + q_hi) (lop3 0xEA: a & b | c); then
# t = (t - (MAGIC + z)) * s with one rounding, s = $3 and -(MAGIC + z) = $4 in both halves.
_PAIR_ASM = """{{
    .reg .b32 lo, hi, t, s2, z2, one, neg0;
    shr.u32 lo, $2, $5;
    shr.u32 hi, $2, $6;
    prmt.b32 t, lo, hi, 0x5410;
    lop3.b32 t, t, 0x000F000F, {magic}, 0xEA;
    mov.b32 s2, {{$3, $3}};
    mov.b32 z2, {{$4, $4}};
    mov.b32 one, {one};
    mov.b32 neg0, 0x80008000;
    fma.rn.{pair} t, t, one, z2;
    fma.rn.{pair} t, t, s2, neg0;
    mov.b32 {{$0, $1}}, t;
}}"""
_BF16_PAIR = tl.constexpr(_PAIR_ASM.format(magic="0x43004300", one="0x3F803F80", pair="bf16x2"))  # 128.0, 1.0
_FP16_PAIR = tl.constexpr(_PAIR_ASM.format(magic="0x64006400", one="0x3C003C00", pair="f16x2"))  # 1024.0, 1.0
_PAIRED_DTYPES = (torch.bfloat16, torch.float16)


def takes_planes(k: int, group_size: int, packed_along_n: bool, int8_values: bool) -> bool:
    """Whether a decode call can run on nibble planes: words packed along K, whole steps, one group a step."""
    return not packed_along_n and not int8_values and k % PLANE_STEP == 0 and group_size % PLANE_STEP == 0


def paired(x_dtype: torch.dtype, scale_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the two-values-a-register dequantize applies: bf16 / fp16 activations and scales of the same
    dtype, on an NVIDIA GPU of compute capability 8.0 or later (`fma.rn.bf16x2`), not under the interpreter."""
    return (x_dtype in _PAIRED_DTYPES and scale_dtype == x_dtype and device.type == "cuda"
            and torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.cuda.get_device_capability(device) >= (8, 0))


def plane_splits(n: int, k: int, block_n: int, multiprocessor_count: int) -> int:
    """K splits: as many as keep MIN_STEPS_PER_SPLIT steps each (a power of two, at most MAX_SPLIT_K), and
    at least enough for two programs a multiprocessor. On an H100 this picks the best split of 1-8 at
    each decode shape (4, 4 and 8 at N x K = 4096 x 4096, 14336 x 4096, 4096 x 14336)."""
    steps = k // PLANE_STEP
    wanted = max(steps // MIN_STEPS_PER_SPLIT, triton.cdiv(2 * multiprocessor_count, triton.cdiv(n, block_n)))
    splits = 1
    while splits * 2 <= min(wanted, MAX_SPLIT_K, steps):
        splits *= 2
    return splits


def permute_planes(x: torch.Tensor) -> torch.Tensor:
    """xp [M, K]: in every step of PLANE_STEP, xp[m, k0 + 16 i + j] = x[m, k0 + 8 j + i]."""
    m, k = x.shape
    return x.reshape(m, k // PLANE_STEP, PLANE_STEP // 8, 8).transpose(2, 3).reshape(m, k)


@triton.jit
def _magic(dtype: tl.constexpr):
    """The half float whose ulp is 1, MAGIC + q for a nibble q is its bits OR q: 128 (bf16), 1024 (fp16)."""
    if dtype == tl.bfloat16:
        return 128.0
    return 1024.0


@triton.jit
def _dequantized_pair(words, scale, minus_zero, shift_lo, shift_hi):
    """((q_lo - z) * s, (q_hi - z) * s) in s's dtype, q = (words >> shift) & 0xF; `minus_zero` = -(MAGIC + z)."""
    if scale.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(_BF16_PAIR, "=h,=h,r,h,h,r,r", [words, scale, minus_zero, shift_lo, shift_hi],
                                         dtype=(scale.dtype, scale.dtype), is_pure=True, pack=1)
    return tl.inline_asm_elementwise(_FP16_PAIR, "=h,=h,r,h,h,r,r", [words, scale, minus_zero, shift_lo, shift_hi],
                                     dtype=(scale.dtype, scale.dtype), is_pure=True, pack=1)


@triton.jit
def plane_dot(XP, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, k_start, k_end, stride_xm, stride_wn,
              stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE: tl.constexpr, HAS_SHIFTS: tl.constexpr,
              HAS_ZEROS: tl.constexpr, ZERO_ADD: tl.constexpr, ZERO_WRAP: tl.constexpr, PAIRED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] tile of x @ w^T over k in [k_start, k_end), whole steps of
    PLANE_STEP (before bias); XP the activation permuted by `permute_planes`."""
    WORDS: tl.constexpr = 16
    j = tl.arange(0, WORDS)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, 128):
        words = tl.load(W + offs_n[:, None] * stride_wn + (k0 // 8 + j)[None, :] * stride_wk, mask=mask_n[:, None],
                        other=0)
        group = k0 // GROUP_SIZE
        scale = tl.load(S + offs_n * stride_sn + group * stride_sg, mask=mask_n, other=0.0)[:, None]
        if HAS_ZEROS:  # [BLOCK_N, 1]: one group a step
            zero = packed_zero_points(Z, SHIFTS, offs_n, tl.full((1,), group, tl.int32), mask_n[:, None], stride_zn,
                                      stride_zg, HAS_SHIFTS, ZERO_ADD, ZERO_WRAP)
        else:
            zero = tl.full((BLOCK_N, 1), 8, tl.int32)
        x_rows = XP + offs_m[None, :] * stride_xm + (k0 + j)[:, None]
        if PAIRED:
            minus_zero = (-(zero.to(tl.float32) + _magic(scale.dtype))).to(scale.dtype)
            for i in tl.static_range(4):
                if HAS_SHIFTS:
                    shift_lo = tl.load(SHIFTS + i) + tl.zeros((1, 1), tl.int32)
                    shift_hi = tl.load(SHIFTS + i + 4) + tl.zeros((1, 1), tl.int32)
                else:  # constants: 4 i and 4 i + 16
                    shift_lo = tl.full((1, 1), 4 * i, tl.int32)
                    shift_hi = tl.full((1, 1), 4 * i + 16, tl.int32)
                w_lo, w_hi = _dequantized_pair(words, scale, minus_zero, shift_lo, shift_hi)
                x_lo = tl.load(x_rows + WORDS * i, mask=mask_m[None, :], other=0.0)
                x_hi = tl.load(x_rows + WORDS * (i + 4), mask=mask_m[None, :], other=0.0)
                acc = tl.dot(w_lo, x_lo, acc)
                acc = tl.dot(w_hi, x_hi, acc)
        else:
            for i in tl.static_range(8):
                if HAS_SHIFTS:
                    shift = tl.load(SHIFTS + i)
                else:
                    shift = 4 * i
                x_i = tl.load(x_rows + WORDS * i, mask=mask_m[None, :], other=0.0)
                w = (((words >> shift) & 0xF) - zero).to(tl.float32) * scale.to(tl.float32)
                if x_i.dtype == tl.float32:  # eager's fp32 matmul is IEEE fp32, not TF32
                    acc = tl.dot(w, x_i, acc, input_precision="ieee")
                else:
                    acc = tl.dot(w.to(x_i.dtype), x_i, acc)
    return tl.trans(acc)


@triton.jit
def _int4_planes_kernel(XP, W, SHIFTS, S, Z, BIAS, OUT, M, N, K, stride_xm, stride_wn, stride_wk, stride_sn, stride_sg,
                        stride_zn, stride_zg, stride_os, stride_om, stride_on, GROUP_SIZE: tl.constexpr,
                        HAS_SHIFTS: tl.constexpr, HAS_ZEROS: tl.constexpr, ZERO_ADD: tl.constexpr,
                        ZERO_WRAP: tl.constexpr, PAIRED: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """OUT[pid_k] = the split's partial x @ w^T (+ bias when there is one split)."""
    offs_m, offs_n, mask_m, mask_n, pid_k, k_start, k_end = split_k_tile(M, N, K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K,
                                                                          GROUP_M)
    acc = plane_dot(XP, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, k_start, k_end, stride_xm, stride_wn,
                    stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE, HAS_SHIFTS, HAS_ZEROS, ZERO_ADD,
                    ZERO_WRAP, PAIRED, BLOCK_M, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
             acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def triton_int4_planes_mm(x: torch.Tensor, packed: torch.Tensor, shifts: torch.Tensor | None, scales: torch.Tensor,
                          packed_zeros: torch.Tensor | None, bias: torch.Tensor | None, group_size: int,
                          out_dtype: torch.dtype, multiprocessor_count: int, config=None,
                          splits: int | None = None, zero_convention: str = "stored") -> torch.Tensor:
    """x [M, K] @ w^T + bias for a call `takes_planes` accepts (M, N, K > 0), the zero points by
    `zero_convention` (`qfuse.ops.int4_weight_only.ZERO_CONVENTIONS`)."""
    from qfuse.ops.int4_weight_only import ZERO_CONVENTIONS

    m, k = x.shape
    n = scales.shape[0]
    block_m, block_n, block_k, group_m, num_warps, num_stages = config or PLANE_TILE
    splits = splits or plane_splits(n, k, block_n, multiprocessor_count)
    out = torch.empty(splits, m, n, device=x.device, dtype=out_dtype if splits == 1 else torch.float32)
    zeros = packed_zeros if packed_zeros is not None else packed
    is_paired = paired(x.dtype, scales.dtype, x.device)
    zero_add, zero_wrap = ZERO_CONVENTIONS[zero_convention]
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n), splits)
    _int4_planes_kernel[grid](
        permute_planes(x), packed, shifts if shifts is not None else packed, scales, zeros,
        bias if bias is not None else scales, out, m, n, k, k, *packed.stride(), *scales.stride(), *zeros.stride(),
        *out.stride(), GROUP_SIZE=group_size, HAS_SHIFTS=shifts is not None, HAS_ZEROS=packed_zeros is not None,
        ZERO_ADD=zero_add, ZERO_WRAP=zero_wrap, PAIRED=is_paired,
        HAS_BIAS=bias is not None and splits == 1, SPLIT_K=splits, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages,
    )
    return out[0] if splits == 1 else sum_splits(out, bias, out_dtype)
