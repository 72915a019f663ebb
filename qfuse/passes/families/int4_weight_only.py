"""int4_weight_only: a float linear whose weight is unpacked from int4 in the graph -> qfuse::int4_weight_only_mm.

The forms (GPTQ in [N, K] orientation, the classic AutoGPTQ [K, N] one, compressed-tensors
"pack-quantized"; what their model code and unpack helpers trace to), walked up from the matmul's
weight operand:

    q     = (P.unsqueeze(-1) >> S) & 0xF             P int32 [N, K / 8], S int32 [8]; `__rshift__` or
                                                     `bitwise_right_shift`, an integer cast before the
                                                     mask; views of q to [N, K / g, g]
          = (P.unsqueeze(1) >> S[:, None]) & 0xF     K-major (AutoGPTQ): P [K / 8, N], q [K, N]
          = ((P.unsqueeze(-1) >> S) viewed [K, N])[:, order] & 0xF
                                                     AWQ: P [K, N / 8] packed along N; its channel order
                                                     `arange(N).view(-1, 8)[:, C].view(-1)` of a constant
                                                     C becomes the op's shifts S[C] (a compile-time
                                                     constant), or is folded into stored shifts
    z     = 8                                        symmetric (uint4 with offset 8), or
          = ((Z.unsqueeze(1) >> S[:, None]) & 0xF)   Z int32 [N / 8, K / g] (K-major: [K / g, N / 8]),
                                                     plus one after the mask or before it (old GPTQ
                                                     checkpoints store zero points minus one)
    w     = (q - z) * s                              s the scales [N, K / g] in the activation's dtype:
                                                     `.unsqueeze(-1)` against [N, K / g, g], per channel
                                                     [N, 1], `repeat_interleave(g, 1)`, or gathered by
                                                     GPTQ's act order `g_idx` (`s[:, g_idx]`; K-major
                                                     `s[g_idx]`), z expanded the same way
    out   = mm(x2d, w.t()) or addmm(bias, x2d, w.t()); K-major (AutoGPTQ, AWQ) mm(x2d, w)

The fused op takes P, S, the scales, Z and g_idx themselves (its kernel unpacks and repacks them
once per weight, so they must be stored tensors, not computed per call; S = `torch.arange(0, 32, 4)`
made in the forward is the op's default), the transposes of K-major ones (views), `group_size` g
and the zero convention; it computes the formula above for whatever S and g_idx hold, so nothing
about their values needs proving here, only the structure and the shapes. compressed-tensors'
`unpack_from_int32` spells q differently: the words viewed as bytes, `byte & 0xF` and `byte >> 4`
stacked and viewed as int8, minus 8 (then q - z is (q - 8) - (z - 8), its zero points unpacked from
the transposed words the same way); that is nibble i at bits 4i, the op's `shifts` None.

Near misses, named in debug mode: a channel order over N that is no constant permutation within
words, scales in another dtype than the activation, scales or zero points expanded in a way the
shapes do not prove, a weight with another user, stored tensors computed per call.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Graph, Node

from qfuse.passes.core.fused_linear import FusedLinear, Int4Weight, NotFusable, PassContext, fuse_anchored_linears
from qfuse.passes.core.graph_utils import (CONVERT_OPS, VIEW_OPS, PendingCall, PendingConstant, aten, dtype_of, fake_value,
                                     is_call, is_subtraction, prims, shape_of, static_int)
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, INT4_DTYPE, INT4_OFFSET, Granularity, QuantScheme

FAMILY = "int4_weight_only"
FOUND = "an int4 weight unpacked by shift and mask found, but"
ANCHORS = (aten.mm.default, aten.addmm.default)
NIBBLE_MASK = 0xF
_RIGHT_SHIFTS = (aten.__rshift__.Tensor, aten.bitwise_right_shift.Tensor)
NIBBLE_AXIS = {False: -1, True: 1}  # where the 8 nibbles of a weight word go: [N, K / 8, 8], K-major [K / 8, 8, N]
ZERO_NIBBLE_AXIS = {False: 1, True: -1}  # of a zero-point word: [N / 8, 8, K / g], K-major [K / g, N / 8, 8]



def _unsqueezed(node, *dims: int):
    """The tensor under `node` = unsqueeze(tensor, dim) for one of `dims`, else None."""
    return node.args[0] if is_call(node, aten.unsqueeze.default) and node.args[1] in dims else None


def _under_views(node):
    """`node` under any views, reshapes, unsqueezes, clones and float casts (they keep the values'
    row-major order; a clone only changes the layout, which a reshape does not read)."""
    while is_call(node, *VIEW_OPS, *CONVERT_OPS, aten.unsqueeze.default, aten.clone.default):
        node = node.args[0]
    return node


def _under_expand(node):
    """`node` under expands (a broadcast written out: `qweight.unsqueeze(1).expand(-1, 8, -1)`)."""
    while is_call(node, aten.expand.default):
        node = node.args[0]
    return node


def _split_shift(shifted, axis: int) -> tuple[Node, Node] | None:
    """(P, S) when `shifted` is `P.unsqueeze(axis) >> S` with the 8 shifts of S along `axis` (S
    stored as [8], or viewed so, as AutoGPTQ's `wf` [1, 8]; both operands possibly expanded)."""
    if not is_call(shifted, *_RIGHT_SHIFTS) or shape_of(shifted) is None:
        return None
    rank = len(shape_of(shifted))
    words, shift_operand = (_under_expand(arg) for arg in shifted.args[:2])
    if not (is_call(words, aten.unsqueeze.default) and words.args[1] % rank == axis % rank):
        return None
    shift_shape = tuple(shape_of(shift_operand) or ())
    if (1,) * (rank - len(shift_shape)) + shift_shape != tuple(8 if dim == axis % rank else 1 for dim in range(rank)):
        return None
    shifts = shift_operand
    while is_call(shifts, aten.unsqueeze.default, aten.expand.default, *VIEW_OPS):
        shifts = shifts.args[0]
    return words.args[0], shifts


class Nibbles(NamedTuple):
    """Unsigned 4-bit values unpacked from stored int32 words: q = (words >> shifts) & 0xF."""

    words: Node
    shifts: Node | None  # None: nibble i at bits 4i (compressed-tensors' byte split)
    along_n: bool = False  # words [K, N / 8] (AWQ), else packed along K
    channel_order: Node | None = None  # the constant C of an AWQ channel order gather (`_channel_order`)


def _masked_nibbles(node, axis: int, along_n: bool = False) -> Nibbles | None:
    """`(P.unsqueeze(axis) >> S) & 0xF` (`node` is the mask), possibly with AWQ's channel order
    gathered between the shift and the mask (`values[:, order]` of the [K, N] values)."""
    inner, channel_order = _under_views(node.args[0]), None  # an integer cast before the mask keeps the low bits
    if is_call(inner, aten.index.Tensor) and len(inner.args[1]) == 2 and inner.args[1][0] is None:
        channel_order = _channel_order(inner.args[1][1], shape_of(inner))
        if channel_order is None:
            return None
        inner = _under_views(inner.args[0])
    found = _split_shift(inner, axis)
    if found is None:
        return None
    return Nibbles(*found, along_n=along_n, channel_order=channel_order)


def _channel_order(order, values_shape) -> Node | None:
    """C when `order` is `arange(N).view(-1, 8)[:, C].view(-1)`: channel n reads channel 8 (n // 8) +
    C[n % 8] of its word (AWQ's `reverse_awq_order`), C an int [8] constant of the graph (a Python
    list in the forward); else None."""
    if len(values_shape or ()) != 2:
        return None
    n = static_int(values_shape[1])
    gathered = _under_views(order)
    if not (is_call(gathered, aten.index.Tensor) and len(gathered.args[1]) == 2 and gathered.args[1][0] is None
            and n is not None and n % 8 == 0 and shape_of(gathered) == (n // 8, 8)):
        return None
    base, constant = _under_views(gathered.args[0]), gathered.args[1][1]
    if not (is_call(base, prims.iota.default) and base.args[0] == n and base.kwargs.get("start") == 0
            and base.kwargs.get("step") == 1 and shape_of(gathered.args[0]) == (n // 8, 8)):
        return None
    while is_call(constant, aten.lift_fresh_copy.default, aten.clone.default):
        constant = constant.args[0]
    value = _constant_value(constant)
    if value is None or tuple(value.shape) != (8,) or sorted(value.tolist()) != list(range(8)):
        return None
    return constant


def _constant_value(node) -> torch.Tensor | None:
    """The tensor of a graph constant (a get_attr that is no parameter: `_tensor_constant*`)."""
    if not (isinstance(node, Node) and node.op == "get_attr"):
        return None
    value = getattr(node.graph.owning_module, node.target, None)
    return value if isinstance(value, torch.Tensor) and not value.is_floating_point() else None


def _nibbles(node, k_major: bool) -> Nibbles | None:
    """The words and shifts when `node` is, under views, the unsigned 4-bit values of int32 `words` in
    row-major order: `(words.unsqueeze(-1) >> shifts) & 0xF` (GPTQ [N, K / 8]; K-major, AutoGPTQ's
    [K / 8, N]: `(words.unsqueeze(1) >> shifts[:, None]) & 0xF`, or AWQ's [K, N / 8] packed along N,
    its channel order gathered or folded into the shifts), or the bytes of `words` split into their
    low and high nibbles (compressed-tensors' `unpack_from_int32`; shifts None: nibble i at bits 4i,
    the little-endian byte order)."""
    node = _under_views(node)
    if is_call(node, aten.bitwise_and.Scalar) and node.args[1] == NIBBLE_MASK:
        along_k = _masked_nibbles(node, NIBBLE_AXIS[k_major])
        return along_k if along_k is not None or not k_major else _masked_nibbles(node, -1, along_n=True)
    if not k_major and is_call(node, aten.view.dtype) and node.args[1] == torch.int8 and is_call(node.args[0], aten.cat.default):
        halves, dim = node.args[0].args[0], node.args[0].args[1] if len(node.args[0].args) > 1 else 0
        if len(halves) != 2 or dim not in (-1, 2):
            return None
        low, high = (_unsqueezed(half, 2) for half in halves)
        if not (is_call(low, aten.bitwise_and.Scalar) and low.args[1] == NIBBLE_MASK
                and is_call(high, aten.__rshift__.Scalar) and high.args[1] == 4 and low.args[0] is high.args[0]):
            return None
        as_bytes = low.args[0]
        if is_call(as_bytes, aten.view.dtype) and as_bytes.args[1] == torch.uint8 and dtype_of(as_bytes.args[0]) == torch.int32:
            return Nibbles(as_bytes.args[0], None)
    return None


def _minus_offset(node, k_major: bool) -> Nibbles | None:
    """The words and shifts when `node` is, under views, `nibbles - 8` (the signed values)."""
    node = _under_views(node)
    if is_subtraction(node) and node.args[1] == INT4_OFFSET:
        return _nibbles(node.args[0], k_major)
    return None


def _gptq_zero_words(node, k_major: bool, nibbles_shapes: tuple) -> tuple[Nibbles, str] | None:
    """(Z's nibbles, the op's zero convention) when `node` is, under views, the unpacked zero
    points `(Z.unsqueeze(1) >> shifts[:, None]) & 0xF` of one of `nibbles_shapes` ([N / 8, 8, K / g];
    K-major: `(Z.unsqueeze(-1) >> shifts) & 0xF`, [K / g, N / 8, 8] or [K / g, N] with AWQ's channel
    order), plus one after the mask ("plus_one") or before it ("plus_one_mod_16", AutoGPTQ's)."""
    node, convention = _under_views(node), "stored"
    if is_call(node, aten.add.Tensor) and node.args[1] == 1:
        node, convention = _under_views(node.args[0]), "plus_one"
    if not (is_call(node, aten.bitwise_and.Scalar) and node.args[1] == NIBBLE_MASK and shape_of(node) in nibbles_shapes):
        return None
    shifted = _under_views(node.args[0])
    if is_call(shifted, aten.add.Tensor) and shifted.args[1] == 1 and convention == "stored":
        shifted, convention = _under_views(shifted.args[0]), "plus_one_mod_16"
        found = _split_shift(shifted, ZERO_NIBBLE_AXIS[k_major])
        found = None if found is None else Nibbles(*found)
    else:
        found = _masked_nibbles(node, ZERO_NIBBLE_AXIS[k_major])
    return None if found is None else (found, convention)


def _group_source(node, k_major: bool) -> tuple[Node, Node | None, str]:
    """(the per-group tensor under `node`, the g_idx it is gathered by or None, how it is expanded):
    "gather" `S[:, g_idx]` (K-major `S[g_idx]`), "repeat" `S.repeat_interleave(g, 1)` (an unsqueeze
    after the group axis, expanded, reshaped; K-major along 0), or "view" (`S.unsqueeze(-1)` or S
    itself: the shapes decide)."""
    node = _under_views(node)
    if is_call(node, aten.index.Tensor):
        indices = list(node.args[1])
        if indices[:-1] == ([] if k_major else [None]) and isinstance(indices[-1], Node):
            return node.args[0], _under_views(indices[-1]), "gather"
    if is_call(node, aten.expand.default):
        group_axis = 0 if k_major else 1
        if _unsqueezed(node.args[0], group_axis + 1, group_axis - 2) is not None:
            return _under_views(node.args[0].args[0]), None, "repeat"
    return node, None, "view"


def _compressed_tensors_zero_words(node, n: int, groups: int) -> Node | None:
    """Z when `node` is, under views, `(nibbles of Z.t() viewed [K / g, N]) - 8`, transposed back
    (compressed-tensors' zero points, packed along N)."""
    node = _under_views(node)
    if not (is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0]):
        return None
    signed = node.args[0]
    unpacked = _minus_offset(signed, k_major=False)
    if unpacked is None or unpacked.shifts is not None or tuple(shape_of(signed)) != (groups, n):
        return None
    transposed = unpacked.words
    while is_call(transposed, aten.clone.default):
        transposed = transposed.args[0]
    if not (is_call(transposed, aten.permute.default) and list(transposed.args[1]) == [1, 0]):
        return None
    return transposed.args[0]


def _is_standard_arange(node) -> bool:
    """`torch.arange(0, 32, 4)` (an iota of 8 from 0 by 4 in the post-grad graph): nibble i at bits 4i,
    what the op assumes when it gets no shifts."""
    if is_call(node, prims.iota.default):
        return node.args[0] == 8 and node.kwargs.get("start") == 0 and node.kwargs.get("step") == 4
    if is_call(node, aten.arange.start_step):
        return tuple(node.args[:3]) == (0, 32, 4)
    return False


def _weight_operand(anchor: Node) -> tuple[Node, Node | None, Node | None, bool]:
    """(x2d, the float weight or None, bias or None, whether it is K-major) of an mm / addmm: of x2d
    and w.t() for an [N, K] weight w, or of x2d and a [K, N] weight itself (AutoGPTQ's orientation)."""
    if anchor.target == aten.addmm.default:
        bias, x2d, weight_t = anchor.args[:3]
    else:
        (x2d, weight_t), bias = anchor.args[:2], None
    if not _finds_int4_unpack(weight_t):
        return x2d, None, bias, False
    if anchor.kwargs.get("beta", 1) != 1 or anchor.kwargs.get("alpha", 1) != 1:
        raise NotFusable(f"{FOUND} the addmm scales its terms (alpha or beta)")
    if is_call(weight_t, aten.permute.default) and list(weight_t.args[1]) == [1, 0]:
        return x2d, weight_t.args[0], bias, False
    return x2d, weight_t, bias, True


def _finds_int4_unpack(node, depth: int = 12) -> bool:
    """Whether `node` or one of its inputs up to `depth` nodes up is a nibble mask (`& 0xF`)."""
    frontier, seen = {node} if isinstance(node, Node) else set(), set()
    for _ in range(depth):
        if any(is_call(item, aten.bitwise_and.Scalar) and item.args[1] == NIBBLE_MASK for item in frontier):
            return True
        seen |= frontier
        frontier = {arg for item in frontier for arg in item.all_input_nodes} - seen
    return False


def analyze(anchor: Node) -> FusedLinear | None:
    """The int4 weight-only linear at `anchor`, None if its weight is no int4 unpack, NotFusable if nearly."""
    x2d, weight, bias, k_major = _weight_operand(anchor)
    if weight is None:
        return None
    product = _under_views(weight)
    if not is_call(product, aten.mul.Tensor):
        raise NotFusable(f"{FOUND} it is not dequantized by one multiplication with its scales")
    values, scale_factor = product.args[:2]
    if not _finds_int4_unpack(values):
        values, scale_factor = scale_factor, values
    return _linear(anchor, x2d, bias, values, scale_factor, weight, k_major)


def _grouped_shapes(expansion: str, k_major: bool, n: int, k: int, groups: int) -> set[tuple[tuple, tuple]]:
    """The (values' shape, scale factor's shape) pairs a dequantize grouped by `expansion` multiplies."""
    if expansion != "view":  # one scale per value
        return {((k, n), (k, n)) if k_major else ((n, k), (n, k))}
    group_size = k // groups
    grouped = ((groups, group_size, n), (groups, 1, n)) if k_major else ((n, groups, group_size), (n, groups, 1))
    per_channel = ((k, n), (1, n)) if k_major else ((n, k), (n, 1))
    return {grouped, per_channel} if groups == 1 else {grouped}


def _same_nibble_order(first: Nibbles, second: Nibbles) -> bool:
    """Whether two unpacks read the nibbles of a word in the same order: the same shifts (one stored
    tensor, or both 0, 4, ..., 28 made in the forward) and the same channel order (or none)."""
    same_shifts = first.shifts is second.shifts or (_is_standard_arange(first.shifts)
                                                    and _is_standard_arange(second.shifts))
    orders = (first.channel_order, second.channel_order)
    if orders[0] is orders[1] or None in orders:
        return same_shifts and orders[0] is orders[1]
    with unset_fake_temporarily():  # real constants, also inside a fake mode (freezing's joint stage)
        same_order = torch.equal(*(_constant_value(order) for order in orders))
    return same_shifts and same_order


def _values_and_zeros(values, k_major: bool, expansion: str, g_idx, n: int, groups: int):
    """(the values' Nibbles, zero words or None, zero convention) of the values operand `(q - z)`."""
    signed = _minus_offset(values, k_major)
    if signed is not None:  # q - 8, symmetric (either unpack)
        return signed, None, "stored"
    difference = _under_views(values)
    if is_subtraction(difference):
        minuend, subtrahend = difference.args[:2]
        unsigned, signed = _nibbles(minuend, k_major), _minus_offset(minuend, k_major)
        if unsigned is not None and unsigned.shifts is not None:  # GPTQ / AWQ: q - z, both unsigned
            source, zero_g_idx, zero_expansion = _group_source(subtrahend, k_major)
            shapes = ((groups, n // 8, 8), (groups, n)) if k_major else ((n // 8, 8, groups),)
            zeros = _gptq_zero_words(source, k_major, shapes)
            if (zero_expansion, zero_g_idx) == (expansion, g_idx) and zeros is not None and _same_nibble_order(
                    zeros[0], unsigned):
                return unsigned, zeros[0].words, zeros[1]
        if signed is not None and signed.shifts is None and expansion == "view":  # compressed-tensors: (q - 8) - (z - 8)
            zeros = _compressed_tensors_zero_words(subtrahend, n, groups)
            if zeros is not None:
                return signed, zeros, "stored"
    if k_major and _nibbles(difference.args[0] if is_subtraction(difference) else difference, k_major) is None:
        raise NotFusable(f"{FOUND} the [K, N] weight's values are not unpacked by shift and mask from int32 words "
                         "[K / 8, N] or [K, N / 8] (a channel order gathered over N must be "
                         "`arange(N).view(-1, 8)[:, C].view(-1)` of a constant C, as AWQ's reverse order)")
    raise NotFusable(f"{FOUND} its zero point is neither the uint4 offset 8 nor int32 [N / 8, K / g] zero points "
                     "unpacked the same way (plus one before or after the mask included), grouped as its scales")


def _shifts_in_channel_order(shifts, channel_order: Node, words: Node) -> PendingConstant:
    """The shifts that read AWQ's gathered channel order straight from the words: channel 8 j + i
    is nibble C[i] of word j, at bits shifts[C[i]] (C the graph's constant, S 0, 4, ..., 28), on the
    words' device (the Python list of the order is a CPU constant even in a CUDA model)."""
    if not _is_standard_arange(shifts):
        raise NotFusable(f"{FOUND} its channel order is gathered over stored shifts (only 0, 4, ..., 28 are "
                         "folded into the op's shifts)")
    with unset_fake_temporarily():  # real arithmetic on a real constant, also inside a fake mode (freezing's joint stage)
        order = _constant_value(channel_order).to(device=fake_value(words).device, dtype=torch.int32)
        return PendingConstant(order * 4, channel_order.graph, "awq_shifts")


def _transposed(node, k_major: bool):
    """The op's [N, ...] operand of a stored K-major tensor: its transpose (a view)."""
    return PendingCall(aten.permute.default, (node, [1, 0])) if k_major and node is not None else node


def _linear(anchor, x2d, bias, values, scale_factor, weight, k_major: bool) -> FusedLinear:
    x_dtype = dtype_of(x2d)
    rows, cols = (static_int(size) for size in shape_of(weight))
    n, k = (cols, rows) if k_major else (rows, cols)
    scales, g_idx, expansion = _group_source(scale_factor, k_major)
    scales_shape = tuple(shape_of(scales) or ())
    groups = static_int(scales_shape[0 if k_major else -1]) if len(scales_shape) == 2 else None
    if None in (n, k, groups) or scales_shape != ((groups, n) if k_major else (n, groups)) or k % groups:
        layout = "[K / g, N] of the [K, N]" if k_major else "[N, K / g] of the [N, K]"
        raise NotFusable(f"{FOUND} its scales {list(scales_shape)} are not {layout} weight [{rows}, {cols}]")
    if (tuple(shape_of(values)), tuple(shape_of(scale_factor))) not in _grouped_shapes(expansion, k_major, n, k, groups):
        raise NotFusable(f"{FOUND} it is not grouped as [N, K / g, g] values times [N, K / g, 1] scales, per "
                         "channel, by a g_idx gather or a repeat_interleave of the scales")
    nibbles, packed_zeros, zero_convention = _values_and_zeros(values, k_major, expansion, g_idx, n, groups)
    packed, shifts = nibbles.words, nibbles.shifts
    group_size = k // groups
    packed_shape = (k, n // 8) if nibbles.along_n else (k // 8, n) if k_major else (n, k // 8)
    if dtype_of(packed) != torch.int32 or tuple(shape_of(packed)) != packed_shape:
        raise NotFusable(f"{FOUND} the packed weight is {dtype_of(packed)} {list(shape_of(packed))}, not int32 "
                         f"{list(packed_shape)}")
    if shifts is not None and not _is_standard_arange(shifts) and (dtype_of(shifts) != torch.int32
                                                                    or math.prod(shape_of(shifts)) != 8):
        raise NotFusable(f"{FOUND} the shifts are not an int32 [8] tensor")
    if g_idx is not None and (dtype_of(g_idx) not in (torch.int32, torch.int64) or tuple(shape_of(g_idx)) != (k,)):
        raise NotFusable(f"{FOUND} its g_idx is {dtype_of(g_idx)} {list(shape_of(g_idx))}, not an integer [{k}] vector")
    stored_tensors = (("packed weight", packed), ("shifts", None if _is_standard_arange(shifts) else shifts),
                      ("scales", scales), ("zero points", packed_zeros), ("g_idx", g_idx))
    for name, stored in stored_tensors:
        if stored is not None and stored.op not in ("placeholder", "get_attr"):
            raise NotFusable(f"{FOUND} its {name} are computed on every call ({stored.name}); the fused op prepares "
                             "the stored int4 weight once")
    zeros_shape = (groups, n // 8) if k_major else (n // 8, groups)
    if packed_zeros is not None and (dtype_of(packed_zeros) != torch.int32 or tuple(shape_of(packed_zeros)) != zeros_shape):
        raise NotFusable(f"{FOUND} its zero points are {list(shape_of(packed_zeros))}, not int32 {list(zeros_shape)}")
    if dtype_of(scales) != x_dtype or x_dtype not in FLOAT_ACTIVATION_DTYPES:
        raise NotFusable(f"{FOUND} its scales are {dtype_of(scales)} and the activation {x_dtype}; the fused op "
                         "takes scales in the activation's dtype")
    if bias is not None and (tuple(shape_of(bias)) != (n,) or dtype_of(bias) != x_dtype):
        raise NotFusable(f"{FOUND} the bias is {dtype_of(bias)} {list(shape_of(bias))}, not [{n}] in the activation's dtype")
    if len(weight.users) > 1:
        raise NotFusable(f"{FOUND} the dequantized weight has {len(weight.users)} users")
    if nibbles.channel_order is not None:
        shifts = _shifts_in_channel_order(shifts, nibbles.channel_order, packed)
    elif _is_standard_arange(shifts):
        shifts = None
    elif shifts is not None and tuple(shape_of(shifts)) != (8,):
        shifts = PendingCall(aten.reshape.default, (shifts, [8]))
    scheme = QuantScheme.weight_only(INT4_DTYPE, Granularity.PER_GROUP, x_dtype, weight_group_size=group_size)
    int4 = Int4Weight(_transposed(packed, k_major and not nibbles.along_n), shifts, _transposed(scales, k_major),
                      _transposed(packed_zeros, k_major), group_size, g_idx, zero_convention, nibbles.along_n)
    return FusedLinear(
        anchor=anchor, family=FAMILY, pattern="int4 unpack + dequantize + float linear", a=x2d, b=packed,
        scheme=scheme, out_dtype=dtype_of(anchor), replaces=anchor, bias=bias, int4=int4,
    )


def run(graph: Graph, context: PassContext) -> None:
    fuse_anchored_linears(graph, context, FAMILY, ANCHORS, analyze)
