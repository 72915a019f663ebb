"""int4_weight_only: a float linear whose weight is unpacked from int4 in the graph -> qfuse::int4_weight_only_mm.

The form (GPTQ in [N, K] orientation, compressed-tensors "pack-quantized"; what their model code and
unpack helpers trace to), walked up from the matmul's weight operand:

    q     = (P.unsqueeze(-1) >> S) & 0xF             P int32 [N, K / 8], S int32 [8]; `__rshift__` or
                                                     `bitwise_right_shift`; views of q to [N, K / g, g]
    z     = 8                                        symmetric (uint4 with offset 8), or
          = ((Z.unsqueeze(1) >> S.unsqueeze(1)) & 0xF) viewed [N, K / g, 1]   Z int32 [N / 8, K / g]
    w     = ((q - z) * scales.unsqueeze(-1))         scales [N, K / g] in the activation's dtype,
            viewed [N, K] (optionally cast to that same dtype); per channel (g = K): [N, K] * [N, 1]
    out   = mm(x2d, w.t()) or addmm(bias, x2d, w.t())

The fused op takes P, S, the scales and Z themselves (its kernel unpacks and repacks them once per
weight, so they must be stored tensors, not computed per call; S = `torch.arange(0, 32, 4)` made in
the forward is the op's default) and `group_size` g; it computes the formula above for whatever S holds, so nothing about
the values of S or the nibble order needs proving here, only the structure. compressed-tensors'
`unpack_from_int32` spells q differently: the words viewed as bytes, `byte & 0xF` and `byte >> 4`
stacked and viewed as int8, minus 8 (then q - z is (q - 8) - (z - 8), its zero points unpacked from
the transposed words the same way); that is nibble i at bits 4i, the op's `shifts` None.

Near misses, named in debug mode: int4 forms this family does not take yet (a `g_idx` gather, the
AutoGPTQ [K / 8, N] layout, AWQ's order, scales expanded by `repeat_interleave`, zero points stored
minus one), scales in another dtype than the activation, a weight with another user.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from qfuse.passes.fused_linear import FusedLinear, Int4Weight, NotFusable, PassContext, fuse_anchored_linears
from qfuse.passes.graph_utils import CONVERT_OPS, VIEW_OPS, aten, dtype_of, prims, shape_of, static_int
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, INT4_DTYPE, INT4_OFFSET, Granularity, QuantScheme

FAMILY = "int4_weight_only"
ANCHORS = (aten.mm.default, aten.addmm.default)
NIBBLE_MASK = 0xF
_RIGHT_SHIFTS = (aten.__rshift__.Tensor, aten.bitwise_right_shift.Tensor)


def _is(node, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _unsqueezed(node, *dims: int):
    """The tensor under `node` = unsqueeze(tensor, dim) for one of `dims`, else None."""
    return node.args[0] if _is(node, aten.unsqueeze.default) and node.args[1] in dims else None


def _under_views(node):
    """`node` under any views, reshapes, unsqueezes, clones and float casts (they keep the values'
    row-major order; a clone only changes the layout, which a reshape does not read)."""
    while _is(node, *VIEW_OPS, *CONVERT_OPS, aten.unsqueeze.default, aten.clone.default):
        node = node.args[0]
    return node


def _nibbles(node) -> tuple[Node, Node | None] | None:
    """(words, shifts) when `node` is, under views, the unsigned 4-bit values of int32 `words` in
    row-major order: `(words.unsqueeze(-1) >> shifts) & 0xF` (GPTQ; shifts a tensor), or the bytes of
    `words` split into their low and high nibbles (compressed-tensors' `unpack_from_int32`; shifts None:
    nibble i at bits 4i, the little-endian byte order)."""
    node = _under_views(node)
    if _is(node, aten.bitwise_and.Scalar) and node.args[1] == NIBBLE_MASK and _is(node.args[0], *_RIGHT_SHIFTS):
        words, shifts = node.args[0].args[:2]
        words = _unsqueezed(words, -1, 2)
        return (words, shifts) if words is not None else None
    if _is(node, aten.view.dtype) and node.args[1] == torch.int8 and _is(node.args[0], aten.cat.default):
        halves, dim = node.args[0].args[0], node.args[0].args[1] if len(node.args[0].args) > 1 else 0
        if len(halves) != 2 or dim not in (-1, 2):
            return None
        low, high = (_unsqueezed(half, 2) for half in halves)
        if not (_is(low, aten.bitwise_and.Scalar) and low.args[1] == NIBBLE_MASK
                and _is(high, aten.__rshift__.Scalar) and high.args[1] == 4 and low.args[0] is high.args[0]):
            return None
        as_bytes = low.args[0]
        if _is(as_bytes, aten.view.dtype) and as_bytes.args[1] == torch.uint8 and dtype_of(as_bytes.args[0]) == torch.int32:
            return as_bytes.args[0], None
    return None


def _minus_offset(node) -> tuple[Node, Node | None] | None:
    """(words, shifts) when `node` is, under views, `nibbles - 8` (the signed values)."""
    node = _under_views(node)
    if _is(node, aten.sub.Tensor) and node.args[1] == INT4_OFFSET:
        return _nibbles(node.args[0])
    return None


def _gptq_zero_words(node, shifts: Node) -> Node | None:
    """Z when `node` is, under views, `(Z.unsqueeze(1) >> shifts.unsqueeze(1)) & 0xF`."""
    node = _under_views(node)
    if not (_is(node, aten.bitwise_and.Scalar) and node.args[1] == NIBBLE_MASK and _is(node.args[0], *_RIGHT_SHIFTS)):
        return None
    words, shift_column = node.args[0].args[:2]
    if _unsqueezed(shift_column, 1, -1) is not shifts:
        return None
    return _unsqueezed(words, 1)


def _compressed_tensors_zero_words(node, n: int, groups: int) -> Node | None:
    """Z when `node` is, under views, `(nibbles of Z.t() viewed [K / g, N]) - 8`, transposed back
    (compressed-tensors' zero points, packed along N)."""
    node = _under_views(node)
    if not (_is(node, aten.permute.default) and list(node.args[1]) == [1, 0]):
        return None
    signed = node.args[0]
    unpacked = _minus_offset(signed)
    if unpacked is None or unpacked[1] is not None or tuple(shape_of(signed)) != (groups, n):
        return None
    transposed = unpacked[0]
    while _is(transposed, aten.clone.default):
        transposed = transposed.args[0]
    if not (_is(transposed, aten.permute.default) and list(transposed.args[1]) == [1, 0]):
        return None
    return transposed.args[0]


def _is_standard_arange(node) -> bool:
    """`torch.arange(0, 32, 4)` (an iota of 8 from 0 by 4 in the post-grad graph): nibble i at bits 4i,
    what the op assumes when it gets no shifts."""
    if _is(node, prims.iota.default):
        return node.args[0] == 8 and node.kwargs.get("start") == 0 and node.kwargs.get("step") == 4
    if _is(node, aten.arange.start_step):
        return tuple(node.args[:3]) == (0, 32, 4)
    return False


def _weight_operand(anchor: Node) -> tuple[Node, Node, Node | None]:
    """(x2d, the [N, K] float weight w or None, bias or None) of an mm / addmm of x2d and w.t()."""
    if anchor.target == aten.addmm.default:
        bias, x2d, weight_t = anchor.args[:3]
    else:
        (x2d, weight_t), bias = anchor.args[:2], None
    if not _finds_int4_unpack(weight_t):
        return x2d, None, bias
    found = "an int4 weight unpacked by shift and mask found, but"
    if anchor.kwargs.get("beta", 1) != 1 or anchor.kwargs.get("alpha", 1) != 1:
        raise NotFusable(f"{found} the addmm scales its terms (alpha or beta)")
    if not (_is(weight_t, aten.permute.default) and list(weight_t.args[1]) == [1, 0]):
        raise NotFusable(f"{found} it is used as a [K, N] matrix (the AutoGPTQ [K / 8, N] and AWQ layouts are not "
                         "taken yet)")
    return x2d, weight_t.args[0], bias


def _finds_int4_unpack(node, depth: int = 12) -> bool:
    """Whether `node` or one of its inputs up to `depth` nodes up is a nibble mask (`& 0xF`)."""
    frontier, seen = {node} if isinstance(node, Node) else set(), set()
    for _ in range(depth):
        if any(_is(item, aten.bitwise_and.Scalar) and item.args[1] == NIBBLE_MASK for item in frontier):
            return True
        seen |= frontier
        frontier = {arg for item in frontier for arg in item.all_input_nodes} - seen
    return False


def analyze(anchor: Node) -> FusedLinear | None:
    """The int4 weight-only linear at `anchor`, None if its weight is no int4 unpack, NotFusable if nearly."""
    x2d, weight, bias = _weight_operand(anchor)
    if weight is None:
        return None
    found = "an int4 weight unpacked by shift and mask found, but"
    product = _under_views(weight)
    if not _is(product, aten.mul.Tensor):
        raise NotFusable(f"{found} it is not dequantized by one multiplication with its scales")
    values, scale_column = product.args[:2]
    if not _finds_int4_unpack(values):
        values, scale_column = scale_column, values
    return _linear(anchor, x2d, bias, values, scale_column, weight, found)


def _values_and_zeros(values, n: int, groups: int, found: str):
    """(words, shifts, zero words or None) of the values operand `(q - z)` of the dequantize."""
    signed = _minus_offset(values)
    if signed is not None:  # q - 8, symmetric (either unpack)
        return (*signed, None)
    difference = _under_views(values)
    if _is(difference, aten.sub.Tensor):
        minuend, subtrahend = difference.args[:2]
        unsigned, signed = _nibbles(minuend), _minus_offset(minuend)
        if unsigned is not None and unsigned[1] is not None:  # GPTQ: q - z, both unsigned
            zeros = _gptq_zero_words(subtrahend, unsigned[1])
            if zeros is not None:
                return (*unsigned, zeros)
        if signed is not None and signed[1] is None:  # compressed-tensors: (q - 8) - (z - 8)
            zeros = _compressed_tensors_zero_words(subtrahend, n, groups)
            if zeros is not None:
                return (*signed, zeros)
    raise NotFusable(f"{found} its zero point is neither the uint4 offset 8 nor int32 [N / 8, K / g] zero "
                     "points unpacked the same way (zeros stored minus one are not taken yet)")


def _linear(anchor, x2d, bias, values, scale_column, weight, found) -> FusedLinear:
    x_dtype = dtype_of(x2d)
    scales = _unsqueezed(scale_column, -1)
    per_channel = scales is None and len(shape_of(scale_column)) == 2 and static_int(shape_of(scale_column)[1]) == 1
    if per_channel:  # [N, K] values times [N, 1] scales: one group of K
        scales = scale_column
    if scales is None:
        raise NotFusable(f"{found} its scale is not `scales.unsqueeze(-1)` of [N, K / g] scales (a gather by "
                         "g_idx or a repeat_interleave is not taken yet)")
    n, k = (static_int(size) for size in shape_of(weight))
    scales_shape = shape_of(scales)
    groups = static_int(scales_shape[-1]) if len(scales_shape) == 2 else None
    if None in (n, k, groups) or tuple(scales_shape) != (n, groups) or k % groups:
        raise NotFusable(f"{found} its scales {list(scales_shape)} are not [N, K / g] of the [{n}, {k}] weight")
    packed, shifts, packed_zeros = _values_and_zeros(values, n, groups, found)
    group_size = k // groups
    if dtype_of(packed) != torch.int32 or tuple(shape_of(packed)) != (n, k // 8):
        raise NotFusable(f"{found} the packed weight is {dtype_of(packed)} {list(shape_of(packed))}, not int32 "
                         "[N, K / 8] (the AutoGPTQ [K / 8, N] and AWQ layouts are not taken yet)")
    if shifts is not None and (dtype_of(shifts) != torch.int32 or tuple(shape_of(shifts)) != (8,)):
        raise NotFusable(f"{found} the shifts are not an int32 [8] tensor")
    shifts = None if _is_standard_arange(shifts) else shifts
    for name, stored in (("packed weight", packed), ("shifts", shifts), ("scales", scales), ("zero points", packed_zeros)):
        if stored is not None and stored.op not in ("placeholder", "get_attr"):
            raise NotFusable(f"{found} its {name} are computed on every call ({stored.name}); the fused op prepares "
                             "the stored int4 weight once")
    if packed_zeros is not None and (dtype_of(packed_zeros) != torch.int32
                                     or tuple(shape_of(packed_zeros)) != (n // 8, groups)):
        raise NotFusable(f"{found} its zero points are {list(shape_of(packed_zeros))}, not int32 [N / 8, K / g]")
    grouped = ((n, k), (n, 1)) if per_channel else ((n, groups, group_size), (n, groups, 1))
    if (tuple(shape_of(values)), tuple(shape_of(scale_column))) != grouped:
        raise NotFusable(f"{found} it is not grouped as [N, K / g, g] values times [N, K / g, 1] scales")
    if dtype_of(scales) != x_dtype or x_dtype not in FLOAT_ACTIVATION_DTYPES:
        raise NotFusable(f"{found} its scales are {dtype_of(scales)} and the activation {x_dtype}; the fused op "
                         "takes scales in the activation's dtype")
    if bias is not None and (tuple(shape_of(bias)) != (n,) or dtype_of(bias) != x_dtype):
        raise NotFusable(f"{found} the bias is {dtype_of(bias)} {list(shape_of(bias))}, not [{n}] in the activation's dtype")
    if len(weight.users) > 1:
        raise NotFusable(f"{found} the dequantized weight has {len(weight.users)} users")
    scheme = QuantScheme.weight_only(INT4_DTYPE, Granularity.PER_GROUP, x_dtype, weight_group_size=group_size)
    return FusedLinear(
        anchor=anchor, family=FAMILY, pattern="int4 unpack + dequantize + float linear", a=x2d, b=packed,
        scheme=scheme, out_dtype=dtype_of(anchor), replaces=anchor, bias=bias,
        int4=Int4Weight(packed, shifts, scales, packed_zeros, group_size),
    )


def run(graph: Graph, context: PassContext) -> None:
    fuse_anchored_linears(graph, context, FAMILY, ANCHORS, analyze)
