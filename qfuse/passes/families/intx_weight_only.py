"""intx_weight_only: a float linear whose weight is torchao's int4 "intx" form -> qfuse::int4_weight_only_mm.

torchao's int4 configs that run on any device, `IntxWeightOnlyConfig(weight_dtype=torch.int4)` and
the weight of `Int8DynamicActivationIntxWeightConfig` ("8da4w"), keep the int4 values unpacked, one
per int8 (`IntxUnpackedToInt8Tensor`), with a scale and an int8 zero point per group of g input
channels. Their linear dequantizes in the graph; traced, walked up from the matmul's weight operand:

    w   = ((q.view(N, K / g, g).to(f) - zp.view(N, K / g, 1).to(f)) * s.view(N, K / g, 1)).view(N, K)
    out = mm(x2d, w.t()) or addmm(bias, x2d, w.t())

q int8 [N, K], zp int8 [N, K / g] (all zero for the symmetric default; the subtraction may be
absent), s [N, K / g] in the activation's dtype, f a float dtype (float32, bf16 or fp16: int8
values and their differences are exact in each), the product rounded once to the activation's
dtype (computed there, or in float32 and cast after). One group spanning K is a scale per channel.

The fused op takes q, s and zp themselves (its int8 storage). int8 storage proves nothing about
int4's range (torchao's intx holds int1 to int8 values the same way, and the graph does not say
which), so the op checks the values once per weight and runs an int4 kernel, or multiplies by the
weight dequantized once (`qfuse.ops.int4_weight_only`; a float copy of the weight is kept, and
logged): exact either way. The report calls every such linear int4. 8da4w's activation is
fake-quantized in float (per-token asymmetric int8); that stays in the graph and the fused op takes
its float result, the math eager runs. A symmetric int8 activation fake quant and a weight without
zero points make the linear W4A8 (`qfuse.passes.forms.w4a8`), with this one as its fallback.

Near misses, named in debug mode: scales in another dtype than the activation, stored tensors
computed per call, a dequantized weight with another user, an addmm that scales its terms (`alpha`,
`beta`). A subtraction that scales the zero point (`alpha`) is no dequantize of this form.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from qfuse.passes.core.fused_linear import FusedLinear, Int4Weight, NotFusable, PassContext, fuse_anchored_linears
from qfuse.passes.core.graph_utils import (CONVERT_OPS, aten, converted_dtype, dtype_of, is_call, is_subtraction, shape_of,
                                     static_int, strip_views)
from qfuse.passes.forms.w4a8 import with_int8_activation
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, INT4_DTYPE, Granularity, QuantScheme

FAMILY = "intx_weight_only"
FOUND = "torchao's int4 intx weight (int8 values, a scale per group) found, but"
ANCHORS = (aten.mm.default, aten.addmm.default)


def _stored_int8(node, shape: tuple) -> Node | None:
    """The stored int8 tensor of `shape` under `node` = stored.view(...).to(float), else None."""
    if not (is_call(node, *CONVERT_OPS) and converted_dtype(node) in FLOAT_ACTIVATION_DTYPES):
        return None
    stored = strip_views(node.args[0])[0]
    if isinstance(stored, Node) and dtype_of(stored) == torch.int8 and tuple(shape_of(stored) or ()) == shape:
        return stored
    return None


def _dequantized_weight(anchor: Node) -> tuple[Node, Node | None, Node | None]:
    """(x2d, the [N, K] float weight or None where the operand is no transpose, bias) of an mm / addmm
    of x2d and w.t()."""
    if anchor.target == aten.addmm.default:
        bias, x2d, weight_t = anchor.args[:3]
    else:
        (x2d, weight_t), bias = anchor.args[:2], None
    if not (is_call(weight_t, aten.permute.default) and list(weight_t.args[1]) == [1, 0]):
        return x2d, None, bias
    return x2d, weight_t.args[0], bias


def _product(weight: Node) -> Node | None:
    """The grouped `(values) * scales` under the [N, K] weight: under views and one float cast."""
    node = strip_views(weight)[0]
    if is_call(node, *CONVERT_OPS):
        node = strip_views(node.args[0])[0]
    return node if is_call(node, aten.mul.Tensor) and len(shape_of(node) or ()) == 3 else None


def analyze(anchor: Node) -> FusedLinear | None:
    """The intx linear at `anchor`, None if its weight is no int8 dequantize by groups, NotFusable if nearly."""
    x2d, weight, bias = _dequantized_weight(anchor)
    product = None if weight is None else _product(weight)
    if product is None:
        return None
    n, groups, group_size = (static_int(size) for size in shape_of(product))
    if None in (n, groups, group_size):
        return None
    if tuple(shape_of(weight)) != (n, groups * group_size):
        return None
    for values, scale_factor in (product.args[:2], product.args[1::-1]):
        zero_point = None
        if tuple(shape_of(values) or ()) != (n, groups, group_size):
            continue
        if is_subtraction(values):
            values, zero_factor = values.args[:2]
            zero_point = _stored_int8(zero_factor, (n, groups))
            if zero_point is None or tuple(shape_of(zero_factor)) != (n, groups, 1):
                continue
        q = _stored_int8(values, (n, groups * group_size))
        scales = strip_views(scale_factor)[0]
        if q is not None and isinstance(scales, Node) and tuple(shape_of(scales) or ()) == (n, groups) \
                and tuple(shape_of(scale_factor)) == (n, groups, 1):
            return _linear(anchor, x2d, bias, weight, q, scales, zero_point, group_size)
    return None


def _linear(anchor, x2d, bias, weight, q, scales, zero_point, group_size: int) -> FusedLinear:
    if anchor.kwargs.get("beta", 1) != 1 or anchor.kwargs.get("alpha", 1) != 1:
        raise NotFusable(f"{FOUND} the addmm scales its terms (alpha or beta)")
    x_dtype = dtype_of(x2d)
    if dtype_of(scales) != x_dtype or x_dtype not in FLOAT_ACTIVATION_DTYPES:
        raise NotFusable(f"{FOUND} its scales are {dtype_of(scales)} and the activation {x_dtype}; the fused op "
                         "takes scales in the activation's dtype")
    for name, stored in (("values", q), ("scales", scales), ("zero points", zero_point)):
        if stored is not None and stored.op not in ("placeholder", "get_attr"):
            raise NotFusable(f"{FOUND} its {name} are computed on every call ({stored.name}); the fused op "
                             "prepares the stored weight once")
    if len(weight.users) > 1:
        raise NotFusable(f"{FOUND} the dequantized weight has {len(weight.users)} users")
    n = shape_of(q)[0]
    if bias is not None and (tuple(shape_of(bias)) != (n,) or dtype_of(bias) != x_dtype):
        raise NotFusable(f"{FOUND} the bias is {dtype_of(bias)} {list(shape_of(bias))}, not [{n}] in the "
                         "activation's dtype")
    scheme = QuantScheme.weight_only(INT4_DTYPE, Granularity.PER_GROUP, x_dtype, weight_group_size=group_size)
    weight_only = FusedLinear(
        anchor=anchor, family=FAMILY, pattern="int8-stored int4 (torchao intx) + dequantize + float linear",
        a=x2d, b=q, scheme=scheme, out_dtype=dtype_of(anchor), replaces=anchor, bias=bias,
        int4=Int4Weight(q, None, scales, zero_point, group_size),
    )
    return with_int8_activation(weight_only, x2d, has_weight_zero_point=zero_point is not None)


def run(graph: Graph, context: PassContext) -> None:
    fuse_anchored_linears(graph, context, FAMILY, ANCHORS, analyze)
