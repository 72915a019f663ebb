"""The `triton` kernel's lowering of `qfuse::weight_only_scaled_mm` (int8 / fp8 W8A16), by M.

Decode and batched decode (M <= 128; a tile per M bucket, a dynamic M guarded on its bucket,
`ir.rows_at_most`): a Triton template on the stored weight.

    partial = template(X [M, K], B int8 / fp8 [K, N] (the w.t() view of a stored [N, K]), SB?, BIAS?)
            = float32 [SPLIT_K * M, N]: x @ (b * scale_b) over SPLIT_K ranges of K, the weight
              converted in registers (`qfuse.kernels.triton.w8a16_mm.w8a16_dot`)
    y       = (partial.reshape(SPLIT_K, M, N).sum(0) + bias).to(out_dtype)      Inductor's code; with
              one split the bias is inside the template and the cast and what follows fuse into its store

The template reads the model's own weight and scale: nothing is converted, repacked or cached.
Tiles: `w8a16_mm.DECODE_TILE` up to 16 rows and `w8a16_mm.BATCHED_TILES` up to 128, under
max-autotune also `w8a16_mm.AUTOTUNE_TILES`' shapes.

Prefill (M > 128): Inductor's own dequantize + mm, written here in IR from the same stored tensors:
the weight times its scale in float32, rounded once to x's dtype (as the template's tile), then
Inductor's GEMM (cuBLAS, or its autotuned templates under max-autotune), with a bias of x's dtype in
the GEMM (addmm). That is what Inductor compiles from a model that dequantizes its weight, so a
prefill linear costs what it cost before qfuse took it (a float32 result cast back to bf16 after
the GEMM, an earlier version, was slower; measured: docs/benchmarks.md, "W8A16: fp8 weights, bf16 activations").

Prefill lowers on any device (tests run it on the CPU); the template needs CUDA. Stays an extern
call of the op: a weight zero point (the kernel takes none: the registry does not pick it then),
M = 0, decode on a device other than CUDA.
"""

from __future__ import annotations

import sympy
import torch
from torch._inductor import ir
from torch._inductor.virtualized import V
from torch.utils._sympy.functions import FloorDiv

from qfuse.kernels.base import DECODE_ROWS
from qfuse.lowerings.ir import convert, known_equal, lower, numel, record_lowering, rows_at_most, rows_bucket
from qfuse.lowerings.triton.template import max_autotune, split_k_linear, why_not_one_element
from qfuse.ops.weight_only import WeightOnlyScaledMmArgs

aten, prims = torch.ops.aten, torch.ops.prims

# INPUTS: X, B, and each of SB, BIAS that the call has (`template_for_inputs`). The output holds
# SPLIT_K row blocks of M rows: split pid_k stores its partial sums at rows pid_k * M + m.
_SOURCE = r"""
from qfuse.kernels.triton.scaled_mm import grouped_tile, scale_and_bias
from qfuse.kernels.triton.w8a16_mm import w8a16_dot
from qfuse.kernels.triton.weight_stream import k_range
{{def_kernel(INPUTS)}}
    M = {{size("X", 0)}}
    N = {{size("B", 1)}}
    K = {{size("X", 1)}}
{{TILE_OFFSETS}}
    pid_k = tl.program_id(1)
    k_start, k_end = k_range(K, pid_k, SPLIT_K, BLOCK_K)
    acc = w8a16_dot(
        X, B, {{"SB" if SCALE_B else "X"}}, offs_m, offs_n, mask_m, mask_n, K, k_start, k_end,
        {{stride("X", 0)}}, {{stride("X", 1)}}, {{stride("B", 0)}}, {{stride("B", 1)}},
        {{stride("SB", 0) if SCALE_B else 0}}, {{stride("SB", 1) if SCALE_B else 0}},
        SCALE_B, GROUPS_PER_STEP, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K,
    )
    acc = scale_and_bias(
        acc, offs_m, offs_n, mask_m, mask_n, X, {{"SB" if SCALE_B else "X"}}, {{"BIAS" if HAS_BIAS else "X"}},
        0, {{stride("SB", 1) if SCALE_B else 0}}, 0, SCALE_B, HAS_BIAS,
    )
    offs_m = offs_m + pid_k * M
{{STORE_TILE}}"""


def _rows(call: WeightOnlyScaledMmArgs):
    return sympy.Mul(*call.x.get_size()[:-1])


def _is_decode(rows) -> bool:
    """M <= 16: the decode template's rows (a dynamic M guarded on it, `rows_at_most`)."""
    return rows_at_most(rows, DECODE_ROWS)


def why_not(call: WeightOnlyScaledMmArgs) -> str:
    """'' if the call is lowered (template or Inductor's dequantize + mm), else why it stays an extern call."""
    rows = _rows(call)
    if call.azp_b is not None:
        return "a weight zero point: the triton kernel takes symmetric weights only"
    if V.graph.sizevars.statically_known_true(sympy.Eq(rows, 0)):
        return "M is 0"
    if not all(sympy.sympify(size).is_number for size in call.b.get_size()):
        return "the weight's K and N are dynamic: the template's tiles and the block scales need them static"
    if call.x.get_device().type != "cuda" and _is_decode(rows):
        return "the Triton template runs on CUDA"
    return why_not_one_element(rows, call.b.get_size()[1])


def scale_as_matrix(call: WeightOnlyScaledMmArgs, n: int):
    """(the scale as the kernel reads it, its kind): none, one value [1, 1], per column [1, N], or
    per block [ceil(K / 128), ceil(N / 128)] (the shapes `qfuse::weight_only_scaled_mm` accepts)."""
    from qfuse.kernels.triton.scaled_mm import BLOCK_SCALE, NO_SCALE, TENSOR_SCALE, VECTOR_SCALE

    scale = call.scale_b
    if scale is None:
        return None, NO_SCALE
    scale = convert(scale, torch.float32)
    if known_equal(numel(scale), 1):
        return lower(aten.reshape.default, scale, [1, 1]), TENSOR_SCALE
    if known_equal(numel(scale), n) and known_equal(scale.get_size()[-1], n):
        return lower(aten.reshape.default, scale, [1, n]), VECTOR_SCALE
    return scale, BLOCK_SCALE


def lower_call(call: WeightOnlyScaledMmArgs):
    """The call in Inductor IR (`why_not` said it can be)."""
    *lead, k = call.x.get_size()
    k, n = int(k), int(call.b.get_size()[1])
    rows = _rows(call)
    x2d = lower(aten.reshape.default, call.x, [rows, k])
    scale, kind = scale_as_matrix(call, n)
    from qfuse.kernels.triton.w8a16_mm import BATCHED_TILES, TEMPLATE_MAX_ROWS

    # the template's buckets: 16 rows, then BATCHED_TILES'; CPU: decode stays an extern call (`why_not`)
    bucket = rows_bucket(rows, (DECODE_ROWS, *BATCHED_TILES)) if call.x.get_device().type == "cuda" else 0
    if not bucket:
        dynamic = "" if sympy.sympify(rows).is_number else ": a dynamic M, guarded"
        out = _dequantize_and_mm(call, x2d, scale, kind, k, n)
        record_lowering(f"Inductor's own dequantize + mm (M above {TEMPLATE_MAX_ROWS}{dynamic}); the cast and what "
                        "follows in its fused pointwise code")
    else:
        out = _template(call, x2d, scale, kind, rows, k, n, bucket)
    return lower(aten.reshape.default, convert(out, call.out_dtype), [*lead, n])


def _template(call: WeightOnlyScaledMmArgs, x2d, scale, kind: int, rows, k: int, n: int, bucket: int):
    """The template for M's bucket: the decode tile up to 16 rows, then `BATCHED_TILES`' (batched decode)."""
    from qfuse.kernels.triton.scaled_mm import BLOCK_SCALE, SCALE_GROUP, multiprocessors
    from qfuse.kernels.triton.w8a16_mm import (AUTOTUNE_TILES, BATCHED_TILES, DECODE_PROGRAMS_PER_SM, DECODE_TILE,
                                               batched_splits, kernel_meta)
    from qfuse.kernels.triton.weight_stream import fit_block_k, split_k

    tile = DECODE_TILE if bucket == DECODE_ROWS else BATCHED_TILES[bucket][0]
    # max-autotune: the decode search's next best shapes too, at this bucket's BLOCK_M
    tiles = [tile] + ([other._replace(block_m=tile.block_m) for other in AUTOTUNE_TILES] if max_autotune() else [])
    if kind == BLOCK_SCALE:
        tiles = [tile._replace(block_k=fit_block_k(tile.block_k, SCALE_GROUP, k)) for tile in tiles]
    tiles = list(dict.fromkeys(tiles))
    sms = multiprocessors(x2d.get_device())
    if bucket == DECODE_ROWS:
        splits = split_k(DECODE_ROWS, n, k, tiles[0].block_n, tiles[0].block_k, sms, DECODE_PROGRAMS_PER_SM)
    else:
        splits = batched_splits(bucket, n, k, tiles[0].block_k, sms)
    named = {"X": x2d, "B": call.b, "SB": scale, "BIAS": call.bias if splits == 1 else None}
    meta = dict(HAS_BIAS=splits == 1 and call.bias is not None, SPLIT_K=splits)
    out, how = split_k_linear(_SOURCE, "qfuse_w8a16_linear", named, rows, n, splits, call.bias, tiles,
                              lambda tile: meta | kernel_meta(kind, tile.block_k, k))
    record_lowering(how + f"; the {'int8' if call.b.get_dtype() == torch.int8 else 'fp8'} weight converted in registers")
    return out


def _dequantize_and_mm(call: WeightOnlyScaledMmArgs, x2d, scale, kind: int, k: int, n: int):
    """x @ (b * scale_b) + bias in Inductor IR, as Inductor compiles a model that dequantizes its weight:
    w = b * scale_b in float32 (block scales gathered per element), rounded once to x's dtype (as the
    template's tile), then Inductor's own mm, or addmm with a bias of x's dtype (bias in the GEMM)."""
    from qfuse.kernels.triton.scaled_mm import BLOCK_SCALE, SCALE_GROUP

    dtype = x2d.get_dtype()
    weight = convert(call.b, torch.float32)
    if kind == BLOCK_SCALE:
        block_scale = scale.make_loader()
        scale = ir.Pointwise.create(
            device=x2d.get_device(), dtype=torch.float32, ranges=[k, n],
            inner_fn=lambda index: block_scale([FloorDiv(index[0], SCALE_GROUP), FloorDiv(index[1], SCALE_GROUP)]),
        )
    if scale is not None:
        weight = lower(aten.mul.Tensor, weight, scale)
    weight = convert(weight, dtype)
    if call.bias is None:
        return lower(aten.mm.default, x2d, weight)
    if call.bias.get_dtype() == dtype:
        return lower(aten.addmm.default, call.bias, x2d, weight)
    return lower(aten.add.Tensor, convert(lower(aten.mm.default, x2d, weight), torch.float32),
                 convert(call.bias, torch.float32))
