"""8-bit weight decode on tensor cores in CUDA C++ (`w8_mma.cu`), compiled by NVRTC at first use.

    W8A8   out [M, N] = (a [M, K] @ w^T) * scale_a * scale_b + bias    a int8 / fp8 e4m3, w the same dtype
    W8A16  out [M, N] = (x [M, K] @ w^T) * scale_b + bias              x bf16 / fp16, w int8 / fp8 e4m3
    M <= 64 a launch, N a multiple of 16, K a multiple of 32; scale_a one value or one a row, scale_b one
    value or one a column (each float32, bf16 or fp16, read as the call gives it: a scale the model computes
    on every call, a cast of a stored one say, costs no preparation)

`repack` puts the [K, N] weight once into the kernel's layout, words [N / 16, K / 32, 32, 4] int32: a lane's
16-byte load is the A operand of one mma.m16n8k32 (8-bit activations) or of two mma.m16n8k16 (half
activations, the weight converted exactly in registers); the .cu file's header gives the order. A block's
warps split K and add their sums in shared memory, so one launch writes the output, epilogue included.

A W8A8 activation arrives quantized: the model's own quantizer runs in Inductor's code, fused into the
kernel that produces the activation (the RMSNorm, the SiLU-mul), so a decode step is one launch for the
producer and one for the linear, as in the bf16 model.

Compiled and launched by `launch`, as the int4 kernel.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from qfuse.kernels.cuda import launch
from qfuse.kernels.cuda.int4_mma import column_tiles, row_launches, warps_for, why_not_launch
from qfuse.kernels.prepared import Packing
from qfuse.schemes import FP8_DTYPE

SOURCE = Path(__file__).with_name("w8_mma.cu")
ROWS_PER_TILE = 16
K_PER_CHUNK = 32
MAX_ROWS = 64
HALF_DTYPES = (torch.bfloat16, torch.float16)
#: common.cuh's dtype codes
DTYPE_CODES = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
PACKINGS = {torch.int8: Packing.W8_MMA_INT8, FP8_DTYPE: Packing.W8_MMA_FP8}
WEIGHT_DTYPE_OF_PACKING = {packing: dtype for dtype, packing in PACKINGS.items()}


def why_not_shape(n: int, k: int) -> str:
    """Why the kernel cannot take a [K, N] weight of these sizes, or ''."""
    if n % ROWS_PER_TILE:
        return f"N is not a multiple of {ROWS_PER_TILE}"
    if k % K_PER_CHUNK:
        return f"K is not a multiple of {K_PER_CHUNK}"
    return ""


def repack(b: torch.Tensor) -> torch.Tensor:
    """words [N / 16, K / 32, 32, 4] int32 of the int8 / fp8 [K, N] weight `b` (any strides): the bytes of
    rows 16 T + g (+ 8) at k = 32 c + 8 t + 0..7, lane 4 g + t of chunk c (the .cu file's header)."""
    k, n = b.shape
    if reason := why_not_shape(n, k):
        raise ValueError(f"the cuda kernel's 8-bit layout cannot hold this weight: {reason}")
    rows = b.t().contiguous().view(torch.uint8)  # [N, K]
    bytes_ = rows.reshape(n // 16, 2, 8, k // 32, 4, 2, 4)  # [T, h, g, C, t, j, byte]: row 16 T + 8 h + g, k 32 C + 8 t + 4 j
    words = bytes_.permute(0, 3, 2, 4, 5, 1, 6).contiguous()  # [T, C, g, t, j, h, byte]: word 2 j + h
    return words.view(torch.int32).reshape(n // 16, k // 32, 32, 4)


ARGUMENT_TYPES = "OOOOOOiiiii"  # words, x, scale_a, scale_b, bias, out; M, N, K, the scales' strides


def _compiled(options: tuple[str, ...], device_index: int) -> launch.CompiledKernel:
    return launch.compiled(SOURCE, "qfuse_w8_mma", options, ARGUMENT_TYPES, device_index,
                           waits_for_the_previous_kernel=True)


#: Row tiles from which a block takes two (N >= 8192): fewer blocks would leave multiprocessors idle
TWO_TILES_FROM = 512


def launch_shape(m: int, n: int, int8_activations: bool = False) -> tuple[int, int, int]:
    """(row tiles a block, warps a block, chunks a warp loads ahead). Two 16-row tiles share a block's loads
    of x where N is large (TWO_TILES_FROM tiles), one elsewhere; warps split K until the grid holds about
    TARGET_WARPS (4 to 16 a block), as the int4 kernel's rule (`int4_mma.launch_shape`), half as many for
    M > 8 rows on two tiles (their accumulators and x's loads). Measured on an H100 against 7 other launch shapes
    at M = 1 and 16, N x K = 4096 x 4096, 14336 x 4096 and 4096 x 14336, in each form (docs/benchmarks.md, "The
    CUDA 8-bit decode kernel"): the fastest of them, or within 4%, in all 24 cases. A warp loads 8 chunks ahead up
    to 8 rows (fp8 W8A8 and W8A16 faster by up to 10%, int8 W8A8 up to 7% slower at 8 rows, so not there: H200,
    "The 8-bit decode kernel's stream"), else 2 on 16 warps, 4 on fewer. Above 16 rows, where each warp's loads
    of x bound a launch: one tile, 8 warps (4 on more than 1024 tiles), 2 chunks ahead up to 32 rows; above, two
    tiles (an even number of them) on 4 warps, 4 chunks ahead. Measured on an H200 at 32 and 64 rows: one launch
    faster than two or four of 16 rows in all 16 cases (docs/benchmarks.md, "Batched decode on the CUDA
    kernels")."""
    tiles = n // ROWS_PER_TILE
    if m > 32:
        return (2 if tiles % 2 == 0 else 1), 4, 4
    if m > 16:
        return 1, (4 if tiles > 1024 else 8), 2
    row_tiles = 2 if tiles >= TWO_TILES_FROM and tiles % 2 == 0 else 1
    warps = min(16, warps_for(tiles // row_tiles))
    if m > 8 and row_tiles == 2:
        warps = max(4, warps // 2)
    if m <= 8 and not int8_activations:
        return row_tiles, warps, 8
    return row_tiles, warps, 2 if warps == 16 else 4


def w8_mma(x: torch.Tensor, words: torch.Tensor, weight_dtype: torch.dtype, scale_a: torch.Tensor | None,
           scale_b: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype,
           shape: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out [M, N] of the module docstring, one launch a MAX_ROWS rows: `x` int8 / fp8 (W8A8, `scale_a` one value,
    [M, 1] or None) or bf16 / fp16 (W8A16, `scale_a` None); `words` from `repack` of a weight of `weight_dtype`;
    `scale_b` one value, N values ([N] or [1, N]) or None; `shape` (row tiles, warps, unroll) by `launch_shape`
    unless given (then for every launch)."""
    m, k = x.shape
    n = words.shape[0] * ROWS_PER_TILE
    dtypes = tuple(DTYPE_CODES[None if value is None else value.dtype] for value in (scale_a, scale_b, bias))
    launches = row_launches(m, MAX_ROWS)
    plans = [_launch(rows, n, x.dtype, weight_dtype, dtypes, DTYPE_CODES[out_dtype], x.device.index or 0, shape)
             for _, rows in launches]
    sb_stride = 0 if scale_b is None or scale_b.numel() == 1 else 1
    if sb_stride and scale_b.numel() != n:
        raise ValueError(f"w8_mma takes one weight scale or one a column ({n}), not {scale_b.numel()}")
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if m == 0:
        return out
    x = x.contiguous()
    if x.data_ptr() % 16:  # the kernel reads x in 8- or 16-byte vectors (a row is a multiple of 32 elements)
        x = x.clone()
    sa_stride = 0 if scale_a is None or scale_a.numel() == 1 else 1
    scale_a = words if scale_a is None else scale_a.contiguous()  # (an absent operand: any tensor, never read)
    scale_b = words if scale_b is None else scale_b.contiguous()
    bias = words if bias is None else bias.contiguous()
    for (start, rows), (kernel, blocks, warps) in zip(launches, plans):
        kernel.launch(blocks, warps, (words, x[start:] if start else x, scale_a[start:] if start and sa_stride else scale_a,
                                      scale_b, bias, out[start:] if start else out, rows, n, k, sa_stride, sb_stride),
                      x.device)
    return out


@functools.cache
def _launch(rows: int, n: int, dtype: torch.dtype, weight_dtype: torch.dtype, operand_codes: tuple[int, int, int],
            out_code: int, device_index: int, shape: tuple[int, int, int] | None) -> tuple:
    """(compiled kernel, blocks, warps) of one launch of `w8_mma` on `rows` (at most MAX_ROWS), for the operands'
    dtype codes (scale_a, scale_b, bias; 0 for none) and the output's: the launch rule, its check and the kernel's
    compile once per size, not on every call."""
    row_tiles, warps, unroll = shape or launch_shape(rows, n, dtype == torch.int8)
    if reason := why_not_launch(rows, warps, row_tiles):
        raise ValueError(f"w8_mma cannot launch {rows} rows on {row_tiles} row tiles and {warps} warps: {reason}")
    options = [f"-D{name}={code}" for name, code in zip(("SCALE_A", "SCALE_B", "BIAS", "OUT"), (*operand_codes, out_code))]
    options += [] if dtype in HALF_DTYPES else ["-DW8A8"]
    options += ["-DWEIGHT_FP8"] if weight_dtype == FP8_DTYPE else []
    options += ["-DHALF_BF16"] if dtype == torch.bfloat16 else []
    kernel = _compiled((f"-DM_TILES={column_tiles(rows)}", f"-DROW_TILES={row_tiles}", f"-DWARPS={warps}",
                        f"-DUNROLL={unroll}", *options), device_index)
    return kernel, n // (ROWS_PER_TILE * row_tiles), warps
