"""The `triton` kernel's lowering of `qfuse::int4_weight_only_mm`, by M.

Decode (M <= 16, and for AWQ's words and intx's int8 storage batched decode up to 128 rows:
`int4_mm.BATCHED_TILES`; a dynamic M guarded on its bucket, `ir.rows_at_most`): a Triton template on the
stored words.

    partial = template(X [M, K], W int32 [N, K / 8] (AWQ: [K, N / 8]; int8 storage: int8 [N, K]), SHIFTS [8]?,
                       S [N, K / g], Z int32 [N / 8, K / g]? (int8 storage: int8 [N, K / g]?))
            = float32 [SPLIT_K * M, N]: x @ w^T over SPLIT_K ranges of K, w dequantized in registers
              (`qfuse.kernels.triton.int4_mm.int4_dot`; SPLIT_K from `int4_mm.split_k`)
    y       = (partial.reshape(SPLIT_K, M, N).sum(0) + bias).to(out_dtype)      Inductor's code, with
              the next pointwise ops; with one split the bias is inside the template and the cast
              and what follows fuse into its store

The template reads the model's own tensors: the words as the checkpoint packs them, the shifts it
stores (or 0, 4, ..., 28 where the model computes them), its scales and packed zero points, so no
weight is unpacked, repacked or cached, and Inductor launches the kernel itself.
Tiles: `int4_mm.DECODE_TILE` and `fit_block_k`; under max-autotune also `int4_mm.AUTOTUNE_TILES`
(the split is the call's, shared by every tile: it decides the output's shape).

Words packed along K in whole steps of 128 with one scale group a step (groups of a multiple of 128,
or per channel: `int4_planes.takes_planes`, GPTQ g128 among them) take the nibble-plane template
instead (`qfuse.kernels.triton.int4_planes.plane_dot`), on X permuted by plane in Inductor's code (a
copy of the M x K activation), up to `int4_planes.PLANE_MAX_ROWS` = 256 rows, batched decode
included: a tile and a split per M bucket (16, 32, 64, 128, 256: `PLANE_TILES`, `plane_splits`; a
dynamic M guarded on its bucket):

    partial = template(XP [M, K], W, SHIFTS?, S, Z?)      the same output and epilogue as above

It takes less GPU time than the words template at every decode shape
(measured: docs/benchmarks.md, "The nibble-plane template, paired in the MMA's registers"), and from
M = 17 to 256 less than Inductor's dequantize + mm on the same form
(measured: docs/benchmarks.md, "Batched decode: the plane template up to 256 rows"). The activation's
plane copy is one small kernel per activation, shared by the linears that read it.

The op's int8 storage (torchao's intx: int8 [N, K] values, int8 zero points) takes the words
template, which reads the values as they are (`INT8_VALUES`).

Above the template's rows (M > 16; AWQ M > 128; M > 256 on planes): the weight dequantized into a buffer,
then Inductor's GEMM (cuBLAS, or its autotuned templates under max-autotune), which beats the decode templates
there (docs/benchmarks.md, gpu_weight_only). On CUDA the buffer is written by a Triton template in tiles
(`qfuse.lowerings.triton.dequantize`), faster than Inductor's own pointwise code for it; with act order (a
`g_idx`, at any M) and on the CPU, by Inductor's pointwise code, written here in IR from the same stored tensors.

Act order has two ways onto qfuse's kernels, both on a weight sorted by group once:
- under freezing, at the rows a template takes the sorted weight (`_template_bounds`: planes up to 256,
  words up to 16), the weight is a constant: it is sorted at compile time and the call becomes the
  plain form on the sorted words, the activation gathered in Inductor's code (`_act_order_on_constants`, on `lowerings.frozen`);
- under CUDA graphs, at decode (M <= 16), the op's extern call: its Python sorts the weight on the
  first call (`prepared_int4_weight`) and runs at capture only, so a replay is the gather and the
  eager kernel.
Both are faster than Inductor's code on the same form; the extern call stops at decode because at
256 rows it was slower, and above the template's rows the sorted weight was slower than
the gathers (measured: docs/benchmarks.md, "Act order on a weight sorted once: freezing and CUDA graphs").

The CPU `torch` kernel's lowering is `lowerings.torch_native`'s. The same dequantize + mm, on any device, is the
code `lowerings.dispatch` gives a dynamic M's bucket where every kernel is slower than Inductor's own
(`inductors_own`: on the CPU, M above `int4_cpu.MAX_ROWS`).
"""

from __future__ import annotations

import sympy
import torch
from torch._inductor import config as inductor_config
from torch._inductor.virtualized import V

from qfuse.kernels.base import DECODE_ROWS
from qfuse.kernels.prepared import Packing
from qfuse.lowerings.frozen import constant_weight, prepared_now
from qfuse.lowerings.ir import (IR_OPS, append_to_lowering, as_matrix, convert, extern_call, lower, record_lowering,
                                rows_and_k, rows_at_most, rows_bucket, tensor_constant)
from qfuse.lowerings.triton.template import max_autotune, split_k_linear, why_not_one_element
from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs, apply_zero_convention
from qfuse.schemes import INT4_OFFSET

aten, prims = torch.ops.aten, torch.ops.prims
ACT_ORDER = ("a g_idx: act order gathers every column's scale and zero point, which made the template slower than "
             "Inductor's code at decode (measured on an H100: docs/benchmarks.md, \"AutoGPTQ with act order\"); "
             "a weight sorted by group once is read instead under freezing up to the template's rows and under "
             "CUDA graphs at M <= 16")
ACT_ORDER_SORTED_ONCE = ("act order under CUDA graphs: the weight sorted by group on the first call, the "
                         "activation gathered, the eager Triton kernel; a replay runs no Python")

# INPUTS: X, W, S, and each of SHIFTS, Z, BIAS that the call has (`template_for_inputs`). The output
# holds SPLIT_K row blocks of M rows: split pid_k stores its partial sums at rows pid_k * M + m.
# MAIN_LOOP is the decode loop's import and call (the words' or the nibble planes').
_FRAME = r"""
MAIN_LOOP_IMPORT
from qfuse.kernels.triton.weight_stream import k_range
from qfuse.kernels.triton.scaled_mm import grouped_tile
{{def_kernel(INPUTS)}}
    M = {{size("X", 0)}}
    N = {{size("S", 0)}}
    K = {{size("X", 1)}}
{{TILE_OFFSETS}}
    pid_k = tl.program_id(1)
    k_start, k_end = k_range(K, pid_k, SPLIT_K, BLOCK_K)
    acc = MAIN_LOOP_CALL
{% if HAS_BIAS %}
    acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
{% endif %}
    offs_m = offs_m + pid_k * M
{{STORE_TILE}}"""
_SOURCE = _FRAME.replace("MAIN_LOOP_IMPORT", "from qfuse.kernels.triton.int4_mm import int4_dot").replace(
    "MAIN_LOOP_CALL", r"""int4_dot(
        X, W, {{"SHIFTS" if HAS_SHIFTS else "W"}}, S, {{"Z" if HAS_ZEROS else "W"}}, offs_m, offs_n, mask_m, mask_n,
        K, k_start, k_end, {{stride("X", 0)}}, {{stride("X", 1)}}, {{stride("W", 1 if PACKED_ALONG_N else 0)}},
        {{stride("W", 0 if PACKED_ALONG_N else 1)}},
        {{stride("S", 0)}}, {{stride("S", 1)}}, {{stride("Z", 0) if HAS_ZEROS else 0}}, {{stride("Z", 1) if HAS_ZEROS else 0}},
        GROUP_SIZE, GROUPS_PER_STEP, HAS_SHIFTS, HAS_ZEROS, ZERO_ADD, ZERO_WRAP, PACKED_ALONG_N, INT8_VALUES, EVEN_K,
        BLOCK_M, BLOCK_N, BLOCK_K,
    )""")
# The nibble-plane loop (`qfuse.kernels.triton.int4_planes`): X is the activation permuted by plane.
_PLANES_SOURCE = _FRAME.replace("MAIN_LOOP_IMPORT", "from qfuse.kernels.triton.int4_planes import plane_dot").replace(
    "MAIN_LOOP_CALL", r"""plane_dot(
        X, W, {{"SHIFTS" if HAS_SHIFTS else "W"}}, S, {{"Z" if HAS_ZEROS else "W"}}, offs_m, offs_n, mask_m, mask_n,
        k_start, k_end, {{stride("X", 0)}}, {{stride("W", 0)}}, {{stride("W", 1)}}, {{stride("S", 0)}}, {{stride("S", 1)}},
        {{stride("Z", 0) if HAS_ZEROS else 0}}, {{stride("Z", 1) if HAS_ZEROS else 0}},
        GROUP_SIZE, HAS_SHIFTS, HAS_ZEROS, ZERO_ADD, ZERO_WRAP, PAIRED, BLOCK_M, BLOCK_N,
    )""")


def _is_int8_storage(call: Int4WeightOnlyMmArgs) -> bool:
    return call.packed.get_dtype() == torch.int8


def _is_decode(call: Int4WeightOnlyMmArgs, rows) -> bool:
    """The decode template's call: no act order, M <= 16 (a dynamic M guarded on it, `rows_at_most`)."""
    return call.g_idx is None and rows_at_most(rows, DECODE_ROWS)


def _template_bounds(call: Int4WeightOnlyMmArgs, k: int) -> list[int]:
    """The M buckets a template runs, by their bound: the plane template's (up to PLANE_MAX_ROWS), the words
    template's for words packed along N (AWQ) and int8 storage (intx): decode and `int4_mm.BATCHED_TILES`;
    else its decode bucket; none with act order."""
    from qfuse.kernels.triton.int4_mm import BATCHED_TILES
    from qfuse.kernels.triton.int4_planes import PLANE_TILES, takes_planes

    if call.g_idx is not None:
        return []
    if takes_planes(k, call.group_size, call.packed_along_n, _is_int8_storage(call)):
        return sorted(PLANE_TILES)
    return [DECODE_ROWS, *BATCHED_TILES] if call.packed_along_n or _is_int8_storage(call) else [DECODE_ROWS]


def why_not(call: Int4WeightOnlyMmArgs) -> str:
    """'' if the call is lowered (template, Inductor's dequantize + mm, or under CUDA graphs with act order
    the op's extern call at decode), else why it stays an extern call. M is looked at (and a dynamic M
    guarded) only for a call that can be lowered at all."""
    rows = rows_and_k(call.x)[0]
    if V.graph.sizevars.statically_known_true(sympy.Eq(rows, 0)):
        return "M is 0"
    if call.x.get_device().type != "cuda" and _is_decode(call, rows):
        return "the Triton template runs on CUDA"
    return why_not_one_element(rows, call.scales.get_size()[0])


def lower_call(call: Int4WeightOnlyMmArgs):
    x2d, lead, rows, k = as_matrix(call.x)
    # up to the rows a template takes the weight at once it is sorted (act order's g_idx gone)
    sorted_call = _act_order_on_constants(call, x2d, rows, _template_bounds(call._replace(g_idx=None), int(k))[-1])
    if sorted_call is not None:  # from here on the call is the plain form on the sorted weight, x2d gathered
        call, x2d = sorted_call, sorted_call.x
    elif (call.g_idx is not None and inductor_config.triton.cudagraphs and call.x.get_device().type == "cuda"
            and rows_at_most(rows, DECODE_ROWS)):
        return extern_call(call, ACT_ORDER_SORTED_ONCE)
    n = int(call.scales.get_size()[0])
    bounds = _template_bounds(call, int(k))
    bucket = rows_bucket(rows, bounds) if call.x.get_device().type == "cuda" else 0  # CPU: never a template
    if not bucket:
        dynamic = not sympy.sympify(rows).is_number
        why = ACT_ORDER if call.g_idx is not None else f"M above {bounds[-1]}" + (": a dynamic M, guarded" if dynamic else "")
        out = _dequantize_and_mm(call, x2d, n, int(k), why)
    else:
        out = _template(call, x2d, rows, n, int(k), bucket)
    if sorted_call is not None:
        append_to_lowering("; act order: the frozen weight sorted by group at compile time, the activation gathered")
    return lower(aten.reshape.default, convert(out, call.out_dtype), [*lead, n])


def inductors_own(call: Int4WeightOnlyMmArgs, why: str):
    """The call as Inductor's own code on any device (`lowerings.dispatch`: a dynamic M's bucket where every kernel
    is slower): w dequantized by the op's formula, then Inductor's mm; `why` goes to the record."""
    x2d, lead, _, k = as_matrix(call.x)
    n = int(call.scales.get_size()[0])
    out = _dequantize_and_mm(call, x2d, n, int(k), why)
    return lower(aten.reshape.default, convert(out, call.out_dtype), [*lead, n])


def _act_order_on_constants(call: Int4WeightOnlyMmArgs, x2d, rows, max_rows: int) -> Int4WeightOnlyMmArgs | None:
    """The call of the same linear without act order, where the call runs on CUDA under freezing with a `g_idx`, constant weight tensors and at most `max_rows` rows (a dynamic M
    guarded on it): the weight sorted by group at compile time (the kernel's own layout: words
    [N, K / 8], scales [N, K / g], zero points [N / 8, K / g]) and x2d [M, K] gathered in that order.
    None where that does not hold, or where `g_idx` sorts into no groups of the group size (the op
    then multiplies a dense weight: left to its extern call's rule)."""
    if call.g_idx is None or call.x.get_device().type != "cuda":
        return None
    values = constant_weight(call)
    if values is None or not rows_at_most(rows, max_rows):  # a dynamic M guarded only where the sort would run
        return None
    weight = prepared_now(call, values)
    if weight is None or weight.packing not in (Packing.INT4_WORDS_NK, Packing.INT4_WORDS_NK_ZEROS_MINUS_ONE):
        return None
    constant = tensor_constant
    order = constant(weight.input_order, "qfuse_int4_order")
    return call._replace(
        x=lower(aten.index.Tensor, x2d, [None, order]), packed=constant(weight.data, "qfuse_int4_words"), shifts=None,
        scales=constant(weight.scale, "qfuse_int4_scales"),
        packed_zeros=None if weight.zero_point is None else constant(weight.zero_point, "qfuse_int4_zeros"),
        g_idx=None, zero_convention="plus_one" if weight.packing == Packing.INT4_WORDS_NK_ZEROS_MINUS_ONE else "stored",
        packed_along_n=False)


def _template(call: Int4WeightOnlyMmArgs, x2d, rows, n: int, k: int, bucket: int):
    """The template for M's bucket: the plane template where it takes the call, else the words template (decode)."""
    from qfuse.kernels.triton.int4_mm import weight_meta
    from qfuse.kernels.triton.int4_planes import takes_planes

    meta = weight_meta(call.shifts is not None, call.packed_zeros is not None, call.zero_convention,
                       call.packed_along_n, _is_int8_storage(call))
    if takes_planes(k, call.group_size, call.packed_along_n, _is_int8_storage(call)):
        return _planes_template(call, x2d, rows, n, k, meta, bucket)
    return _words_template(call, x2d, rows, n, k, meta, bucket)


def _words_template(call: Int4WeightOnlyMmArgs, x2d, rows, n: int, k: int, meta: dict, bucket: int):
    """The words template for M's bucket: the decode tile, or (AWQ, intx) `int4_mm.BATCHED_TILES`' up to 128 rows."""
    from qfuse.kernels.triton.int4_mm import AUTOTUNE_TILES, BATCHED_PROGRAMS_PER_SM, BATCHED_TILES, DECODE_TILE
    from qfuse.kernels.triton.scaled_mm import multiprocessors
    from qfuse.kernels.triton.weight_stream import batched_split_k, fit_block_k, split_k, step_meta

    tile = DECODE_TILE if bucket == DECODE_ROWS else BATCHED_TILES[bucket]
    # max-autotune: the decode search's next best shapes too, at this bucket's BLOCK_M
    tiles = [tile] + ([other._replace(block_m=tile.block_m) for other in AUTOTUNE_TILES] if max_autotune() else [])
    tiles = list(dict.fromkeys(tile._replace(block_k=fit_block_k(tile.block_k, call.group_size, k)) for tile in tiles))
    sms = multiprocessors(x2d.get_device())
    if bucket == DECODE_ROWS:
        splits = split_k(DECODE_ROWS, n, k, tiles[0].block_n, tiles[0].block_k, sms)
    else:
        splits = batched_split_k(bucket, n, k, tiles[0], BATCHED_PROGRAMS_PER_SM, sms)
    named = {"X": x2d, "W": call.packed, "S": call.scales, "SHIFTS": call.shifts, "Z": call.packed_zeros,
             "BIAS": call.bias if splits == 1 else None}
    meta = dict(HAS_BIAS=splits == 1 and call.bias is not None, SPLIT_K=splits) | meta
    out, how = split_k_linear(_SOURCE, "qfuse_int4_linear", named, rows, n, splits, call.bias, tiles,
                              lambda tile: meta | step_meta(tile.block_k, call.group_size, k))
    record_lowering(how + "; the int4 words dequantized in registers")
    return out


def _planes_template(call: Int4WeightOnlyMmArgs, x2d, rows, n: int, k: int, meta: dict, bucket: int):
    """The nibble-plane template for M's bucket on the activation permuted by plane (`int4_planes.permute_planes`,
    in Inductor's code: a copy of the M x K activation, fused with what produces it where Inductor can)."""
    from qfuse.kernels.triton.int4_planes import PLANE_TILES, autotune_plane_tiles, paired, plane_splits
    from qfuse.kernels.triton.scaled_mm import multiprocessors

    tile = PLANE_TILES[bucket]
    tiles = [tile] + (autotune_plane_tiles(tile) if max_autotune() else [])
    device = x2d.get_device()
    splits = plane_splits(bucket, n, k, tile.block_m, tile.block_n, multiprocessors(device))
    named = {"X": _permuted_by_plane(call.x, x2d, rows, k), "W": call.packed, "S": call.scales, "SHIFTS": call.shifts, "Z": call.packed_zeros,
             "BIAS": call.bias if splits == 1 else None}
    is_paired = paired(x2d.get_dtype(), call.scales.get_dtype(), device)
    meta = dict(HAS_BIAS=splits == 1 and call.bias is not None, SPLIT_K=splits, GROUP_SIZE=call.group_size,
                PAIRED=is_paired) | {key: meta[key] for key in ("HAS_SHIFTS", "HAS_ZEROS", "ZERO_ADD", "ZERO_WRAP")}
    out, how = split_k_linear(_PLANES_SOURCE, "qfuse_int4_planes", named, rows, n, splits, call.bias, tiles,
                              lambda tile: meta)
    record_lowering(how + "; the int4 words dequantized in registers by nibble plane"
                    + (", two values a register" if is_paired else "") + f"; its tile {PLANE_TILES.measured_here()}")
    return out


def _permuted_by_plane(x, x2d, rows, k: int):
    """x2d permuted by plane (`int4_planes.permute_planes`) in Inductor IR, made once per activation of
    the graph: the linears that read one activation (q / k / v, gate / up) share the copy."""
    from qfuse.kernels.triton.int4_planes import PLANE_STEP

    made = V.graph.__dict__.setdefault("_qfuse_activations_by_plane", {})
    if id(x) not in made:
        by_plane = lower(aten.permute.default,
                         lower(aten.reshape.default, x2d, [rows, k // PLANE_STEP, PLANE_STEP // 8, 8]), [0, 1, 3, 2])
        copy = lower(aten.clone.default, by_plane, memory_format=torch.contiguous_format)
        made[id(x)] = (x, lower(aten.reshape.default, copy, [rows, k]))  # x kept: its id stays its own
    return made[id(x)][1]


def _dequantize_and_mm(call: Int4WeightOnlyMmArgs, x2d, n: int, k: int, why: str):
    """x @ w^T (+ bias) with w dequantized by the op's formula, w = (q - z) * s rounded once to x's dtype (the
    product is exact in float32), then Inductor's own mm / addmm; the record says how, and `why`. On CUDA without
    act order w is the template's (`qfuse.lowerings.triton.dequantize`); else Inductor IR, grouped as
    [N, K / g, g] values against [N, K / g, 1] scales, or with a `g_idx` as [N, K, 1] against the scales and zero
    points gathered per column."""
    device = x2d.get_device()
    if call.g_idx is None and device.type == "cuda":  # (Triton imported only here: the CPU may have none)
        from qfuse.kernels.triton.int4_mm import weight_meta
        from qfuse.lowerings.triton.dequantize import dequantized_weight

        meta = weight_meta(call.shifts is not None, call.packed_zeros is not None, call.zero_convention,
                           call.packed_along_n, _is_int8_storage(call))
        w, how = dequantized_weight({"W": call.packed, "S": call.scales, "SHIFTS": call.shifts, "Z": call.packed_zeros},
                                    n, k, call.group_size, x2d.get_dtype(), meta)
    else:
        w, how = _dequantized_in_ir(call, n, k, x2d.get_dtype(), device), "Inductor's own dequantize + mm"
    record_lowering(f"{how} ({why}); the bias in the GEMM, the cast and what follows in its fused pointwise code")
    w_t = lower(aten.permute.default, w, [1, 0])
    if call.bias is None:
        return lower(aten.mm.default, x2d, w_t)
    return lower(aten.addmm.default, convert(call.bias, x2d.get_dtype()), x2d, w_t)


def _dequantized_in_ir(call: Int4WeightOnlyMmArgs, n: int, k: int, dtype: torch.dtype, device):
    """w [N, K] in `dtype`, in Inductor IR: q - z grouped as the scales ([N, K / g, g], or [N, K, 1] with a
    `g_idx`), times the scales in float32, rounded once."""
    groups = k // call.group_size
    shifts = call.shifts if call.shifts is not None else lower(
        prims.iota.default, 8, start=0, step=4, dtype=torch.int32, device=device, requires_grad=False)

    def shifted(words, axis_shifts):
        return lower(aten.bitwise_right_shift.Tensor, words, axis_shifts)

    def per_column(group_values):  # [N, K / g] -> a factor of the values, [N, K / g, 1] or [N, K, 1]
        if call.g_idx is not None:
            group_values = lower(aten.index.Tensor, group_values, [None, convert(call.g_idx, torch.int64)])
        return lower(aten.unsqueeze.default, group_values, -1)

    if _is_int8_storage(call):  # signed values, zero points as they are stored (or none)
        q = lower(aten.reshape.default, call.packed, [n, groups, call.group_size] if call.g_idx is None else [n, k, 1])
        if call.packed_zeros is not None:
            q = lower(aten.sub.Tensor, convert(q, torch.int32), per_column(convert(call.packed_zeros, torch.int32)))
        return _scaled(call, q, per_column, n, k, dtype)
    q = lower(aten.bitwise_and.Scalar, shifted(lower(aten.unsqueeze.default, call.packed, -1), shifts), 0xF)
    if call.packed_along_n:  # [K, N / 8, 8] -> [N, K]
        q = lower(aten.permute.default, lower(aten.reshape.default, q, [k, n]), [1, 0])
    q = lower(aten.reshape.default, q, [n, groups, call.group_size] if call.g_idx is None else [n, k, 1])
    if call.packed_zeros is None:
        q = lower(aten.sub.Tensor, q, INT4_OFFSET)
    else:
        words = shifted(lower(aten.unsqueeze.default, call.packed_zeros, 1), lower(aten.unsqueeze.default, shifts, -1))
        zeros = apply_zero_convention(words, call.zero_convention, IR_OPS)
        q = lower(aten.sub.Tensor, q, per_column(lower(aten.reshape.default, zeros, [n, groups])))  # [N / 8, 8, K / g]
    return _scaled(call, q, per_column, n, k, dtype)


def _scaled(call: Int4WeightOnlyMmArgs, q, per_column, n: int, k: int, dtype: torch.dtype):
    """w [N, K] = q * s in `dtype`, q the integer (values - zero points) grouped as the scales."""
    w = convert(lower(aten.mul.Tensor, convert(q, torch.float32), per_column(convert(call.scales, torch.float32))), dtype)
    return lower(aten.reshape.default, w, [n, k])
