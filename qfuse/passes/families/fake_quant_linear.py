"""fake_quant_linear: a float linear of fake-quantized operands, in plain torch -> qfuse::scaled_mm.

QAT code, compressed-tensors and hand-written models quantize and dequantize in float ("fake
quant") and then run a float GEMM. Each operand of the `mm` / `addmm` / `bmm` (under the same
views, transposes and shape padding as `pt2e_linear`) is a dequantize:

    x̂ = (q - zp) * s        or   q * s        (mul in either order; zp a tensor or a number)

where q holds integers, as one of

    q_int.to(float)                                  a stored int8 / uint8 weight upcast
    round / clamp chain, e.g. clamp(round(x / s) + zp, lo, hi), clamp(x / s + zp, lo, hi).round()
                                                     integers in [lo, hi] within int8 / uint8, also
                                                     with casts between 16- and 32-bit floats inside or
                                                     after the chain (exact for those integers)
    q_fp8.to(float), x.to(fp8).to(float)             fp8 values

and the dequantize may be computed in float32 and cast to the activation's dtype after. Scales
must be one value, per row of the activation ([..., M, 1]) or per output channel of the weight
([N, 1] for a stored [N, K] weight), or (weights only) one per 128 x 128 block, expanded to the
weight by `repeat_interleave` or by a blocked view (`qfuse.passes.forms.block_scales`: the dequantize of
the fp8 block checkpoints, W8A16).

Only the dequantize side matters for the math: whatever produced q, (q - zp) * s is the operand,
so q cast to int8 (exact: integers in range) or the fp8 tensor goes into the integer / fp8 GEMM
and zp, s become the fused op's zero point and scale.
A weight computed from a float weight on every call (weight fake quant) is quantized anew each
call, as the original graph does; kernels that repack their weight once decline it.

What is not matched: a round without a clamp (the values may leave int8), clamp bounds that are
not integers or not constants, a scale that is not one of the shapes above.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from qfuse.passes.forms.dequantized_linear import ANCHORS, WeightNotDequantized, analyze_dequantized_linear
from qfuse.passes.forms.fake_dequantize import (float_cast_of_computed_value, group_size_of, is_float_cast,
                                          match_fake_dequantize, quantized_values, rounds)
from qfuse.passes.core.fused_linear import FusedLinear, NotFusable, PassContext, fuse_anchored_linears
from qfuse.passes.core.graph_utils import VIEW_OPS, aten, dtype_of, is_call, is_subtraction, shape_of

FAMILY = "fake_quant_linear"
def _weight_scaled_another_way(anchor: Node) -> str:
    """Why the weight of a linear nothing matched looks dequantized but is not provably so ('' when it
    does not look dequantized at all): stored quantized values times a scale of no shape above, such
    as one per group of input channels in a form `intx_weight_only` did not take, or a dequantize
    cast to float16 after it was computed in float32."""
    weight = anchor.args[2] if anchor.target == aten.addmm.default else anchor.args[1]
    if isinstance(weight, Node) and weight.target == aten.permute.default:
        weight = weight.args[0]
    if float_cast_of_computed_value(weight) == torch.float16 and match_fake_dequantize(weight.args[0]) is not None:
        return ("the weight is dequantized in float32 and cast to float16, where a value beyond float16's range "
                "is inf in eager: not rewritten (the fused op would not round it there)")
    if is_float_cast(weight):
        weight = weight.args[0]
    viewed = is_call(weight, *VIEW_OPS)
    while is_call(weight, *VIEW_OPS):  # groups: [N, K / g, g] values viewed back to [N, K]
        weight = weight.args[0]
    if not isinstance(weight, Node) or weight.target != aten.mul.Tensor:
        return ""
    for values, scale in (weight.args, weight.args[::-1]):
        zero_point = ""
        if is_subtraction(values):
            values, zero_point = values.args[0], " minus a zero point"
        found = quantized_values(values)
        if found is None or not isinstance(scale, Node):
            continue
        group = group_size_of(scale, shape_of(weight))
        if group is not None:
            why = ("qfuse's int8 / fp8 kernels take one scale, one per channel or per 128x128 block, not per group"
                   + (", and int8 values by groups (int4 in int8, `intx_weight_only`) only as torchao writes them: "
                      "stored [N, K] values viewed [N, K / g, g], minus stored int8 zero points, times stored scales "
                      "[N, K / g] in the activation's dtype" if found[1] is None and dtype_of(found[0]) == torch.int8
                      else ""))
            return (f"the weight is {found[2]}{zero_point} times one scale per group of {group} input channels "
                    f"(scale {list(shape_of(scale))} against values {list(shape_of(weight))}): {why}")
        if not viewed:
            return (f"the weight is {found[2]}{zero_point} times a scale of shape {list(shape_of(scale))}, neither one value, "
                    "per channel, nor 128x128 blocks expanded to the weight")
    return ""


def analyze(anchor: Node) -> FusedLinear | None:
    try:
        linear = analyze_dequantized_linear(anchor, match_fake_dequantize, FAMILY)
    except WeightNotDequantized:  # say what the weight is, where it looks quantized
        if reason := _weight_scaled_another_way(anchor):
            raise NotFusable(reason) from None
        raise
    if linear is None and (reason := _weight_scaled_another_way(anchor)):
        raise NotFusable(reason)
    activation = anchor.args[1] if anchor.target == aten.addmm.default else anchor.args[0]
    if linear is not None and linear.scheme.is_weight_only and rounds(activation):
        linear.note = ("the activation is rounded like a fake quant, but not provably into int8 / uint8 (no clamp "
                       "to integer bounds within their range) or its scale is not one value / one per token: "
                       "the linear runs weight-only, on the float activation")
    return linear


def run(graph: Graph, context: PassContext) -> None:
    fuse_anchored_linears(graph, context, FAMILY, ANCHORS, analyze)
