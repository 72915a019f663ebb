"""pt2e_linear: a PT2E Q/DQ linear (torch.ops.quantized_decomposed) -> qfuse::scaled_mm.

Plain Inductor (without freezing) dequantizes the weight to float on every call and runs a float
GEMM. This pass feeds the integer tensors straight into a real int8 GEMM instead, on CPU and GPU:

    linear      mm(A, B) | addmm(bias, A, B)            (3D inputs: A = reshape(...); operands
                                                         zero-padded by Inductor's shape padding)
                | bmm(expand(A), expand(B))              (3D inputs that are not contiguous)
    activation  A = dequantize_per_tensor(q, scale, zero_point, ...)     .default: Python numbers
                  | dequantize_per_tensor.tensor(q, scale, zero_point, ...)        tensors
                  | dequantize_per_token(q, scales, zero_points, ...)              per token
    weight      B = permute(dequantize_per_channel(w_q, scales, zero_points, axis=0, ...), [1, 0])
                  | permute(dequantize_per_tensor(w_q, scale, zero_point, ...), [1, 0])
                  (or without the permute for a [K, N] weight, per-channel axis 1)

Only the dequantize side matters for the math: q and w_q are integer tensors and
dequantize(q) = (q - zero_point) * scale, whoever produced q (the activation quantize op stays in
the graph, where Inductor generates code for it). uint8 activations are shifted to int8 (q - 128,
zero_point - 128). Zero points go to the fused op (`azp_a`, `azp_b`), so asymmetric activations
and weights are exact.

`can_fuse_*` checks: int8 / uint8 activation, int8 weight, per-channel axis on the output
channels, addmm without beta / alpha, a float result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from qfuse.ops.scaled_mm import OUT_DTYPES
from qfuse.passes.fused_linear import FusedLinear, NotFusable, PassContext, fuse_anchored_linears
from qfuse.passes.graph_utils import (
    aten,
    dtype_of,
    insert_call,
    prims,
    same_shape,
    shape_of,
    strip_views,
    strip_zero_padding,
)
from qfuse.passes.quant_forms import is_dynamic_scale
from qfuse.schemes import Granularity, QuantScheme


def _decomposed():
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)

    return torch.ops.quantized_decomposed


FAMILY = "pt2e_linear"


@dataclass
class Dequantized:
    """(q - zero_point) * scale, as found in the graph."""

    q: Node
    scale: Node | float
    zero_point: Node | int
    granularity: Granularity
    kind: str  # for the pattern name
    axis: int | None = None


def match_dequantize(node) -> Dequantized | None:
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    qd = _decomposed()
    target = node.target
    if target in (qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor):
        kind = "dq_per_tensor" + (".tensor" if target == qd.dequantize_per_tensor.tensor else "")
        return Dequantized(node.args[0], node.args[1], node.args[2], Granularity.PER_TENSOR, kind)
    if target == qd.dequantize_per_token.default:
        return Dequantized(node.args[0], node.args[1], node.args[2], Granularity.PER_TOKEN, "dq_per_token")
    if target == qd.dequantize_per_channel.default:
        return Dequantized(
            node.args[0], node.args[1], node.args[2], Granularity.PER_CHANNEL, "dq_per_channel", axis=node.args[3]
        )
    return None


def _strip_transpose(node: Node) -> tuple[Node, bool]:
    if isinstance(node, Node) and node.target == aten.permute.default and list(node.args[1]) == [1, 0]:
        return node.args[0], True
    return node, False


def _is_zero(value) -> bool:
    return isinstance(value, int) and value == 0


def can_fuse_activation(graph: Graph, dq: Dequantized, view_shape: list | None, before: Node):
    """The int8 activation operand and its zero point (uint8 is shifted to int8)."""
    dtype = dtype_of(dq.q)
    if dtype not in (torch.int8, torch.uint8):
        raise NotFusable(f"the activation is dequantized from {dtype}; qfuse fuses int8 / uint8 Q/DQ")
    q, zero_point = dq.q, dq.zero_point
    with graph.inserting_before(before):
        if dtype == torch.uint8:
            widened = insert_call(graph, prims.convert_element_type.default, (q, torch.int16))
            shifted = insert_call(graph, aten.sub.Tensor, (widened, 128))
            q = insert_call(graph, prims.convert_element_type.default, (shifted, torch.int8))
            zero_point = zero_point - 128 if isinstance(zero_point, int) else insert_call(
                graph, aten.sub.Tensor, (zero_point, 128)
            )
        if view_shape is not None:
            q = insert_call(graph, aten.reshape.default, (q, view_shape))
    return q, zero_point


def can_fuse_weight(graph: Graph, dq: Dequantized, transposed: bool, before: Node) -> Node:
    """The int8 weight as a [K, N] operand; the per-channel axis must be the output channels."""
    if dtype_of(dq.q) != torch.int8:
        raise NotFusable(f"the weight is dequantized from {dtype_of(dq.q)}; qfuse fuses int8 weights")
    if dq.granularity == Granularity.PER_TOKEN:
        raise NotFusable("the weight is dequantized per token; expected per-channel or per-tensor")
    if dq.granularity == Granularity.PER_CHANNEL:
        output_axis = 0 if transposed else 1
        if dq.axis % 2 != output_axis:
            raise NotFusable(
                f"the weight is dequantized per channel along axis {dq.axis}, not along its output channels"
            )
    if not transposed:
        return dq.q
    with graph.inserting_before(before):
        return insert_call(graph, aten.permute.default, (dq.q, [1, 0]))


def _strip_expand(node: Node) -> Node:
    """The operand of bmm before matmul's expand (a no-op on the activation, a batch broadcast
    of the 2D weight)."""
    return node.args[0] if isinstance(node, Node) and node.target == aten.expand.default else node


def _linear_operands(anchor: Node) -> tuple[Node | None, Node, Node]:
    """(bias, activation, weight) of an mm / addmm / bmm linear."""
    if anchor.target == aten.addmm.default:
        if any(anchor.kwargs.get(name, 1) != 1 for name in ("beta", "alpha")):
            raise NotFusable("addmm with beta or alpha other than 1")
        return anchor.args[0], anchor.args[1], anchor.args[2]
    activation, weight = anchor.args[:2]
    if anchor.target == aten.bmm.default:
        activation, weight = _strip_expand(activation), _strip_expand(weight)
    return None, activation, weight


def analyze(graph: Graph, anchor: Node) -> FusedLinear | None:
    bias, activation, weight = _linear_operands(anchor)
    # Inductor's shape padding (CUDA) pads the float operands with zeros; the fused op takes the
    # unpadded ones, and its result is padded back to the shape the slice after the matmul expects.
    activation, activation_padding = strip_zero_padding(activation)
    weight, weight_padding = strip_zero_padding(weight)
    bias = strip_zero_padding(bias)[0] if bias is not None else None
    activation_dq_node, view_shape = strip_views(activation)
    weight_dq_node, transposed = _strip_transpose(weight)
    activation_dq, weight_dq = match_dequantize(activation_dq_node), match_dequantize(weight_dq_node)
    if activation_dq is None and weight_dq is None:
        return None
    if activation_dq is None:
        raise NotFusable("the weight is dequantized but the activation is not (weight-only quantization)")
    if weight_dq is None:
        raise NotFusable("the activation is dequantized but the weight is a float tensor")
    if anchor.target == aten.bmm.default and (
        len(shape_of(weight)) != 2 or not same_shape(shape_of(activation), shape_of(anchor.args[0]))
    ):
        raise NotFusable("bmm of a batched weight or a broadcast activation: not a linear")
    out_dtype = dtype_of(anchor)
    if out_dtype not in OUT_DTYPES:
        raise NotFusable(f"the linear returns {out_dtype}; a fused linear returns one of {OUT_DTYPES}")
    if bias is not None and len(shape_of(bias)) != 1:
        raise NotFusable(f"addmm bias of shape {list(shape_of(bias))}; expected [N]")
    b = can_fuse_weight(graph, weight_dq, transposed, anchor)
    a, activation_zero_point = can_fuse_activation(graph, activation_dq, view_shape, anchor)
    scheme = QuantScheme(
        activation_dtype=torch.int8, weight_dtype=torch.int8,
        activation_granularity=activation_dq.granularity,
        weight_granularity=(
            Granularity.PER_CHANNEL if weight_dq.granularity == Granularity.PER_CHANNEL else Granularity.PER_TENSOR
        ),
        dynamic=is_dynamic_scale(activation_dq.scale),
        symmetric=_is_zero(activation_zero_point),
    )
    return FusedLinear(
        anchor=anchor, family=FAMILY,
        pattern=f"{activation_dq.kind} x {weight_dq.kind} + {anchor.target.__name__.split('.')[0]}",
        a=a, b=b, scheme=scheme, out_dtype=out_dtype, replaces=anchor,
        output_padding=(activation_padding[0] if activation_padding else 0, weight_padding[1] if weight_padding else 0),
        scale_a=activation_dq.scale, scale_b=weight_dq.scale, bias=bias,
        azp_a=None if _is_zero(activation_zero_point) else activation_zero_point,
        azp_b=None if _is_zero(weight_dq.zero_point) else weight_dq.zero_point,
    )


ANCHORS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def run(graph: Graph, context: PassContext) -> None:
    fuse_anchored_linears(graph, context, FAMILY, ANCHORS, analyze)
