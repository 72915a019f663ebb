"""Activation quantization, recognised by what it computes rather than by one spelling.

    quantize      q = cast(clamp(round(x / s), qmin, qmax), int8)      round optional;
                  q = cast(clamp(x / s, qmin, qmax), fp8)              clamp_min / clamp_max in
                                                                       either order, or clamp
                  x / s may be written x * (1 / s), x * s.reciprocal() or x * r for a number r
    per-token s   amax(|x|, -1, keepdim=True) | max(|x|, -1, keepdim=True).values,
                  through any casts, then optionally clamp(min=eps) / clamp_min(eps) /
                  maximum(eps), then / qmax or * (1 / qmax); or the eps clamp after the division

`match_quantize` and `match_token_scale` return what was written, bounds, eps and dtypes exactly;
`fold_verdict` says whether a kernel's own quantizer (`reference_math.dynamic_quant` /
`static_quant`: divide, round half to even for int8, clamp at the dtype's full range, the scale
computed in x's dtype) reproduces it bit for bit. Only then may the quantization move into the
kernel; otherwise it stays in Inductor's generated code, which computes exactly what was written.
"""

from __future__ import annotations

import operator
from collections import deque
from dataclasses import dataclass

import torch
from torch.fx import Node

from qfuse.passes.core.graph_utils import (
    CONSTANT_OPS,
    PendingCall,
    aten,
    converted_dtype,
    dtype_of,
    shape_of,
    strip_views,
)
from qfuse.schemes import FP8_DTYPE, quant_range, symmetric_quant_max

QUANTIZED = (torch.int8, FP8_DTYPE)
_CLAMPS = (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default,
           aten.clamp_min.Tensor, aten.clamp_max.Tensor, aten.clamp.Tensor)
_REDUCTIONS = {aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim, aten.aminmax.default,
               aten.max.default, aten.min.default}


@dataclass(frozen=True)
class Quantizer:
    """q = cast(clamp(round?(x / scale), qmin, qmax), dtype), as the graph writes it."""

    x: Node
    scale: Node | float  # the s that x is divided by (under a reciprocal, if written so)
    dtype: torch.dtype
    qmin: float | None  # None: not clamped from below
    qmax: float | None
    rounds: bool
    by_reciprocal: bool  # x * (1 / s) rounds differently from x / s


@dataclass(frozen=True)
class TokenScale:
    """s = max(amax(|x|, -1), eps) / divisor (or max(amax / divisor, eps)), computed in `dtype`."""

    x: Node
    eps: float
    divisor: float
    by_reciprocal: bool
    dtype: torch.dtype
    eps_after_divide: bool = False


def float_source(node):
    """`node` under exact float upcasts (amax commutes with them)."""
    while isinstance(node, Node) and (target := converted_dtype(node)) is not None and target.is_floating_point:
        source = dtype_of(node.args[0])
        if source is None or not source.is_floating_point or source.itemsize > target.itemsize:
            break
        if source.itemsize == target.itemsize and source != target:
            break  # fp16 <-> bf16 rounds: not an upcast
        node = node.args[0]
    return node


def constant_number(value) -> float | None:
    """A Python number, or the value of a 0-dim constant node (`full([], v)`, `ones([])`); else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, Node) and value.target in CONSTANT_OPS and not shape_of(value):
        return float(value.args[1]) if value.target == aten.full.default else 1.0
    return None


def _divisor(node) -> tuple[Node, Node | float, bool] | None:
    """(numerator, divisor, written as a reciprocal multiply) of a division-like node."""
    if not isinstance(node, Node):
        return None
    if node.target == aten.div.Tensor and "rounding_mode" not in node.kwargs:
        return node.args[0], node.args[1], False
    if node.target == aten.mul.Tensor:
        for value, other in (node.args, node.args[::-1]):
            if isinstance(other, Node) and other.target == aten.reciprocal.default:
                return value, other.args[0], True
            if (number := constant_number(other)) is not None and number != 0 and isinstance(value, Node):
                return value, 1.0 / number, True
    return None


def match_quantize(node) -> Quantizer | None:
    """The quantizer that produced the int8 / fp8 tensor `node` (under views), or None."""
    node, _ = strip_views(node)
    dtype = converted_dtype(node) if isinstance(node, Node) else None
    if dtype not in QUANTIZED:
        return None
    value, low, high, rounds = strip_round_and_clamps(node.args[0])
    division = _divisor(value)
    if division is None or not isinstance(division[0], Node):
        return None
    x, scale, by_reciprocal = division
    return Quantizer(x, scale, dtype, low, high, rounds, by_reciprocal)


def is_round_or_clamp(node) -> bool:
    return isinstance(node, Node) and (node.target in _CLAMPS or node.target == aten.round.default)


def strip_round_and_clamps(value) -> tuple[object, float | None, float | None, bool]:
    """(what is under a chain of round / clamp nodes, its low and high bounds, whether it rounds);
    the outermost clamp of each side is the one that holds."""
    low, high, rounds = None, None, False
    while is_round_or_clamp(value):
        if value.target == aten.round.default:
            rounds = True
        else:
            clamp_low, clamp_high = clamp_bounds(value)
            low = clamp_low if low is None else low
            high = clamp_high if high is None else high
        value = value.args[0]
    return value, low, high, rounds


def clamp_bounds(node: Node) -> tuple[float | None, float | None]:
    """(low, high) of a clamp node; a bound that is a tensor other than a 0-dim constant is None."""
    args = list(node.args[1:]) + [None, None]
    if node.target in (aten.clamp_min.default, aten.clamp_min.Tensor):
        return constant_number(args[0]), None
    if node.target in (aten.clamp_max.default, aten.clamp_max.Tensor):
        return None, constant_number(args[0])
    low = node.kwargs.get("min", args[0])
    high = node.kwargs.get("max", args[1])
    return constant_number(low), constant_number(high)


def _lower_clamp(node) -> tuple[Node, float] | None:
    """(input, eps) of clamp_min(y, eps) / clamp(y, min=eps) / maximum(y, eps), else None."""
    if not isinstance(node, Node):
        return None
    if node.target == aten.clamp.default:
        low, high = clamp_bounds(node)
        return (node.args[0], low) if low is not None and high is None else None
    if node.target in (aten.clamp_min.default, aten.maximum.default):
        low = constant_number(node.args[1])
        return (node.args[0], low) if low is not None else None
    return None


def match_token_scale(scale) -> TokenScale | None:
    """The per-token absmax scale `scale` computes, or None."""
    eps_after_divide, eps = False, 0.0
    if (clamped := _lower_clamp(float_source(scale))) is not None:
        (scale, eps), eps_after_divide = clamped, True
    division = _divisor(scale)
    if division is None or (divisor := constant_number(division[1])) is None:
        return None
    numerator, _, by_reciprocal = division
    if by_reciprocal:
        divisor = 1.0 / divisor
    value = float_source(numerator)
    if not eps_after_divide and (clamped := _lower_clamp(value)) is not None:
        value, eps = float_source(clamped[0]), clamped[1]
    if isinstance(value, Node) and value.target == operator.getitem and value.args[1] == 0:
        value = value.args[0]  # max(dim).values
    if not (isinstance(value, Node) and value.target in (aten.amax.default, aten.max.dim)):
        return None
    dims = value.args[1] if len(value.args) > 1 else value.kwargs.get("dim")
    keepdim = value.args[2] if len(value.args) > 2 else value.kwargs.get("keepdim", False)
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    source = float_source(value.args[0])
    if not (isinstance(source, Node) and source.target == aten.abs.default) or not keepdim:
        return None
    rank = len(shape_of(source))
    if [dim % rank for dim in dims] != [rank - 1]:
        return None
    return TokenScale(source.args[0], eps, divisor, by_reciprocal, dtype_of(scale), eps_after_divide)


def fold_verdict(quantizer: Quantizer, dynamic: TokenScale | None) -> str:
    """'' if qfuse's quantizer computes exactly what `quantizer` (with the per-token scale `dynamic`,
    or a static one) computes; else why not."""
    low, high = quant_range(quantizer.dtype)
    if (quantizer.qmin, quantizer.qmax) != (low, high):
        return (f"it clamps to [{quantizer.qmin}, {quantizer.qmax}]; qfuse's quantizer clamps {quantizer.dtype} "
                f"to [{low:g}, {high:g}]")
    if quantizer.rounds != (quantizer.dtype == torch.int8):
        return "it rounds before the fp8 cast" if quantizer.rounds else "it truncates (no round) before the int8 cast"
    if quantizer.by_reciprocal:
        return "it multiplies by the reciprocal of the scale, which rounds differently from dividing"
    if dynamic is None:
        return ""
    qmax = symmetric_quant_max(quantizer.dtype)
    if float_source(dynamic.x) is not float_source(quantizer.x):
        return "the per-token scale is computed from another tensor than the one quantized"
    if dynamic.divisor != qmax or dynamic.by_reciprocal:
        written = f"* {1 / dynamic.divisor!r}" if dynamic.by_reciprocal else f"/ {dynamic.divisor!r}"
        return f"the per-token scale is amax {written}, not amax / {qmax:g}"
    if dynamic.eps_after_divide:
        return "the per-token scale is clamped after dividing by qmax; qfuse's quantizer clamps amax first"
    if dynamic.dtype != dtype_of(quantizer.x):
        return (f"the per-token scale is computed in {dynamic.dtype}, the activation is divided in "
                f"{dtype_of(quantizer.x)}; qfuse's quantizer computes both in one dtype")
    if dynamic.eps < 0:
        return f"the per-token scale is clamped to {dynamic.eps}, not a non-negative number"
    return ""


def is_dynamic_scale(value, limit: int = 64) -> bool:
    """Whether a scale is computed from the data at run time (it depends on a reduction such as
    amax, or on PT2E's choose_qparams), rather than being a stored or constant value."""
    pending, seen = deque([value]), set()
    while pending and len(seen) < limit:
        node = pending.popleft()
        if not isinstance(node, Node) or node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and (node.target in _REDUCTIONS or "choose_qparams" in str(node.target)):
            return True
        pending.extend(arg for arg in node.all_input_nodes)
    return False


def uint8_as_int8(q_uint8, zero_point) -> tuple[PendingCall, int | PendingCall]:
    """(q - 128 as int8, zero_point - 128): the same dequantized values, for an int8 GEMM. q - 128
    is computed as q ^ 0x80 read as int8 (exact, and Inductor's CPU code vectorizes it)."""
    as_int8 = PendingCall(aten.view.dtype, (q_uint8, torch.int8))
    shifted = PendingCall(aten.bitwise_xor.Scalar, (as_int8, -128))
    if isinstance(zero_point, int):
        return shifted, zero_point - 128
    return shifted, PendingCall(aten.sub.Tensor, (zero_point, 128))
