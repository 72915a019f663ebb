"""Fake quant's dequantize, written in plain torch: `match_fake_dequantize(node)` reads

    x̂ = (q - zp) * s        or   q * s        (mul in either order; zp a tensor or a number)

with q integers (a stored int8 / uint8 upcast, or a round / clamp chain into int8 / uint8's range) or
fp8 values, and a scale of one value, one per row, one per output channel or (weights) one per 128 x 128
block (`block_scales`), as a `Dequantized`; `fake_quant_linear`'s docstring gives the forms in full. A
form module: `fake_quant_linear` and `w4a8` read dequantizes with it.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from qfuse.passes.forms.block_scales import match_block_dequantize
from qfuse.passes.forms.dequantized_linear import Dequantized
from qfuse.passes.core.graph_utils import (aten, converted_dtype, dtype_of, is_subtraction, same_size,
                                     shape_of)
from qfuse.passes.forms.quant_forms import constant_number, strip_round_and_clamps
from qfuse.schemes import FP8_DTYPE, Granularity

_INTEGER_RANGES = ((torch.int8, -128, 127), (torch.uint8, 0, 255))


def _integer_valued(node) -> tuple[Node, torch.dtype | None, str] | None:
    """(q, the dtype to cast it to or None if it is already quantized, kind) when `node` is a float
    tensor holding quantized values."""
    if not isinstance(node, Node):
        return None
    target = converted_dtype(node)
    if target is not None and target.is_floating_point:
        source = node.args[0]
        if dtype_of(source) in (torch.int8, torch.uint8, FP8_DTYPE):
            return source, None, f"{dtype_of(source)}.to(float)".replace("torch.", "")
        if _float_to_float(node):
            return _integer_valued(source)  # integers in int8 / uint8's range are exact in 16-bit floats
        return None
    value, low, high, rounded = strip_round_and_clamps(node)
    while not rounded and _float_to_float(value):  # round in bf16, clamp in float32: the values stay integers
        value, inner_low, inner_high, rounded = strip_round_and_clamps(value.args[0])
        low, high = inner_low if low is None else low, inner_high if high is None else high
    if not rounded and isinstance(value, Node) and value.target == aten.add.Tensor:  # clamp(round(x / s) + zp)
        rounded = any(isinstance(arg, Node) and arg.target == aten.round.default for arg in value.args)
    if not rounded or low is None or high is None or low != int(low) or high != int(high):
        return None
    for dtype, qmin, qmax in _INTEGER_RANGES:
        if qmin <= low and high <= qmax:
            return node, dtype, "fake quant (round, clamp)"
    return None


_EXACT_FOR_INT8 = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # every int8 / uint8 integer exact


def _float_to_float(node) -> bool:
    """A cast between float dtypes of 16 bits or more: integers in int8 / uint8's range stay exact, and
    a value beyond the range stays beyond it (a clamp after the cast still bounds it). Not an 8-bit
    float: fp8 rounds 127 to 128."""
    target = converted_dtype(node) if isinstance(node, Node) else None
    return target in _EXACT_FOR_INT8 and dtype_of(node.args[0]) in _EXACT_FOR_INT8


def _fp8_round_trip(node) -> tuple[Node, None, str] | None:
    """x.to(fp8).to(float): q is the fp8 tensor."""
    if isinstance(node, Node) and converted_dtype(node) is not None and converted_dtype(node).is_floating_point:
        inner = node.args[0]
        if isinstance(inner, Node) and converted_dtype(inner) == FP8_DTYPE:
            return inner, None, "fake quant (fp8 round trip)"
    return None


def _scale_granularity(scale, operand: Node) -> tuple[Granularity, int | None] | None:
    """(granularity, channel axis) of a dequantize scale against the operand it multiplies: per row
    is PER_CHANNEL along the row axis (per token for an activation, per output channel for an
    [N, K] weight: `pt2e_linear` reads it by the operand's role)."""
    if constant_number(scale) is not None:
        return Granularity.PER_TENSOR, None
    shape, operand_shape = shape_of(scale), shape_of(operand)
    if shape is None or not dtype_of(scale).is_floating_point or len(shape) > len(operand_shape):
        return None
    rank = len(operand_shape)
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    if all(same_size(size, 1) for size in padded):
        return Granularity.PER_TENSOR, None
    if same_size(padded[-1], 1) and all(same_size(a, b) for a, b in zip(padded[:-1], operand_shape[:-1])):
        return Granularity.PER_CHANNEL, rank - 2
    if rank == 2 and same_size(padded[0], 1) and same_size(padded[1], operand_shape[1]):
        return Granularity.PER_CHANNEL, 1
    return None


def quantized_values(value) -> tuple[Node, torch.dtype | None, str] | None:
    return _integer_valued(value) or _fp8_round_trip(value)


def match_fake_dequantize(node) -> Dequantized | None:
    """(q - zp) * s in plain torch ops, as described in the module docstring; else None."""
    if is_float_cast(node):  # dequantized in float32, then cast to the activation's dtype
        node = node.args[0]
    if (block := match_block_dequantize(node, quantized_values)) is not None:
        return block
    if not isinstance(node, Node) or node.target != aten.mul.Tensor:
        return None
    for value, scale in (node.args, node.args[::-1]):
        zero_point = 0
        if is_subtraction(value):
            value, zero_point = value.args[0], _integer_zero_point(value.args[1])
            if zero_point is None:
                continue
        found = quantized_values(value)
        granularity = _scale_granularity(scale, node) if found is not None else None
        if granularity is None:
            continue
        q, cast_to, kind = found
        return Dequantized(q, scale, zero_point, granularity[0], kind, axis=granularity[1], cast_to=cast_to)
    return None


def float_cast_of_computed_value(node) -> torch.dtype | None:
    """The target dtype when `node` casts a computed float value to another float dtype (a stored
    weight's own cast is no dequantize), else None."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    target, source = converted_dtype(node), node.args[0]
    computed_float = (isinstance(source, Node) and source.op == "call_function" and dtype_of(source) is not None
                      and dtype_of(source).is_floating_point)
    return target if computed_float and target is not None and target.is_floating_point else None


def is_float_cast(node) -> bool:
    """A dequantize cast to bf16 / fp32 after it. Not to fp16: a product beyond fp16's range is inf
    in eager, and the fused op would not round it there."""
    return float_cast_of_computed_value(node) in (torch.bfloat16, torch.float32)


def _integer_zero_point(value):
    """The zero point subtracted: a number, or the tensor under a float upcast (`zp.to(float)`) or
    used as it is; None for a fractional number. A floating-point tensor is returned too (the
    caller names it in the near miss: a GEMM takes integer zero points only)."""
    if (number := constant_number(value)) is not None:
        return int(number) if number == int(number) else None
    if isinstance(value, Node) and converted_dtype(value) is not None and dtype_of(value.args[0]) is not None:
        return value.args[0]
    return value if isinstance(value, Node) and dtype_of(value) is not None else None


def rounds(node, depth: int = 6) -> bool:
    """Whether a round sits within a few ops above `node` (it looks like a fake quant)."""
    if not isinstance(node, Node) or depth == 0:
        return False
    return node.target == aten.round.default or any(rounds(arg, depth - 1) for arg in node.all_input_nodes)


def group_size_of(scale: Node, values_shape) -> int | None:
    """g when `scale` [N, K / g, 1] multiplies values viewed as [N, K / g, g] (one scale per group of
    g input channels), else None."""
    shape = shape_of(scale)
    if (values_shape is None or shape is None or len(shape) != 3 or len(values_shape) != 3
            or not same_size(shape[-1], 1) or not all(same_size(a, b) for a, b in zip(shape[:2], values_shape[:2]))):
        return None
    return values_shape[2]
