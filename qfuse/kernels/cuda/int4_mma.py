"""W4A16 decode on tensor cores in CUDA C++ (`int4_mma.cu`), compiled by NVRTC at first use.

    out [M, N] = x [M, K] @ w^T + bias,   w[n, k] = (v[n, k] - z[n, k / G]) * s[n, k / G]  in x's dtype
    M <= 64 a launch, N a multiple of 16, K a multiple of 64, G a multiple of 64 (or K: per channel)

`repack` puts qfuse's int4 convention (values v in [-8, 7] as int8 [K, N], scales and zero points
[K / G, N]) once into the kernel's layout: words [N / 16, K / 64, 32, 4] int32, a 16-byte load per lane
holding the A operand of four mma.m16n8k16 (the .cu file's header gives the order), and the pairs
(s, -(MAGIC + 8 + z)) [K / G, N]. The kernel dequantizes each value once, exactly as eager rounds it,
into the MMA's registers, and uses it for every row of x (8 a tile of the MMA's B); a block's warps split K
and add their sums in shared memory, so one launch writes the output with its bias and cast.

The same kernel also reads a checkpoint's own words where they lie (`checkpoint_weight`: compressed-tensors' and
GPTQ v2's [N, K / 8], AutoGPTQ's [K / 8, N], their scales and packed zero points, nothing repacked or copied; a
table of the tensors' addresses is all it keeps, one row a sibling): a lane's two 8-byte loads a chunk instead of
one of 16, and x's B operands put in the words' k order by `prmt`. A quantized model then takes the GPU memory
Inductor's code takes for it (issue #41), and a weight loaded again in place is read as it is, under CUDA graphs too;
it takes more GPU time (1.14-1.73x the repacked kernel's a linear on an H200), so it runs where
`QfuseConfig.int4_in_place` asks for it.

Compiled and launched by `launch` (NVRTC, the static CUDA launcher on the current stream, so a CUDA graph
captures it): a few µs of host time a call, none in a graph's replay.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from qfuse.kernels.cuda import launch
from qfuse.kernels.prepared import Packing, PreparedWeight

SOURCE = Path(__file__).with_name("int4_mma.cu")
ARGUMENT_TYPES = "OOOOOiiii"  # words, x, pairs, bias, out; M, N, K, has_bias
CHECKPOINT_ARGUMENT_TYPES = "OOOOiiii"  # members, x, bias, out; M, N, K, has_bias
ROWS_PER_TILE = 16
K_PER_CHUNK = 64
MAX_ROWS = 64
COLUMNS_PER_TILE = 8  # rows of x a tile of the MMA's B: its 8 columns
SHARED_BYTES = 48 * 2**10  # a block's static shared memory, at most
_MAGIC = {torch.bfloat16: 128, torch.float16: 1024}  # the half float whose ulp is 1
# a word's nibble j = h + 2 (e >> 1) + 4 (e & 1) holds row half h at k offset e (the .cu header): byte b = j >> 1
# holds k offset e = _BYTE_OFFSETS[b], row g in its low nibble and row g + 8 in its high one
_BYTE_OFFSETS = [0, 2, 1, 3]
PACKINGS = {torch.bfloat16: Packing.INT4_MMA_BF16, torch.float16: Packing.INT4_MMA_FP16}  # by the scales' (and x's) dtype
CHECKPOINT_PACKINGS = {torch.bfloat16: Packing.INT4_CHECKPOINT_BF16, torch.float16: Packing.INT4_CHECKPOINT_FP16}
#: the .cu file's CHECKPOINT layouts of the canonical [N, K / 8] words: a row's words along K (compressed-tensors,
#: GPTQ v2: contiguous), or a word row's words along N (AutoGPTQ's [K / 8, N] qweight, transposed)
WORDS_ALONG_K, WORDS_ALONG_N = 1, 2
#: the .cu file's ZERO_CONVENTION of the op's zero conventions (0: no zero points, the uint4 offset 8)
ZERO_CONVENTION_CODES = {"stored": 1, "plus_one": 2, "plus_one_mod_16": 3}
STANDARD_SHIFTS = tuple(range(0, 32, 4))  # nibble e at bits 4 e, what the kernel's dequantize reads


def why_not_shape(n: int, k: int, group_size: int) -> str:
    """Why the kernel cannot take a weight of these sizes, or ''."""
    if n % ROWS_PER_TILE:
        return f"N is not a multiple of {ROWS_PER_TILE}"
    if k % K_PER_CHUNK:
        return f"K is not a multiple of {K_PER_CHUNK}"
    if group_size % K_PER_CHUNK:
        return f"groups of {group_size}: the kernel reads one scale a row for {K_PER_CHUNK} values of K"
    if group_size != k and group_size & (group_size - 1):
        return f"groups of {group_size}: the kernel finds a chunk's group by a shift (a power of two, or one group along K)"
    return ""


def group_shift(k: int, group_size: int) -> int:
    """The kernel's GROUP_SHIFT: chunk c of K is in group c >> GROUP_SHIFT (30: one group along K)."""
    return 30 if group_size == k else (group_size // K_PER_CHUNK).bit_length() - 1


def repack(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(words [N / 16, K / 64, 32, 4] int32, pairs [K / G, N] int32) from qfuse's int4 convention: `values`
    int8 [K, N] in [-8, 7], `scale` [K / G, N] in the activation's dtype, `zero_point` int8 [K / G, N] or None."""
    k, n = values.shape
    if reason := why_not_shape(n, k, k // scale.shape[0]):
        raise ValueError(f"the cuda kernel's int4 layout cannot hold this weight: {reason}")
    # one byte a nibble u = v + 8 (uint8 wraps -8 .. 7 + 8 to 0 .. 15), [T, h, g, C, t, s, e]: row 16 T + 8 h + g,
    # k = 64 C + 16 t + 4 s + e
    nibbles = values.t().to(torch.uint8, memory_format=torch.contiguous_format).add_(8)
    nibbles = nibbles.reshape(n // 16, 2, 8, k // 64, 4, 4, 4)
    # byte b of a word: its nibbles j = 2 b (row g) and 2 b + 1 (row g + 8) at k + e, e = _BYTE_OFFSETS[b]
    low, high = nibbles[:, 0][..., _BYTE_OFFSETS], nibbles[:, 1][..., _BYTE_OFFSETS]  # [T, g, C, t, s, b]
    words = (low | (high << 4)).permute(0, 2, 1, 3, 4, 5).contiguous()  # [T, C, g, t, s, b]: little-endian words
    words = words.view(torch.int32).reshape(n // 16, k // 64, 32, 4)  # (no wider temporary than a byte a value)
    zero = torch.zeros_like(scale, dtype=torch.int32) if zero_point is None else zero_point.to(torch.int32)
    minus_zero = (-(zero + 8 + _MAGIC[scale.dtype])).to(scale.dtype)  # exact: integers below 2 MAGIC
    pairs = torch.stack([scale, minus_zero], dim=-1).contiguous().view(torch.int32).squeeze(-1)  # [K / G, N]
    # rows 16 T + g and 16 T + g + 8 side by side (one 8-byte load a lane): column 16 T + 2 g + h
    pairs = pairs.reshape(-1, n // 16, 2, 8).transpose(-1, -2).reshape(-1, n)
    return words.contiguous(), pairs.contiguous()


def _strides_are(tensor: torch.Tensor, strides: tuple[int, int]) -> bool:
    """Whether a 2-D tensor has these strides on its dimensions longer than one (any stride fits a size of one)."""
    return all(size == 1 or stride == want for size, stride, want in zip(tensor.shape, tensor.stride(), strides))


def _words_layout(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> int:
    """The CHECKPOINT layout of one member's canonical views (words [N, K / 8], scales [N, K / G], zero points
    [N / 8, K / G]), all in the same orientation, or 0."""
    n, words = packed.shape
    groups = scales.shape[1]
    for layout, strides in ((WORDS_ALONG_K, ((words, 1), (groups, 1), (groups, 1))),
                            (WORDS_ALONG_N, ((1, n), (1, n), (1, n // 8)))):
        if all(tensor is None or _strides_are(tensor, want) for tensor, want in zip((packed, scales, zeros), strides)):
            return layout
    return 0


def why_not_checkpoint(members: list[tuple], group_size: int) -> str:
    """Why the kernel cannot read these members' int4 words where they lie (each (packed, shifts, scales, zeros),
    the op's canonical views; shifts None for the standard ones), or ''. Reads a shifts tensor's values (once a
    weight: the caller prepares it once)."""
    packed, _, scales, _ = members[0]
    k = packed.shape[1] * 8
    if packed.device.type != "cuda" or any(tensor is not None and tensor.device != packed.device
                                           for member in members for tensor in member if tensor is not packed):
        return "not all on one CUDA device"
    if any(member[0].dtype != torch.int32 for member in members):
        return "int8 storage (one value a byte): the words are the kernel's int4 only once their range is checked"
    shift_values = {tuple(shifts.tolist()) for _, shifts, _, _ in members if shifts is not None}
    if shifts := next((values for values in shift_values if values != STANDARD_SHIFTS), None):
        return f"nibbles at shifts {list(shifts)}: the kernel reads nibble e at bits 4 e"
    if scales.dtype not in CHECKPOINT_PACKINGS or any(member[2].dtype != scales.dtype for member in members):
        return f"scales of {scales.dtype}: the kernel rounds (q - z) * s in bf16 or fp16"
    if len({member[3] is None for member in members}) > 1:
        return "members with and without zero points (one zero convention a launch)"
    if reason := why_not_shape(ROWS_PER_TILE, k, group_size):
        return reason
    if any(member[0].shape[0] % ROWS_PER_TILE for member in members):
        return f"a member's N is not a multiple of {ROWS_PER_TILE} (a block's rows are one member's)"
    layouts = {_words_layout(packed, scales, zeros) for packed, _, scales, zeros in members}
    if layouts not in ({WORDS_ALONG_K}, {WORDS_ALONG_N}):
        return "words, scales and zero points not all [N, K / 8]-contiguous or all [K / 8, N]-contiguous"
    if any(packed.data_ptr() % 8 for packed, _, _, _ in members):
        return "words not aligned for the kernel's 8-byte loads"
    return ""


def checkpoint_weight(members: list[tuple], group_size: int, zero_convention: str) -> PreparedWeight:
    """The members' int4 weights (each (packed, shifts, scales, zeros): the op's canonical views; `why_not_checkpoint`
    is '') read where they lie, side by side along N: `data` int64 [members, 4] holds each member's addresses (0: no zero
    points) and the end of its 16-row tiles; `settings` (layout, zero convention code, group size)."""
    rows, end = [], 0
    for packed, _, scales, zeros in members:
        end += packed.shape[0] // ROWS_PER_TILE
        rows.append([packed.data_ptr(), scales.data_ptr(), 0 if zeros is None else zeros.data_ptr(), end])
    packed, _, scales, zeros = members[0]
    settings = (_words_layout(packed, scales, zeros), 0 if zeros is None else ZERO_CONVENTION_CODES[zero_convention],
                group_size)
    table = torch.tensor(rows, dtype=torch.int64, device=packed.device)
    return PreparedWeight(table, None, None, packed.shape[1] * 8, end * ROWS_PER_TILE,
                          packing=CHECKPOINT_PACKINGS[scales.dtype], settings=settings)


def row_launches(m: int, most: int = MAX_ROWS) -> list[tuple[int, int]]:
    """(first row, rows) of each launch of a decode kernel on `m` rows, `most` rows a launch."""
    return [(0, m)] if 0 < m <= most else [(start, min(most, m - start)) for start in range(0, m, most)]


def column_tiles(m: int) -> int:
    """The 8-column tiles of B a launch of `m` rows computes: 1, 2, 4 or 8 (a compiled kernel each)."""
    return 1 << max(0, (m - 1) // COLUMNS_PER_TILE).bit_length()


def why_not_launch(m: int, warps: int, row_tiles: int = 1) -> str:
    """Why a block of `warps` warps on `row_tiles` 16-row tiles cannot add up the 4-byte partial sums of `m` rows
    (4 a lane, row tile and tile of B) in static shared memory, or ''."""
    m_tiles = column_tiles(m)
    need = warps * 32 * 4 * row_tiles * m_tiles * 4
    return f"{warps} warps' partial sums of {m_tiles} tiles take {need} bytes of shared memory" if need > SHARED_BYTES else ""


def _compiled(dtype: torch.dtype, m_tiles: int, warps: int, unroll: int, shift: int, out_f32: bool,
              device_index: int, checkpoint: tuple[int, int] | None = None) -> launch.CompiledKernel:
    """`checkpoint` (layout, zero convention code): the kernel reading a checkpoint's words."""
    options = [f"-DM_TILES={m_tiles}", f"-DWARPS={warps}", f"-DUNROLL={unroll}", f"-DGROUP_SHIFT={shift}"]
    options += ["-DHALF_BF16"] if dtype == torch.bfloat16 else []
    options += ["-DOUT_F32"] if out_f32 else []
    if checkpoint is None:
        return launch.compiled(SOURCE, "qfuse_int4_mma", tuple(options), ARGUMENT_TYPES, device_index,
                               waits_for_the_previous_kernel=True)
    options += [f"-DCHECKPOINT={checkpoint[0]}", f"-DZERO_CONVENTION={checkpoint[1]}"]
    return launch.compiled(SOURCE, "qfuse_int4_mma_checkpoint", tuple(options), CHECKPOINT_ARGUMENT_TYPES, device_index,
                           waits_for_the_previous_kernel=True)


#: Warps a launch aims for, all blocks together: 27-31 a multiprocessor of an H100 were the fastest
#: (docs/benchmarks.md, "A Llama decoder's tokens/s, and the CUDA W4A16 decode kernel")
TARGET_WARPS = 4096


def warps_for(blocks: int, target: int = TARGET_WARPS) -> int:
    """Warps a block (a power of two, 4 at least) that bring `blocks` blocks to about `target` warps."""
    return max(4, 1 << max(0, (target // max(blocks, 1)).bit_length() - 1))


def launch_shape(m: int, n: int, k: int) -> tuple[int, int]:
    """(warps a block, chunks a warp loads ahead). A block is 16 rows, so up to 16 rows warps split K until the grid
    holds about TARGET_WARPS (4 to 16 a block), each loading 8 chunks ahead where its share has 8, else 4 (the fastest
    of 4-16 warps and 2-8 chunks at M = 1 and 16 on the four Llama-3-8B shapes, H200: docs/benchmarks.md, "The int4
    decode kernel's stream").
    Above 16 rows, where each warp's loads of x, not the weight, bound a launch: up to 32 rows the grid aims at half
    as many warps (8 at most), 4 chunks ahead (2 on more than 1024 tiles); above 32, 4 warps, 8 chunks ahead, where
    one launch beat two or four of 16 rows in 7 of 8 cases (measured on the kernel before its loop was trimmed:
    "Batched decode on the CUDA kernels")."""
    tiles = n // ROWS_PER_TILE
    if m > 32:
        return 4, 8
    if m > 16:
        return min(8, warps_for(tiles, TARGET_WARPS // 2)), 2 if tiles > 1024 else 4
    warps = min(16, warps_for(tiles))
    return warps, 8 if k // K_PER_CHUNK // warps >= 8 else 4


def takes(weight: PreparedWeight, dtype: torch.dtype) -> bool:
    """Whether `weight` was prepared for this kernel and activations of `dtype` (repacked or read in place)."""
    return weight.packing in (PACKINGS.get(dtype), CHECKPOINT_PACKINGS.get(dtype))


def multiply(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w + bias on a weight prepared for this kernel: repacked (`repack`) or read in place (`checkpoint_weight`)."""
    if weight.packing in CHECKPOINT_PACKINGS.values():
        return int4_mma_checkpoint(x, weight, bias, out_dtype, out=out)
    return int4_mma(x, weight.data, weight.scale, bias, weight.k // weight.scale.shape[0], out_dtype, out=out)


def int4_mma(x: torch.Tensor, words: torch.Tensor, pairs: torch.Tensor, bias: torch.Tensor | None,
             group_size: int, out_dtype: torch.dtype, shape: tuple[int, int] | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16) @ w^T + bias, w from `repack`, as `out_dtype` (x's dtype or float32), into `out`
    (contiguous [M, N]) where given: one launch a MAX_ROWS rows; `shape` (warps, unroll) by `launch_shape` unless
    given (then for every launch)."""
    return _run(x, pairs.shape[1], group_size, bias, out_dtype, shape, out, None,
                lambda x, bias, out, rows: (words, x, pairs, pairs if bias is None else bias, out))


def int4_mma_checkpoint(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype,
                        shape: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`int4_mma` on a `checkpoint_weight`: the checkpoint's words read where they lie."""
    layout, zero_convention, group_size = weight.settings
    table = weight.data
    return _run(x, weight.n, group_size, bias, out_dtype, shape, out, (layout, zero_convention),
                lambda x, bias, out, rows: (table, x, table if bias is None else bias, out))


def _run(x: torch.Tensor, n: int, group_size: int, bias: torch.Tensor | None, out_dtype: torch.dtype,
         shape: tuple[int, int] | None, out: torch.Tensor | None, checkpoint: tuple[int, int] | None,
         tensors) -> torch.Tensor:
    """The launches of `int4_mma` and `int4_mma_checkpoint`: `tensors(x, bias, out, rows)` a launch's tensor
    arguments."""
    m, k = x.shape
    launches = row_launches(m)
    shift = group_shift(k, group_size)
    plans = [_launch(rows, n, k, shift, x.dtype, out_dtype == torch.float32, x.device.index or 0, shape, checkpoint)
             for _, rows in launches]
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if m == 0:
        return out
    x = x.contiguous()
    if x.data_ptr() % 16:  # the kernel reads x in 16-byte vectors (a row is a multiple of 64 halves)
        x = x.clone()
    bias = None if bias is None else bias.contiguous()  # read as bias[n]
    for (start, rows), (kernel, warps) in zip(launches, plans):
        arguments = tensors(x[start:] if start else x, bias, out[start:] if start else out, rows)
        kernel.launch(n // ROWS_PER_TILE, warps, (*arguments, rows, n, k, int(bias is not None)), x.device)
    return out


@functools.cache
def _launch(rows: int, n: int, k: int, shift: int, dtype: torch.dtype, out_f32: bool, device_index: int,
            shape: tuple[int, int] | None, checkpoint: tuple[int, int] | None = None) -> tuple[launch.CompiledKernel, int]:
    """(compiled kernel, warps) of one launch of `int4_mma` on `rows` (at most MAX_ROWS): the launch rule, its check
    and the kernel's compile once per size (at most MAX_ROWS sizes a weight shape), not on every call."""
    warps, unroll = shape or launch_shape(rows, n, k)
    if checkpoint and checkpoint[0] == WORDS_ALONG_K and shape is None:
        unroll = min(unroll, 4)  # 8 ahead spills on a row's words (H200: 16-38% slower; docs/kernels.md)
    if reason := why_not_launch(rows, warps):
        raise ValueError(f"int4_mma cannot launch {rows} rows on {warps} warps: {reason}")
    return _compiled(dtype, column_tiles(rows), warps, unroll, shift, out_f32, device_index, checkpoint), warps
