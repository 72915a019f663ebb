"""reference_linear: a hand-written quantized matmul and its dequantize epilogue -> qfuse::scaled_mm.

The matmul (the anchor), in the three forms people write:

    torch._int_mm(a_int8, b_int8)                       int32 accumulator
    torch._scaled_mm(a, b, scale_a, scale_b, ...)       fp8 (unit scales, or its own scales)
    torch.mm(a_q.float(), w_q.float().t())              a float matmul of upcast int8 / fp8

where b is the weight as [K, N]: a `w.t()` of a stored [N, K] weight, or a stored [K, N] one.

The dequantize epilogue, walked from the matmul along nodes with a single user, in any order
that keeps the math (out = acc * scale_a * scale_b + bias):

    convert(acc, float)          the int32 accumulator to float
    mul(y, s) or mul(s, y)       s per-tensor (a tensor or a Python number), per-row [M, 1],
                                 per-column [N] / [1, N], or a pre-multiplied row * column
    add(y, bias)                 bias [N], once, after the scales
    view / reshape(y)            2D <-> 3D, keeping the last dim
    convert(y, dtype)            the output cast; ends the epilogue

Safety (`can_fuse_*`): quantized dtypes on both sides, every scale shaped per-tensor / per-row /
per-column of the output (never growing it), at most one scale of each side, a float output.
A matmul with no scale after it, or with a scale that cannot move into the fused op, is left
alone (fusing half a dequantize would mislead), with the reason recorded.
The activation quantization itself stays where it is (see `activation_quant`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from qfuse.ops.scaled_mm import OUT_DTYPES
from qfuse.passes.fused_linear import FusedLinear, NotFusable, PassContext, fuse_anchored_linears
from qfuse.passes.graph_utils import (
    CONSTANT_OPS,
    VIEW_OPS,
    aten,
    converted_dtype,
    dtype_of,
    insert_call,
    is_computed,
    same_size,
    shape_of,
    show_shape,
    single_user,
)
from qfuse.schemes import FP8_DTYPE, Granularity, QuantScheme, dtype_name

FAMILY = "reference_linear"
QUANTIZED = (torch.int8, FP8_DTYPE)


@dataclass
class Scale:
    value: Node | float | int
    kind: str  # "tensor" (one value), "row" (per token), "column" (per channel)


@dataclass
class Epilogue:
    """The state of the walk down from the matmul."""

    last: Node
    scales: list[Scale] = field(default_factory=list)
    bias: Node | None = None
    output_shape: list | None = None
    closed: bool = False  # after the output cast (or a bias fused by _scaled_mm), nothing more
    stopped_because: str = ""  # why the walk did not absorb the next node, when that is a near miss


def _argument(node: Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_unit_scale(node) -> bool:
    return (
        isinstance(node, Node) and node.target in CONSTANT_OPS
        and (node.target == aten.ones.default or node.args[1] == 1)
    )


def _is_exact_upcast(node) -> bool:
    """A conversion of an int8 / fp8 tensor to a float dtype (exact: every value is representable)."""
    target = converted_dtype(node) if isinstance(node, Node) else None
    return target is not None and target.is_floating_point and dtype_of(node.args[0]) in QUANTIZED


def _strip_weight(node: Node) -> tuple[Node, bool]:
    """Undo the float upcast on the weight side: returns (quantized [K, N] node, needs_permute).

    Only one exact upcast is undone: a conversion between float dtypes (int8 -> fp8 -> float,
    say) rounds, and what it rounds is not the quantized weight."""
    transposed = False
    while node.target == aten.permute.default and list(node.args[1]) == [1, 0]:
        node, transposed = node.args[0], not transposed
    if not _is_exact_upcast(node):
        return node, transposed
    node = node.args[0]
    while node.target == aten.permute.default and list(node.args[1]) == [1, 0]:
        node, transposed = node.args[0], not transposed
    return node, transposed


def parse_matmul(graph: Graph, node: Node) -> tuple[Node, Node, Epilogue, str] | None:
    """(a, b, the epilogue so far, pattern name) if `node` is a quantized matmul, else None."""
    if node.target == aten._int_mm.default:
        return node.args[0], node.args[1], Epilogue(last=node), "_int_mm"
    if node.target == aten._scaled_mm.default:
        epilogue = Epilogue(last=node, bias=_argument(node, 4, "bias"))
        for scale, kind in ((_argument(node, 2, "scale_a"), "row"), (_argument(node, 3, "scale_b"), "column")):
            if not _is_unit_scale(scale):
                epilogue.scales.append(Scale(scale, "tensor" if shape_of(scale) in ((), (1,), (1, 1)) else kind))
        if _argument(node, 5, "scale_result") is not None:
            raise NotFusable("_scaled_mm with scale_result is not supported")
        epilogue.closed = epilogue.bias is not None or dtype_of(node) != torch.float32
        return node.args[0], node.args[1], epilogue, "_scaled_mm"
    if node.target == aten.mm.default:
        upcast_a, upcast_b = node.args
        if not _is_exact_upcast(upcast_a):
            return None
        weight, transposed = _strip_weight(upcast_b)
        if dtype_of(weight) not in QUANTIZED:
            return None
        if transposed:
            with graph.inserting_before(node):
                weight = insert_call(graph, aten.permute.default, (weight, [1, 0]))
        return upcast_a.args[0], weight, Epilogue(last=node), "float mm of upcast"
    return None


def classify_scale(scale, output: Node) -> Scale:
    """can_fuse_scale: is `scale` per-tensor, per-row or per-column of `output`'s value (the
    value it multiplies), without broadcasting it to a larger shape?"""
    if isinstance(scale, (int, float)):
        return Scale(float(scale), "tensor")
    scale_shape, out_shape = shape_of(scale), shape_of(output)
    if scale_shape is None or not dtype_of(scale).is_floating_point:
        raise NotFusable(f"the scale {getattr(scale, 'name', scale)} is not a floating-point tensor")
    if len(scale_shape) > len(out_shape):
        raise NotFusable(
            f"a scale has shape {show_shape(scale_shape)}, which would broadcast the "
            f"{show_shape(out_shape)} output to more dims"
        )
    padded = (1,) * (len(out_shape) - len(scale_shape)) + scale_shape
    lead, columns = padded[:-1], padded[-1]
    if all(same_size(size, 1) for size in padded):
        return Scale(scale, "tensor")
    if same_size(columns, 1) and all(same_size(a, b) for a, b in zip(lead, out_shape[:-1])):
        return Scale(scale, "row")
    if all(same_size(size, 1) for size in lead) and same_size(columns, out_shape[-1]):
        return Scale(scale, "column")
    raise NotFusable(
        f"a scale has shape {show_shape(scale_shape)}: neither one value, per-row "
        f"{show_shape((*out_shape[:-1], 1))} nor per-column [{out_shape[-1]}] of the {show_shape(out_shape)} output"
    )


def _split_premultiplied(scale, output: Node) -> list[Scale]:
    """A scale computed as row * column (or one of them alone)."""
    if isinstance(scale, Node) and scale.target == aten.mul.Tensor and len(scale.users) == 1:
        try:
            parts = [classify_scale(factor, output) for factor in scale.args]
        except NotFusable:
            parts = None
        if parts and sorted(part.kind for part in parts) == ["column", "row"]:
            return parts
    return [classify_scale(scale, output)]


def walk_epilogue(epilogue: Epilogue) -> None:
    """Absorb the dequantize epilogue below the matmul into `epilogue`, as far as it goes."""
    while not epilogue.closed:
        current = epilogue.last
        user = single_user(current)
        if user is None and len(current.users) > 1 and not epilogue.scales:
            epilogue.stopped_because = (
                f"{current.name} has {len(current.users)} users, so what follows it cannot move into a fused op"
            )
        if user is None or user.op != "call_function":
            return
        target = user.target
        if converted_dtype(user) is not None:
            if converted_dtype(user) not in OUT_DTYPES:
                return
            epilogue.closed = dtype_of(current).is_floating_point  # an int32 -> float upcast goes on
        elif target == aten.mul.Tensor and epilogue.bias is None:
            (scale,) = [arg for arg in user.args if arg is not current] or [current]
            try:
                scales = epilogue.scales + _split_premultiplied(scale, current)
                _assign_scales(scales)
            except NotFusable as reason:
                epilogue.stopped_because = str(reason)
                return
            epilogue.scales = scales
        elif target == aten.add.Tensor and epilogue.bias is None and "alpha" not in user.kwargs:
            (bias,) = [arg for arg in user.args if arg is not current] or [current]
            if not can_fuse_bias(bias, current):
                return
            epilogue.bias = bias
        elif target in VIEW_OPS and same_size(shape_of(user)[-1], shape_of(current)[-1]):
            epilogue.output_shape = list(user.args[1])
        else:
            return
        epilogue.last = user


def can_fuse_bias(bias, output: Node) -> bool:
    """A bias [N] (or [1, N]) of `output`'s value, not growing it."""
    shape = shape_of(bias)
    return (
        shape is not None and dtype_of(bias).is_floating_point and 1 <= len(shape) <= len(shape_of(output))
        and all(same_size(size, 1) for size in shape[:-1]) and same_size(shape[-1], shape_of(output)[-1])
    )


def _assign_scales(scales: list[Scale]) -> tuple[Scale | None, Scale | None]:
    """can_fuse_scales: at most one activation (row / tensor) and one weight (column / tensor) scale."""
    rows = [scale for scale in scales if scale.kind == "row"]
    columns = [scale for scale in scales if scale.kind == "column"]
    tensors = [scale for scale in scales if scale.kind == "tensor"]
    if len(rows) > 1 or len(columns) > 1 or len(scales) > 2:
        shapes = ", ".join(scale.kind for scale in scales)
        raise NotFusable(f"{len(scales)} scale factors ({shapes}); a fused linear takes one per side")
    scale_a = rows[0] if rows else (tensors.pop(0) if tensors else None)
    scale_b = columns[0] if columns else (tensors.pop(0) if tensors else None)
    return scale_a, scale_b


def analyze(graph: Graph, anchor: Node) -> FusedLinear | None:
    """Recognise the linear at `anchor`; None if it is no quantized matmul; NotFusable if it nearly is."""
    parsed = parse_matmul(graph, anchor)
    if parsed is None:
        return None
    a, b, epilogue, pattern = parsed
    a_dtype, b_dtype = dtype_of(a), dtype_of(b)
    if a_dtype not in QUANTIZED or b_dtype != a_dtype:
        raise NotFusable(f"{pattern} of {a_dtype} x {b_dtype}; qfuse fuses int8 x int8 and fp8 x fp8")
    walk_epilogue(epilogue)
    found = f"{pattern} ({dtype_name(a_dtype)}) found, but"
    if epilogue.stopped_because:  # part of the dequantize cannot move: fusing the rest would mislead
        raise NotFusable(f"{found} {epilogue.stopped_because}")
    if not epilogue.scales:
        raise NotFusable(f"{found} no dequantize scale is applied to its output")
    out_dtype = dtype_of(epilogue.last)
    if out_dtype not in OUT_DTYPES:
        raise NotFusable(f"{found} the epilogue ends in {out_dtype}; a fused linear returns one of {OUT_DTYPES}")
    scale_a, scale_b = _assign_scales(epilogue.scales)
    scheme = QuantScheme(
        activation_dtype=a_dtype, weight_dtype=b_dtype,
        activation_granularity=Granularity.PER_TOKEN if scale_a and scale_a.kind == "row" else Granularity.PER_TENSOR,
        weight_granularity=Granularity.PER_CHANNEL if scale_b and scale_b.kind == "column" else Granularity.PER_TENSOR,
        dynamic=scale_a is not None and is_computed(scale_a.value),
    )
    return FusedLinear(
        anchor=anchor, family=FAMILY, pattern=f"{pattern} + dequant epilogue", a=a, b=b, scheme=scheme,
        out_dtype=out_dtype, replaces=epilogue.last, output_shape=epilogue.output_shape,
        scale_a=scale_a.value if scale_a else None, scale_b=scale_b.value if scale_b else None,
        bias=_bias_as_vector(graph, epilogue.bias, epilogue.last),
    )


def _bias_as_vector(graph: Graph, bias: Node | None, before: Node) -> Node | None:
    if bias is None or len(shape_of(bias)) == 1:
        return bias
    with graph.inserting_before(before):
        return insert_call(graph, aten.reshape.default, (bias, [-1]))


ANCHORS = (aten._int_mm.default, aten._scaled_mm.default, aten.mm.default)


def run(graph: Graph, context: PassContext) -> None:
    fuse_anchored_linears(graph, context, FAMILY, ANCHORS, analyze)
