"""A float linear of dequantized operands, read on the quantized tensors: what the dequantize forms share.

    linear      mm(A, B) | addmm(bias, A, B)            (3D inputs: A = reshape(...); operands
                                                         zero-padded by Inductor's shape padding)
                | bmm(expand(A), expand(B))              (3D inputs that are not contiguous)
    A, B        (q - zero_point) * scale, as a family's `match` reads a dequantize (`Dequantized`):
                PT2E's quantized_decomposed ops (`pt2e_linear`), fake quant written in plain torch
                (`fake_quant`), block-scaled weights (`block_scales`)

`analyze_dequantized_linear(anchor, match, family)` turns such a linear into a `FusedLinear` on the
quantized tensors (W8A8, or W8A16 when the activation is a plain float), or says why not
(`NotFusable`). The `can_fuse_*` checks only read the graph; the casts, shifts, views and transposes
the fused op's operands need are pending calls (`*_operand`), inserted when the linear is fused, so a
near miss leaves the graph untouched. A form module: no family of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import Node

from qfuse.ops.scaled_mm import OUT_DTYPES
from qfuse.passes.core.fused_linear import FLOAT_GEMMS, FusedLinear, NotFusable
from qfuse.passes.core.graph_utils import (
    PendingCall,
    aten,
    dtype_of,
    prims,
    same_shape,
    shape_of,
    strip_views,
    strip_zero_padding,
)
from qfuse.passes.forms.quant_forms import is_dynamic_scale, uint8_as_int8
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, FP8_DTYPE, WEIGHT_ONLY_DTYPES, Granularity, QuantScheme, dtype_name


class WeightNotDequantized(NotFusable):
    """The activation of a linear is dequantized and its weight is not, as far as this family reads it
    (a later family may say what the weight is)."""


@dataclass
class Dequantized:
    """(q - zero_point) * scale, as found in the graph."""

    q: Node
    scale: Node | float
    zero_point: Node | int
    granularity: Granularity
    kind: str  # for the pattern name
    axis: int | None = None
    cast_to: torch.dtype | None = None  # q is a float tensor of integers in this dtype's range (fake quant)

    @property
    def computed_per_call(self) -> bool:
        """q is computed in the graph (quantized on every call), not a stored tensor."""
        return strip_views(self.q)[0].op == "call_function"

    @property
    def dtype(self) -> torch.dtype:
        return self.cast_to or dtype_of(self.q)

    @functools.cached_property
    def quantized(self) -> Node | PendingCall:
        """q as an integer / fp8 tensor (a float of integers is cast: exact, they are in range); one
        pending cast however often it is read."""
        if self.cast_to is None:
            return self.q
        return PendingCall(prims.convert_element_type.default, (self.q, self.cast_to))


def _strip_transpose(node: Node) -> tuple[Node, bool]:
    if isinstance(node, Node) and node.target == aten.permute.default and list(node.args[1]) == [1, 0]:
        return node.args[0], True
    return node, False


def _is_zero(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and value == 0)


def _check_zero_point(dq: Dequantized, role: str) -> None:
    """An integer zero point for int8 / uint8, none for fp8 (whose GEMMs take none)."""
    if _is_zero(dq.zero_point):
        return
    if dq.dtype == FP8_DTYPE:
        raise NotFusable(f"the fp8 {role} has a zero point (a tensor qfuse cannot see into, e.g. compressed-tensors' "
                         "all-zero fp8 zero point); fp8 GEMMs take none")
    if isinstance(dq.zero_point, Node) and dtype_of(dq.zero_point).is_floating_point:
        raise NotFusable(f"the {role}'s zero point is a {dtype_of(dq.zero_point)} tensor, not an integer one")


def can_fuse_activation(dq: Dequantized) -> Granularity:
    """The activation's granularity (per tensor or per token; a per-channel dequantize along the row
    axis is per token), if an int8 / uint8 / fp8 GEMM can take it."""
    granularity = dq.granularity
    if granularity == Granularity.PER_CHANNEL:
        rank = len(shape_of(dq.q))
        if dq.axis % rank != rank - 2 or shape_of(dq.scale)[-1] != 1:
            raise NotFusable(f"the activation is dequantized per channel along axis {dq.axis}, not per token")
        granularity = Granularity.PER_TOKEN
    if granularity == Granularity.BLOCK:
        raise NotFusable("the activation is dequantized per 128x128 block; activations take per-tensor / per-token scales")
    if dq.dtype not in (torch.int8, torch.uint8, FP8_DTYPE):
        raise NotFusable(f"the activation is dequantized from {dq.dtype}; qfuse fuses int8 / uint8 / fp8 Q/DQ")
    _check_zero_point(dq, "activation")
    return granularity


def can_fuse_weight(dq: Dequantized, transposed: bool, activation_dtype: torch.dtype) -> Granularity:
    """The weight's granularity (per channel or per tensor), if it is int8 (fp8 with an fp8 activation)
    and a per-channel axis is its output channels."""
    expected = FP8_DTYPE if activation_dtype == FP8_DTYPE else torch.int8
    if dq.dtype != expected:
        raise NotFusable(f"the weight is dequantized from {dq.dtype}; with a {activation_dtype} activation "
                         f"qfuse fuses {expected} weights")
    _check_zero_point(dq, "weight")
    return weight_granularity(dq, transposed)


def weight_granularity(dq: Dequantized, transposed: bool) -> Granularity:
    """Per tensor, or per channel along the weight's output channels (NotFusable otherwise)."""
    if dq.granularity == Granularity.PER_TOKEN:
        raise NotFusable("the weight is dequantized per token; expected per-channel or per-tensor")
    if dq.granularity == Granularity.PER_CHANNEL:
        output_axis = 0 if transposed else 1
        if dq.axis % 2 != output_axis:
            raise NotFusable(
                f"the weight is dequantized per channel along axis {dq.axis}, not along its output channels"
            )
    return dq.granularity


def activation_operand(dq: Dequantized, view_shape: list | None) -> tuple:
    """(the int8 / fp8 activation operand, its zero point); a uint8 one is shifted to int8."""
    q, zero_point = dq.quantized, 0 if dq.zero_point is None else dq.zero_point
    if dq.dtype == torch.uint8:
        q, zero_point = uint8_as_int8(q, zero_point)
    if view_shape is not None:
        q = PendingCall(aten.reshape.default, (q, view_shape))
    return q, zero_point


def weight_operand(dq: Dequantized, transposed: bool) -> tuple:
    """(the weight as a [K, N] operand, its scale as one value, [N] or per block [K / 128, N / 128])."""
    b = PendingCall(aten.permute.default, (dq.quantized, [1, 0])) if transposed else dq.quantized
    scale = dq.scale
    if dq.granularity == Granularity.BLOCK:
        return b, PendingCall(aten.permute.default, (scale, [1, 0])) if transposed else scale
    if isinstance(scale, Node) and len(shape_of(scale)) == 2:  # [N, 1] / [1, N] of a fake quant
        scale = PendingCall(aten.reshape.default, (scale, [-1]))
    return b, scale


def _strip_expand(node: Node) -> Node:
    """The operand of bmm before matmul's expand (a no-op on the activation, a batch broadcast
    of the 2D weight)."""
    return node.args[0] if isinstance(node, Node) and node.target == aten.expand.default else node


def _linear_operands(anchor: Node) -> tuple[Node | None, Node, Node]:
    """(bias, activation, weight) of an mm / addmm / bmm linear."""
    if anchor.target == aten.addmm.default:
        return anchor.args[0], anchor.args[1], anchor.args[2]
    activation, weight = anchor.args[:2]
    if anchor.target == aten.bmm.default:
        activation, weight = _strip_expand(activation), _strip_expand(weight)
    return None, activation, weight


def analyze_dequantized_linear(
    anchor: Node, match: Callable[[Node], Dequantized | None], family: str
) -> FusedLinear | None:
    """A float linear whose activation and weight are both dequantized (as `match` recognises
    dequantization) -> a FusedLinear on the quantized tensors; None if neither is; NotFusable if one is."""
    bias, activation, weight = _linear_operands(anchor)
    # Inductor's shape padding (CUDA) pads the float operands with zeros; the fused op takes the
    # unpadded ones, and its result is padded back to the shape the slice after the matmul expects.
    activation, activation_padding = strip_zero_padding(activation)
    weight, weight_padding = strip_zero_padding(weight)
    bias = strip_zero_padding(bias)[0] if bias is not None else None
    activation_dq_node, view_shape = strip_views(activation)
    weight_dq_node, transposed = _strip_transpose(weight)
    activation_dq, weight_dq = match(activation_dq_node), match(weight_dq_node)
    if activation_dq is None and weight_dq is None:
        return None
    if weight_dq is None:
        raise WeightNotDequantized("the activation is dequantized but the weight is a float tensor")
    out_dtype = _check_linear(anchor, bias, activation, weight)
    padding = (activation_padding[0] if activation_padding else 0, weight_padding[1] if weight_padding else 0)
    if activation_dq is None:
        return _weight_only_linear(anchor, family, activation, weight_dq, transposed, bias, out_dtype, padding)
    activation_granularity = can_fuse_activation(activation_dq)
    weight_granularity = can_fuse_weight(weight_dq, transposed, activation_dq.dtype)
    a, activation_zero_point = activation_operand(activation_dq, view_shape)
    b, scale_b = weight_operand(weight_dq, transposed)
    fp8 = activation_dq.dtype == FP8_DTYPE
    scheme = QuantScheme(
        activation_dtype=FP8_DTYPE if fp8 else torch.int8, weight_dtype=FP8_DTYPE if fp8 else torch.int8,
        activation_granularity=activation_granularity,
        weight_granularity=weight_granularity,
        dynamic=is_dynamic_scale(activation_dq.scale),
        symmetric=_is_zero(activation_zero_point),
    )
    return FusedLinear(
        anchor=anchor, family=family,
        pattern=f"{activation_dq.kind} x {weight_dq.kind} + {anchor.target.__name__.split('.')[0]}",
        a=a, b=b, scheme=scheme, out_dtype=out_dtype, replaces=anchor,
        output_padding=padding, scale_a=activation_dq.scale, scale_b=scale_b, bias=bias,
        azp_a=None if _is_zero(activation_zero_point) else activation_zero_point,
        azp_b=None if _is_zero(weight_dq.zero_point) else weight_dq.zero_point,
        per_call_weight=weight_dq.computed_per_call,
        row_nan=rows_with_nan(activation_dq, view_shape),
    )


def rows_with_nan(dq: Dequantized, view_shape: list | None) -> PendingCall | None:
    """For a float activation of integers (a fake quant: a round and clamp chain), [..., 1]: 1, or nan in the
    rows that hold a nan. Clamped, q is an integer in range or nan (never inf); eager's float linear keeps a nan,
    the integer operand cannot, so the fused op's rows are multiplied by this (q - q is 0 or nan; their sum + 1 is
    1 or nan). A scale computed from the activation (dynamic) is nan in those rows already; None then, and for a
    q stored or cast to an integer type by the model."""
    if dq.cast_to not in (torch.int8, torch.uint8) or is_dynamic_scale(dq.scale):
        return None
    q = dq.q if view_shape is None else PendingCall(aten.reshape.default, (dq.q, view_shape))
    zeros_or_nan = PendingCall(aten.sub.Tensor, (q, q))
    return PendingCall(aten.add.Tensor, (PendingCall(aten.sum.dim_IntList, (zeros_or_nan, [-1], True)), 1))


def _check_linear(anchor: Node, bias: Node | None, activation: Node, weight: Node) -> torch.dtype:
    """The linear's output dtype, once the anchor is known to be a plain linear (NotFusable if not)."""
    if any(anchor.kwargs.get(name, 1) != 1 for name in ("beta", "alpha")):
        raise NotFusable("addmm with beta or alpha other than 1")
    if anchor.target == aten.bmm.default and (
        len(shape_of(weight)) != 2 or not same_shape(shape_of(activation), shape_of(anchor.args[0]))
    ):
        raise NotFusable("bmm of a batched weight or a broadcast activation: not a linear")
    out_dtype = dtype_of(anchor)
    if out_dtype not in OUT_DTYPES:
        raise NotFusable(f"the linear returns {out_dtype}; a fused linear returns one of {OUT_DTYPES}")
    if bias is not None and len(shape_of(bias)) != 1:
        raise NotFusable(f"addmm bias of shape {list(shape_of(bias))}; expected [N]")
    return out_dtype


def can_fuse_weight_only(activation: Node, weight_dq: Dequantized, transposed: bool) -> Granularity:
    """The weight's granularity, if a float activation times this dequantized weight is a weight-only
    linear qfuse's op computes: an int8 weight (an integer zero point allowed) or an fp8 one, per
    tensor or per output channel."""
    x_dtype = dtype_of(activation)
    if x_dtype not in FLOAT_ACTIVATION_DTYPES:
        raise NotFusable(f"the activation is a {x_dtype} tensor, neither dequantized nor a float activation")
    if weight_dq.dtype not in WEIGHT_ONLY_DTYPES:
        raise NotFusable(f"the weight is dequantized from {weight_dq.dtype}; weight-only linears take "
                         f"{' / '.join(dtype_name(dtype) for dtype in WEIGHT_ONLY_DTYPES)} weights")
    _check_zero_point(weight_dq, "weight")
    return weight_granularity(weight_dq, transposed)


def _weight_only_linear(anchor: Node, family: str, activation: Node, weight_dq: Dequantized, transposed: bool,
                        bias: Node | None, out_dtype: torch.dtype, padding: tuple[int, int]) -> FusedLinear:
    """A float activation times a dequantized weight: the weight-only linear (W8A16)."""
    granularity = can_fuse_weight_only(activation, weight_dq, transposed)
    b, scale_b = weight_operand(weight_dq, transposed)
    return FusedLinear(
        anchor=anchor, family=family, pattern=f"float x {weight_dq.kind} + {anchor.target.__name__.split('.')[0]}",
        a=activation, b=b, scheme=QuantScheme.weight_only(weight_dq.dtype, granularity, dtype_of(activation)),
        out_dtype=out_dtype, replaces=anchor, output_padding=padding, scale_b=scale_b, bias=bias,
        azp_b=None if _is_zero(weight_dq.zero_point) else weight_dq.zero_point, per_call_weight=weight_dq.computed_per_call,
    )


#: the matmuls a linear of dequantized operands is written with
ANCHORS = FLOAT_GEMMS
