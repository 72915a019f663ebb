"""Scale algebra of a dequantize epilogue: factors, their broadcast roles, and how they combine.

A dequantize multiplies the matmul's accumulator by scale factors, written in many ways:

    acc * sx * sw                    acc * (sx * sw.reshape(1, -1))        acc / 127 * sw
    _scaled_mm(q, w, one, one) * sx * sw.t()       acc * sw.reciprocal()   2.0 * acc * sx

Whatever the spelling, each factor is a number or a tensor that broadcasts against the output in
one of three roles:

    role     shape against an output [..., M, N]      joins
    -------  ----------------------------------------  -----------------------------------------
    tensor   one value ([], [1], [1, 1], a number)     either side: the weight takes one, the
                                                       activation the rest
    row      [..., M, 1] (one per token)               the activation scale (scale_a)
    column   [N], [1, N], an [N, 1] turned by .t()     the weight scale (scale_b)

Factors of one side multiply into one scale (`ScaleProduct`); a constant all-ones factor (a
`torch.ones` / `full(..., 1)` in the graph, the number 1) vanishes; a division contributes the
reciprocal. A factor of the output's own shape is no scale at all: the linear ends before it (a
SwiGLU's `silu(gate) * up`). Any other shape is a near miss that names the factor.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Graph, Node

from qfuse.passes.core.graph_utils import (
    CONSTANT_OPS,
    CONVERT_OPS,
    VIEW_OPS,
    PendingCall,
    aten,
    dtype_of,
    insert_call,
    materialize,
    same_shape,
    same_size,
    scalar_tensor,
    shape_of,
    show_shape,
)


class Role(str, enum.Enum):
    TENSOR = "tensor"
    ROW = "row"
    COLUMN = "column"


class NotAScale(Exception):
    """The factor has no scale role; `ends_linear` says it is an ordinary consumer (a boundary)."""

    def __init__(self, message: str, ends_linear: bool = False) -> None:
        super().__init__(message)
        self.ends_linear = ends_linear


@dataclass(frozen=True)
class Factor:
    value: Node | PendingCall | float  # a pending call: a row slice of a node (`ScaleProduct.rows_sliced`)
    role: Role
    inverted: bool = False  # the epilogue divides by it
    #: computed from the activation's graph inputs: it changes with every call, so it belongs to the activation's
    #: side (a weight scale is prepared once with its weight)
    from_activation: bool = False

    def describe(self) -> str:
        value = self.value.args[0] if isinstance(self.value, PendingCall) else self.value  # a row slice of it
        name = value.name if isinstance(value, Node) else f"{value:g}"
        return ("1/" if self.inverted else "") + name


def is_unit(value) -> bool:
    """A constant factor of all ones: the number 1, or a `ones` / `full(..., 1)` node."""
    if isinstance(value, (int, float)):
        return value == 1
    if not isinstance(value, Node):
        return False
    if value.target in CONSTANT_OPS:
        return value.target == aten.ones.default or value.args[1] == 1
    if value.op == "get_attr":  # a constant of the graph (lifted, or frozen)
        constant = getattr(value.graph.owning_module, value.target, None)
        with unset_fake_temporarily():  # a real comparison, also inside a fake mode (freezing's joint stage)
            return isinstance(constant, torch.Tensor) and constant.numel() <= 64 and bool((constant == 1).all())
    return False


def classify(value, output: Node, inverted: bool = False) -> Factor:
    """The role of a factor that multiplies (or divides) `output`; NotAScale if it has none."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Factor(float(value), Role.TENSOR, inverted)
    scale_shape, out_shape = shape_of(value), shape_of(output)
    name = getattr(value, "name", value)
    if scale_shape is None or not dtype_of(value).is_floating_point:
        raise NotAScale(f"the factor {name} is not a floating-point tensor")
    if len(scale_shape) > len(out_shape):
        raise NotAScale(
            f"the factor {name} has shape {show_shape(scale_shape)}, which would broadcast the "
            f"{show_shape(out_shape)} output to more dims"
        )
    padded = (1,) * (len(out_shape) - len(scale_shape)) + tuple(scale_shape)
    lead, columns = padded[:-1], padded[-1]
    if all(same_size(size, 1) for size in padded):
        return Factor(value, Role.TENSOR, inverted)
    if same_size(columns, 1) and all(same_size(a, b) for a, b in zip(lead, out_shape[:-1])):
        return Factor(value, Role.ROW, inverted)
    if all(same_size(size, 1) for size in lead) and same_size(columns, out_shape[-1]):
        return Factor(value, Role.COLUMN, inverted)
    raise NotAScale(
        f"the factor {name} has shape {show_shape(scale_shape)}: neither one value, per-row "
        f"{show_shape((*out_shape[:-1], 1))} nor per-column [{out_shape[-1]}] of the {show_shape(out_shape)} output",
        ends_linear=same_shape(padded, out_shape),
    )


def _within(shape, out_shape) -> bool:
    """Whether a factor of `shape` broadcasts to `out_shape` without growing it."""
    if shape is None or out_shape is None or len(shape) > len(out_shape):
        return False
    return all(same_size(size, 1) or same_size(size, out) for size, out in zip(shape, out_shape[len(out_shape) - len(shape):]))


def factors_of(value, output: Node, inverted: bool = False) -> list[Factor]:
    """The factors in `value`: itself if it has a role, else the factors of a product it is
    (`sx * sw.reshape(1, -1)`, an outer product of a row and a column), recursively. An `expand` is its
    input broadcast out in full (torchao's int8 GEMM on CUDA expands its per-row scale to [M, N]): the
    same factor."""
    if isinstance(value, Node) and value.target == aten.expand.default and _within(shape_of(value), shape_of(output)):
        return factors_of(value.args[0], output, inverted)
    try:
        factor = classify(value, output, inverted)
    except NotAScale as not_a_scale:
        if isinstance(value, Node) and value.target in (aten.mul.Tensor, aten.div.Tensor):
            try:
                return factors_of_product(value, output, inverted)
            except NotAScale:
                pass
        raise not_a_scale
    return [] if is_unit(factor.value) else [factor]


def factors_of_product(value: Node, output: Node, inverted: bool = False) -> list[Factor]:
    """The factors of the two operands of a mul / div node, each by `factors_of`."""
    left, right = value.args[:2]
    return factors_of(left, output, inverted) + factors_of(right, output, inverted != (value.target == aten.div.Tensor))


@dataclass(frozen=True)
class ScaleProduct:
    """The scale of one side of the fused linear: the product of its factors."""

    factors: tuple[Factor, ...]

    @property
    def role(self) -> Role:
        roles = {factor.role for factor in self.factors}
        return next((role for role in (Role.ROW, Role.COLUMN) if role in roles), Role.TENSOR)

    def rows_sliced(self, row_slice: tuple) -> ScaleProduct:
        """The product for rows start:end of the output ((start, end) = `row_slice`): its per-row
        factors sliced (pending calls, inserted by `emit`), the others as they are."""
        return ScaleProduct(tuple(
            replace(factor, value=PendingCall(aten.slice.Tensor, (factor.value, 0, *row_slice)))
            if factor.role == Role.ROW else factor for factor in self.factors))

    def emit(self, graph: Graph, device: torch.device) -> Node | None:
        """One float32 tensor node holding the product (the factor itself when it is alone)."""
        number, nodes = 1.0, []
        for factor in self.factors:
            if isinstance(factor.value, (Node, PendingCall)):
                node = materialize(graph, factor.value)
                if factor.inverted:
                    node = insert_call(graph, aten.reciprocal.default, (_as_float32(graph, node),))
                nodes.append(node)
            else:
                number = number / factor.value if factor.inverted else number * factor.value
        if not nodes:
            return scalar_tensor(graph, number, torch.float32, device) if self.factors else None
        product = nodes[0]
        for node in nodes[1:]:
            product = insert_call(graph, aten.mul.Tensor, (_as_float32(graph, product), _as_float32(graph, node)))
        if number != 1.0:
            product = insert_call(graph, aten.mul.Tensor, (_as_float32(graph, product), number))
        return product


def _as_float32(graph: Graph, node: Node) -> Node:
    if dtype_of(node) == torch.float32:
        return node
    return insert_call(graph, CONVERT_OPS[0], (node, torch.float32))


def base_of(value):
    """A scale under its views and row slices (a `reshape(-1, 1)` or a `narrow(0, 0, M)` of the
    quantizer's scale is that scale, as far as which side it belongs to goes)."""
    while isinstance(value, Node) and (value.target in VIEW_OPS or (value.target == aten.slice.Tensor
                                                                      and value.args[1] == 0)):
        value = value.args[0]
    return value


def split_sides(factors: Sequence[Factor], activation_scale=None) -> tuple[ScaleProduct | None, ScaleProduct | None]:
    """(scale_a, scale_b): rows (and the quantizer's own scale) to the activation, columns to the
    weight; one-value factors to the weight when it has no column (not one computed from the activation),
    the rest to the activation.

    The weight side is kept to stored factors where it can be (a parameter, not a product made per
    call), so a kernel that prepares its weight once can cache it."""
    rows = [factor for factor in factors if factor.role == Role.ROW]
    columns = [factor for factor in factors if factor.role == Role.COLUMN]
    tensors = [factor for factor in factors if factor.role == Role.TENSOR]
    weight = columns
    if not columns:
        others = [factor for factor in tensors if not factor.from_activation
                  and (activation_scale is None or base_of(factor.value) is not base_of(activation_scale))]
        if others and (rows or len(tensors) > 1):
            weight = [others[-1]]
    activation = rows + [factor for factor in tensors if all(factor is not chosen for chosen in weight)]
    return (ScaleProduct(tuple(activation)) if activation else None,
            ScaleProduct(tuple(weight)) if weight else None)
