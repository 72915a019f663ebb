"""W4A8: an int4 weight-only linear whose activation is a symmetric int8 fake quant -> qfuse::w4a8_scaled_mm.

A W4A8 model (int4 weights, int8 activations quantized per token) written in plain torch
dequantizes both operands and runs a float GEMM. The weight side is what `intx_weight_only`
recognises (int4 values stored one per int8, a scale per group); here the activation side is
matched as `fake_quant_linear` matches it:

    x̂ = q * s        q integers in int8's range (a round / clamp chain, or stored int8 upcast),
                     s one value or one per token ([..., 1]); no zero point

The W4A8 linear takes the graph's own q and s (`qfuse::w4a8_scaled_mm`), so the model's quantizer
stays as it is written (torchao's scale is amax / 127.5, vLLM's amax / 127: either is exact), and
the weight-only linear is its fallback: where no kernel runs W4A8 (every machine but an Intel GPU
with vllm-xpu-kernels today), the linear is fused as int4 weight-only, on the fake-quantized float
activation, and the record's note says why.

Not W4A8, with the reason in the note of the weight-only linear: a weight that subtracts stored
zero points (W4A8 kernels take symmetric int4 weights; torchao stores zeros and subtracts them), an
activation with a zero point (asymmetric, torchao's 8da4w default) or another granularity.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from qfuse.passes.forms.fake_dequantize import match_fake_dequantize
from qfuse.passes.core.fused_linear import FusedLinear, NotFusable
from qfuse.passes.core.graph_utils import PendingCall, aten, shape_of, strip_views
from qfuse.passes.forms.dequantized_linear import activation_operand, can_fuse_activation, rows_with_nan
from qfuse.passes.forms.quant_forms import is_dynamic_scale
from qfuse.schemes import QuantScheme, dtype_name


def _token_scale(scale, view_shape):
    """The activation's scale as one value or [M, 1] for the 2D activation the GEMM reads."""
    if view_shape is None or not isinstance(scale, Node) or len(shape_of(scale) or ()) < 2:
        return scale
    return PendingCall(aten.reshape.default, (scale, [-1, 1]))


def with_int8_activation(linear: FusedLinear, x2d: Node, has_weight_zero_point: bool) -> FusedLinear:
    """The W4A8 linear (falling back to `linear`) where the activation of the int4 weight-only
    `linear` is a symmetric int8 fake quant; else `linear` itself, with a note where it nearly is."""
    activation_node, view_shape = strip_views(x2d)
    activation = match_fake_dequantize(activation_node)
    if activation is None:
        return linear
    try:
        granularity = can_fuse_activation(activation)
    except NotFusable as reason:
        return linear.noted(f"the activation is a fake quant W4A8 kernels cannot take ({reason})")
    if activation.dtype != torch.int8:
        return linear.noted(f"the activation is a {dtype_name(activation.dtype)} fake quant; W4A8 kernels take int8")
    if not (isinstance(activation.zero_point, int) and activation.zero_point == 0):
        return linear.noted("the activation is an int8 fake quant with a zero point; W4A8 kernels take symmetric "
                            "int8 activations")
    if has_weight_zero_point:
        return linear.noted("the activation is a symmetric int8 fake quant (W4A8), but the weight subtracts stored "
                            "zero points; W4A8 kernels take symmetric int4 weights")
    a, _ = activation_operand(activation, view_shape)
    weight_only = linear.scheme
    scheme = QuantScheme(
        activation_dtype=torch.int8, weight_dtype=weight_only.weight_dtype, activation_granularity=granularity,
        weight_granularity=weight_only.weight_granularity, dynamic=is_dynamic_scale(activation.scale),
        weight_group_size=weight_only.weight_group_size,
    )
    int4 = linear.int4
    return dataclasses.replace(
        linear, pattern=f"{activation.kind} x {linear.pattern}", a=a, scheme=scheme, int4=None,
        b=PendingCall(aten.permute.default, (int4.packed, [1, 0])),
        scale_a=_token_scale(activation.scale, view_shape),
        scale_b=PendingCall(aten.permute.default, (int4.scales, [1, 0])),
        fallback=linear, row_nan=rows_with_nan(activation, view_shape),
    )
