"""The W4A16 decode loop on nibble planes: int4 words used as stored, with no reshape of the weight tile.

A K step of PLANE_STEP = 128 values is 16 words a row; word j holds k = 8 j + i in its nibble i.
`int4_mm.int4_dot` unpacks a step into [BLOCK_N, 128] in k order, a 3D broadcast and a reshape
that Triton lowers to register shuffles and shared-memory round trips: so many instructions per weight
value that they, not the bytes, bound the decode kernel
(measured: docs/benchmarks.md, "W4A16 decode: num_stages, and the nibble-plane loop"). Here plane
i = nibble i of every word, a [BLOCK_N, 16] tile in the words' own layout, is multiplied by the
activation's matching rows, so the dequantized tile goes to the tensor cores as it is:

    acc^T [BLOCK_N, M] += sum over i of  w_i [BLOCK_N, 16] @ xp[k0 + 16 i : k0 + 16 i + 16, :M]
    xp[m, k0 + 16 i + j] = x[m, k0 + 8 j + i]            (`permute_planes`, once per call)

A step lies inside one scale group (groups of a multiple of 128, or one per row: `takes_planes`),
so scale and zero point are one value per row. With bf16 / fp16 activations whose scales have their
dtype (`paired`), the dequantize writes the tensor cores' registers directly. The dot operand's layout
holds a row's words 2c and 2c + 1 in one thread, so one inline asm (pack=2) takes that pair and
returns, for each plane, the half-float pair (value of word 2c, value of word 2c + 1), the register
the MMA reads:

    t = byte j of both words, side by side (prmt)
    u = t & 0x000F000F | MAGIC                  the pair (MAGIC + q, MAGIC + q') of plane 2 j; after
                                                t >> 4 the same gives plane 2 j + 1; MAGIC = 128 (bf16)
                                                or 1024 (fp16), whose ulp is 1
    u = fma(u, 1, -(MAGIC + z))                 q - z, exact
    u = fma(u, s, -0)                           (q - z) * s rounded once, as eager's `(q - z).to(dtype) * s`

Eight planes of two words cost 4 prmt, 4 shifts, 8 lop3 and 16 half2 fma: 2 instructions a value.
The nibble order is the computed shifts' (`shifts` None) and every GPTQ checkpoint's stored table
(0, 4, ..., 28), which the kernel checks once a program (`_nibble_order`); a table in another order
takes the same loop with each plane's words shifted by its entry (arithmetic shifts, as eager's `>>`).
Each plane is a K = 16 slice of the MMA's operand as it stands, so the eight are joined side by side
at no cost (`_plane_major`) and a step is one dot of K = 128, whose wgmma instructions run back to
back; a dot per plane had waited for each (the loop was latency-bound). So the K loop issues fewer
instructions a weight value than the session-17 loop did (two planes of one word a register, repacked,
a dot per plane; measured: docs/benchmarks.md, "The nibble-plane template, paired in the MMA's registers").
Otherwise (float32 activations, scales in another dtype, or no GPU: Triton's interpreter) each
plane is dequantized in float32 as `int4_dot` does, still without the reshape. All are eager's
values exactly; only the order of the sum differs.

Compiled, at decode, this template is faster than both the bf16 matmul and `int4_dot`'s template, so
the lowering takes it (measured: docs/benchmarks.md, "The nibble-plane template, paired in the MMA's registers").
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qfuse.kernels.base import DECODE_ROWS
from qfuse.kernels.triton.tile import GpuTable, Tile
from qfuse.kernels.int4_words import ZERO_CONVENTIONS
from qfuse.kernels.triton.weight_stream import batched_split_k, bucket_of, packed_zero_points, split_k_tile, sum_splits

PLANE_STEP = 128  # K values a step: 16 words a row, a K = 16 slice of the step's dot a plane
_STEP = tl.constexpr(PLANE_STEP)
# Tiles by M bucket: the tile for M up to the key.
# Decode (M <= 16): the best 64-wide tile of a sweep
# (measured: docs/benchmarks.md, "W4A16 decode: num_stages, and the nibble-plane loop"); with one dot a
# step no other tile of a sweep was faster by more than 4% at the split `plane_splits` picks
# (docs/benchmarks.md, "Measurements first quoted in code comments").
# Batched decode (16 < M <= 128): one row block covers M, so each weight tile is read and dequantized
# once for every row; BLOCK_M is the MMA's N. Each the best tile in the eager launch at the three Llama
# shapes, or close to it. Up to PLANE_MAX_ROWS the template beat Inductor's dequantize + mm on the GPU
# clock; at 512 rows it no longer did, so it stops there
# (measured: docs/benchmarks.md, "Batched decode: the plane template up to 256 rows").
PLANE_TILES = GpuTable(H100={
    DECODE_ROWS: Tile(DECODE_ROWS, 64, PLANE_STEP, 1, 4, 3),
    32: Tile(32, 64, PLANE_STEP, 1, 4, 3),
    64: Tile(64, 128, PLANE_STEP, 1, 8, 3),
    128: Tile(128, 128, PLANE_STEP, 1, 8, 3),
    256: Tile(128, 128, PLANE_STEP, 1, 8, 3),
})
PLANE_MAX_ROWS = max(PLANE_TILES)
# K is split until the grid holds this many programs a multiprocessor, by BLOCK_M: the splits' float32
# partial sums, written and read again, grow with the rows (`plane_splits`).
PROGRAMS_PER_SM = GpuTable(H100={16: 4, 32: 4, 64: 2, 128: 1})
MIN_STEPS_PER_SPLIT = 8

# Two values a register, as the tensor cores take them: the asm gets the words of columns 2c and 2c + 1
# of a row (pack=2: the dot operand's layout holds them side by side) and returns, for a plane, the
# half-float pair (value of word 2c, value of word 2c + 1). A nibble q goes in a half's low bits OR
# MAGIC (lop3 0xEA: a & b | c), the half float MAGIC + q; then (t - (MAGIC + z)) * s, one rounding.
# $S = the pair (s, s), $Z = the pair (-(MAGIC + z), -(MAGIC + z)).
_DEQUANTIZE = """    lop3.b32 u, t, 0x000F000F, {magic}, 0xEA;
    fma.rn.{pair} u, u, one, $Z;
    fma.rn.{pair} $OUT, u, $S, neg0;
"""
# Nibble order (nibble i at bits 4 i; `shifts` None): prmt puts byte j of both words in the halves' low
# bytes; its low nibble is plane 2 j, and after a shift by 4 its high nibble plane 2 j + 1. Eight
# planes of two words: $0..$7, words $8 and $9, $S = $10, $Z = $11.
_NIBBLE_PLANES = "".join(
    f"    prmt.b32 t, $8, $9, 0x{j + 4:x}{j + 4:x}{j:x}{j:x};\n" + _DEQUANTIZE.replace("$OUT", f"${2 * j}")
    + "    shr.u32 t, t, 4;\n" + _DEQUANTIZE.replace("$OUT", f"${2 * j + 1}") for j in range(4)
).replace("$S", "$10").replace("$Z", "$11")
# A stored shift table (any values, as `(words >> shift) & 0xF` reads them, arithmetic shift): one plane
# of two words: $0, words $1 and $2 shifted by $5 and $6 (one value), $S = $3, $Z = $4.
_SHIFTED_PLANE = ("    shr.s32 a, $1, $5;\n    shr.s32 b, $2, $6;\n    prmt.b32 t, a, b, 0x5410;\n"
                  + _DEQUANTIZE.replace("$OUT", "$0").replace("$S", "$3").replace("$Z", "$4"))
_ASM_FRAME = """{{{{
    .reg .b32 a, b, t, u, one, neg0;
    mov.b32 one, {{one}};
    mov.b32 neg0, 0x80008000;
{body}}}}}"""
_HALVES = {"bf16": dict(magic="0x43004300", one="0x3F803F80", pair="bf16x2"),   # 128.0, 1.0
           "fp16": dict(magic="0x64006400", one="0x3C003C00", pair="f16x2")}    # 1024.0, 1.0
_BF16_NIBBLES = tl.constexpr(_ASM_FRAME.format(body=_NIBBLE_PLANES).format(**_HALVES["bf16"]))
_FP16_NIBBLES = tl.constexpr(_ASM_FRAME.format(body=_NIBBLE_PLANES).format(**_HALVES["fp16"]))
_BF16_SHIFTED = tl.constexpr(_ASM_FRAME.format(body=_SHIFTED_PLANE).format(**_HALVES["bf16"]))
_FP16_SHIFTED = tl.constexpr(_ASM_FRAME.format(body=_SHIFTED_PLANE).format(**_HALVES["fp16"]))
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


def plane_tile(rows: int) -> Tile:
    """The tile for M = `rows` (at most PLANE_MAX_ROWS): its bucket's."""
    return PLANE_TILES[bucket_of(rows, sorted(PLANE_TILES))]


def autotune_plane_tiles(tile: Tile) -> list[Tile]:
    """max-autotune's other choices beside `tile`: its BLOCK_M (the bucket's rows) with other widths and warps."""
    others = [Tile(tile.block_m, width, PLANE_STEP, 1, warps, 3) for width in (32, 64, 128) for warps in (4, 8)]
    return [other for other in others if other != tile]


def plane_splits(m: int, n: int, k: int, block_m: int, block_n: int, multiprocessor_count: int) -> int:
    """K splits for M = `m` rows (`weight_stream.batched_split_k`): a power of two, while the grid holds at
    most PROGRAMS_PER_SM[BLOCK_M] programs a multiprocessor, each split at least MIN_STEPS_PER_SPLIT steps
    deep (and at most MAX_SPLIT_K).

    Against every split forced on the compiled template from M = 1 to 256 at the three Llama shapes, this
    rule's pick was the fastest or close to it; at decode it also beats an earlier rule that split
    14336 x 4096 more finely (measured: docs/benchmarks.md, "Batched decode: the plane template up to 256 rows")."""
    return batched_split_k(m, n, k, (block_m, block_n, PLANE_STEP), PROGRAMS_PER_SM.get(block_m, 1),
                           multiprocessor_count, MIN_STEPS_PER_SPLIT)


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
def _nibble_planes(words, scale, minus_zero):
    """The 8 planes (q_i - z) * s of [BLOCK_N, 16] words, q_i = (words >> 4 i) & 0xF, in s's dtype;
    `minus_zero` = -(MAGIC + z), both broadcast to the words' shape."""
    if scale.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(_BF16_NIBBLES, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [words, scale, minus_zero],
                                         dtype=(scale.dtype,) * 8, is_pure=True, pack=2)
    return tl.inline_asm_elementwise(_FP16_NIBBLES, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [words, scale, minus_zero],
                                     dtype=(scale.dtype,) * 8, is_pure=True, pack=2)


@triton.jit
def _shifted_plane(words, scale, minus_zero, shift):
    """One plane (q - z) * s, q = (words >> shift) & 0xF, in s's dtype (all four broadcast to one shape)."""
    if scale.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(_BF16_SHIFTED, "=r,r,r,r,r,r,r", [words, scale, minus_zero, shift],
                                         dtype=scale.dtype, is_pure=True, pack=2)
    return tl.inline_asm_elementwise(_FP16_SHIFTED, "=r,r,r,r,r,r,r", [words, scale, minus_zero, shift],
                                     dtype=scale.dtype, is_pure=True, pack=2)


@triton.jit
def _value_shifts(SHIFTS, NIBBLE_ORDER: tl.constexpr):
    """The shifts of the values' 8 nibbles: 4 i in nibble order, else the stored table SHIFTS[i] (loaded
    where it is used: a table read once before the K loop was slower; docs/benchmarks.md, "Measurements
    first quoted in code comments")."""
    if NIBBLE_ORDER:
        return (0, 4, 8, 12, 16, 20, 24, 28)
    return (tl.load(SHIFTS + 0), tl.load(SHIFTS + 1), tl.load(SHIFTS + 2), tl.load(SHIFTS + 3),
            tl.load(SHIFTS + 4), tl.load(SHIFTS + 5), tl.load(SHIFTS + 6), tl.load(SHIFTS + 7))


@triton.jit
def _shifted_planes(words, scale, minus_zero, shifts):
    """The 8 planes of `_shifted_plane`, plane i at shifts[i]."""
    return (_shifted_plane(words, scale, minus_zero, tl.broadcast_to(shifts[0], words.shape)),
            _shifted_plane(words, scale, minus_zero, tl.broadcast_to(shifts[1], words.shape)),
            _shifted_plane(words, scale, minus_zero, tl.broadcast_to(shifts[2], words.shape)),
            _shifted_plane(words, scale, minus_zero, tl.broadcast_to(shifts[3], words.shape)),
            _shifted_plane(words, scale, minus_zero, tl.broadcast_to(shifts[4], words.shape)),
            _shifted_plane(words, scale, minus_zero, tl.broadcast_to(shifts[5], words.shape)),
            _shifted_plane(words, scale, minus_zero, tl.broadcast_to(shifts[6], words.shape)),
            _shifted_plane(words, scale, minus_zero, tl.broadcast_to(shifts[7], words.shape)))


@triton.jit
def _float_plane(words, zero, scale, shift):
    return (((words >> shift) & 0xF) - zero).to(tl.float32) * scale.to(tl.float32)


@triton.jit
def _float_planes(words, zero, scale, shifts):
    """The 8 planes (q_i - z) * s in float32 (no GPU pairing), nibble i at shifts[i]."""
    return (_float_plane(words, zero, scale, shifts[0]), _float_plane(words, zero, scale, shifts[1]),
            _float_plane(words, zero, scale, shifts[2]), _float_plane(words, zero, scale, shifts[3]),
            _float_plane(words, zero, scale, shifts[4]), _float_plane(words, zero, scale, shifts[5]),
            _float_plane(words, zero, scale, shifts[6]), _float_plane(words, zero, scale, shifts[7]))


@triton.jit
def _plane_major(planes):
    """The 8 planes [BLOCK_N, 16] side by side, [BLOCK_N, 128] with plane i at columns 16 i .. 16 i + 15 (as
    `permute_planes` lays out X). The joins only rename registers: each plane is already a K = 16 slice
    of the MMA's operand, so the step is one dot of K = 128, whose wgmma instructions run back to back
    (a dot per plane waited for each one: the loop was latency-bound)."""
    w = tl.join(tl.join(tl.join(planes[0], planes[1]), tl.join(planes[2], planes[3])),
                tl.join(tl.join(planes[4], planes[5]), tl.join(planes[6], planes[7])))  # [BLOCK_N, 16, 2, 2, 2]
    return tl.reshape(tl.permute(w, (0, 4, 3, 2, 1)), (w.shape[0], _STEP))


@triton.jit
def _nibble_order(SHIFTS):
    """Whether a stored shift table is 0, 4, ..., 28: nibble i at bits 4 i (every GPTQ checkpoint's)."""
    in_order = tl.load(SHIFTS) == 0
    for i in tl.static_range(1, 8):
        in_order = in_order & (tl.load(SHIFTS + i) == 4 * i)
    return in_order


@triton.jit
def plane_dot(XP, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, k_start, k_end, stride_xm, stride_wn,
              stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE: tl.constexpr, HAS_SHIFTS: tl.constexpr,
              HAS_ZEROS: tl.constexpr, ZERO_ADD: tl.constexpr, ZERO_WRAP: tl.constexpr, PAIRED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] tile of x @ w^T over k in [k_start, k_end), whole steps of
    PLANE_STEP (before bias); XP the activation permuted by `permute_planes`. A stored shift table in
    nibble order (checked once a program) takes the paired loop's nibble-order dequantize."""
    if PAIRED and HAS_SHIFTS:
        if _nibble_order(SHIFTS):
            acc = _plane_loop(XP, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, k_start, k_end, stride_xm,
                              stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE, True,
                              HAS_SHIFTS, HAS_ZEROS, ZERO_ADD, ZERO_WRAP, PAIRED, BLOCK_M, BLOCK_N)
        else:
            acc = _plane_loop(XP, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, k_start, k_end, stride_xm,
                              stride_wn, stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE, False,
                              HAS_SHIFTS, HAS_ZEROS, ZERO_ADD, ZERO_WRAP, PAIRED, BLOCK_M, BLOCK_N)
    else:
        acc = _plane_loop(XP, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, k_start, k_end, stride_xm, stride_wn,
                          stride_wk, stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE, not HAS_SHIFTS, HAS_SHIFTS,
                          HAS_ZEROS, ZERO_ADD, ZERO_WRAP, PAIRED, BLOCK_M, BLOCK_N)
    return tl.trans(acc)


@triton.jit
def _plane_loop(XP, W, SHIFTS, S, Z, offs_m, offs_n, mask_m, mask_n, k_start, k_end, stride_xm, stride_wn, stride_wk,
                stride_sn, stride_sg, stride_zn, stride_zg, GROUP_SIZE: tl.constexpr, NIBBLE_ORDER: tl.constexpr,
                HAS_SHIFTS: tl.constexpr, HAS_ZEROS: tl.constexpr, ZERO_ADD: tl.constexpr, ZERO_WRAP: tl.constexpr,
                PAIRED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc^T [BLOCK_N, BLOCK_M]; the values' nibble i at bits 4 i (NIBBLE_ORDER) or at SHIFTS[i]. The zero
    points' words are read by SHIFTS where HAS_SHIFTS, whatever the values' order."""
    j = tl.arange(0, 16)
    k = tl.arange(0, _STEP)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, _STEP):
        words = tl.load(W + offs_n[:, None] * stride_wn + (k0 // 8 + j)[None, :] * stride_wk, mask=mask_n[:, None],
                        other=0)
        group = k0 // GROUP_SIZE
        scale = tl.load(S + offs_n * stride_sn + group * stride_sg, mask=mask_n, other=0.0)[:, None]
        if HAS_ZEROS:  # [BLOCK_N, 1]: one group a step
            zero = packed_zero_points(Z, SHIFTS, offs_n, tl.full((1,), group, tl.int32), mask_n[:, None], stride_zn,
                                      stride_zg, HAS_SHIFTS, ZERO_ADD, ZERO_WRAP)
        else:
            zero = tl.full((BLOCK_N, 1), 8, tl.int32)
        x = tl.load(XP + offs_m[None, :] * stride_xm + (k0 + k)[:, None], mask=mask_m[None, :], other=0.0)
        if PAIRED:
            scale = tl.broadcast_to(scale, words.shape)
            minus_zero = tl.broadcast_to((-(zero.to(tl.float32) + _magic(scale.dtype))).to(scale.dtype), words.shape)
            if NIBBLE_ORDER:
                planes = _nibble_planes(words, scale, minus_zero)
            else:
                planes = _shifted_planes(words, scale, minus_zero, _value_shifts(SHIFTS, False))
            acc = tl.dot(_plane_major(planes), x, acc)
        else:
            w = _plane_major(_float_planes(words, zero, scale, _value_shifts(SHIFTS, NIBBLE_ORDER)))
            if x.dtype == tl.float32:  # eager's fp32 matmul is IEEE fp32, not TF32
                acc = tl.dot(w, x, acc, input_precision="ieee")
            else:
                acc = tl.dot(w.to(x.dtype), x, acc)
    return acc


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
    `zero_convention` (`qfuse.kernels.int4_words.ZERO_CONVENTIONS`)."""
    m, k = x.shape
    n = scales.shape[0]
    block_m, block_n, block_k, group_m, num_warps, num_stages = config or plane_tile(min(m, PLANE_MAX_ROWS))
    splits = splits or plane_splits(m, n, k, block_m, block_n, multiprocessor_count)
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
