"""activation_quant: fold a hand-written activation quantization into the fused linear.

Only for a `qfuse::scaled_mm` whose kernel quantizes the activation itself
(`Kernel.fuses_activation_quant`); for the others Inductor's generated code for the quantize
chain is as fast or faster, so it stays. The int8 / fp8 operand `a` is traced back to:

    quantize   int8  clamp(round(x / s), -128 | -127, 127).to(torch.int8)
               fp8   clamp(x / s, -448, 448).to(torch.float8_e4m3fn)
    scale s    dynamic per token   amax(|x|, dim=-1, keepdim=True) [.clamp(min=eps)] / qmax
               static per tensor   a one-element tensor, or a Python number

and, when the fused op's scale_a is that same s (possibly reshaped), the pair becomes
`qfuse::quant_scaled_mm(x, ...)`: dynamic per-token (scale_a None) or static. The patterns are
traced with Inductor's `fwd_only` (decomposed like the real post-grad graph) and matched with its
pattern matcher; they are built once per process, in a fake mode.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch._inductor import pattern_matcher
from torch.fx import Graph, Node

from qfuse.kernels import get_kernel
from qfuse.passes.fused_linear import RECORD_KEY, NotFusable, PassContext
from qfuse.passes.graph_utils import aten, dtype_of, insert_call, shape_of, strip_views
from qfuse.schemes import FP8_DTYPE, symmetric_quant_max

FAMILY = "activation_quant"
FOLDED_PATTERN = "activation quant folded into quant_scaled_mm"
# Scalars traced into the scale patterns and turned back into pattern arguments.
_EPS_EXAMPLE, _QMAX_EXAMPLE = 1.2345e-5, 123.25


def _int8_quantize(x, s, low):
    return torch.clamp(torch.round(x / s), low, 127).to(torch.int8)


def _fp8_quantize(x, s):
    return torch.clamp(x / s, -448.0, 448.0).to(FP8_DTYPE)


def _amax_scale(x, qmax):
    return x.abs().amax(dim=-1, keepdim=True) / qmax


def _clamped_amax_scale(x, eps, qmax):
    return x.abs().amax(dim=-1, keepdim=True).clamp(min=eps) / qmax


@pattern_matcher.init_once_fakemode
def traced_patterns(input_device=None):
    """(quantize patterns, per-token scale patterns), traced once per process.

    `input_device` is unused: torch 2.11's `init_once_fakemode` passes it positionally."""
    x, s = torch.empty(4, 8), torch.empty(4, 1)

    def trace(fn, args, argnames, **scalars):
        graph = pattern_matcher.fwd_only(functools.partial(fn, **scalars), args)
        return pattern_matcher.fx_to_pattern(graph, argnames=argnames, scalar_workaround=scalars)

    quantize = [
        trace(functools.partial(_int8_quantize, low=-128), [x, s], ["x", "s"]),
        trace(functools.partial(_int8_quantize, low=-127), [x, s], ["x", "s"]),
        trace(_fp8_quantize, [x, s], ["x", "s"]),
    ]
    scales = [
        trace(_clamped_amax_scale, [x], ["x"], eps=_EPS_EXAMPLE, qmax=_QMAX_EXAMPLE),
        trace(_amax_scale, [x], ["x"], qmax=_QMAX_EXAMPLE),
    ]
    return quantize, scales


def _first_match(patterns, node) -> dict | None:
    for pattern in patterns:
        match = pattern.match(node)
        if pattern_matcher.is_match(match):
            return match.kwargs
    return None


def _same_scale(scale_a, s) -> bool:
    """Whether the fused op's scale_a is the quantizer's s (a reshape of it, or its constant)."""
    base, _ = strip_views(scale_a)
    if isinstance(s, Node):
        return base is s
    return isinstance(base, Node) and base.target == aten.full.default and base.args[1] == s


@dataclass
class FoldableQuant:
    x: Node  # the float activation
    view_shape: list | None  # the reshape between the quantizer and the GEMM, if any
    static_scale: Node | None  # None: dynamic per-token
    eps: float


def can_fold_quant(fused: Node) -> FoldableQuant:
    """How `fused`'s activation was quantized, if it can fold into the GEMM; NotFusable says why not."""
    a, scale_a, azp_a, azp_b = fused.args[0], fused.args[2], fused.args[5], fused.args[6]
    if scale_a is None or azp_a is not None or azp_b is not None:
        raise NotFusable("the activation has no scale of its own or carries a zero point")
    quantized, view_shape = strip_views(a)
    quantize_patterns, scale_patterns = traced_patterns()
    found = _first_match(quantize_patterns, quantized)
    if found is None:
        raise NotFusable("the quantized activation is not produced by a known quantize form (round/clamp/cast)")
    if not _same_scale(scale_a, found["s"]):
        raise NotFusable("the activation is quantized with another scale than the one the GEMM rescales by")
    x, s = found["x"], found["s"]
    dynamic = _first_match(scale_patterns, s) if isinstance(s, Node) else None
    if dynamic is not None:
        eps, qmax = dynamic.get("eps", 0.0), symmetric_quant_max(dtype_of(quantized))
        if dynamic["x"] is not x:
            raise NotFusable("the per-token scale is computed from another tensor than the one quantized")
        if dynamic["qmax"] != qmax:
            raise NotFusable(f"the per-token scale divides by {dynamic['qmax']}, not {qmax:g}")
        if not isinstance(eps, (int, float)) or eps < 0:
            raise NotFusable(f"the per-token scale is clamped to {eps}, not a non-negative number")
        return FoldableQuant(x, view_shape, None, float(eps))
    if isinstance(s, Node) and any(size != 1 for size in shape_of(s)):
        raise NotFusable("the per-token scale is computed in a form qfuse does not know")
    return FoldableQuant(x, view_shape, scale_a, 0.0)


def run(graph: Graph, context: PassContext) -> None:
    for fused in list(graph.find_nodes(op="call_function", target=torch.ops.qfuse.scaled_mm.default)):
        if not get_kernel(fused.args[8]).fuses_activation_quant:
            continue
        record = fused.meta.get(RECORD_KEY)
        try:
            fold = can_fold_quant(fused)
        except NotFusable as reason:
            if record is not None:
                record.note = "; ".join(filter(None, [record.note, f"activation quant not folded: {reason}"]))
            continue
        b, _, scale_b, bias, _, _, out_dtype, kernel = fused.args[1:]
        with graph.inserting_before(fused):
            x = fold.x if fold.view_shape is None else insert_call(graph, aten.reshape.default, (fold.x, fold.view_shape))
            replacement = insert_call(graph, torch.ops.qfuse.quant_scaled_mm.default, (
                x, b, fold.static_scale, scale_b, bias, dtype_of(fused.args[0]), fold.eps, out_dtype, kernel,
            ))
        fused.replace_all_uses_with(replacement)
        context.report.matches[FOLDED_PATTERN] += 1
        if record is not None:
            record.pattern += " + activation quant"
            replacement.meta[RECORD_KEY] = record
