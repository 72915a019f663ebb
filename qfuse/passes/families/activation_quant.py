"""activation_quant: fold a hand-written activation quantization into the fused linear.

Only for a `qfuse::scaled_mm` whose kernel quantizes the activation itself
(`Kernel.fuses_activation_quant`); for the others Inductor's generated code for the quantize
chain is as fast or faster, so it stays. The int8 / fp8 operand `a` is traced back to its
quantizer (`qfuse.passes.forms.quant_forms`: any spelling of divide / reciprocal-multiply, round,
clamp and cast; a per-token absmax scale through casts, eps clamps and `/ qmax` or `* 1/qmax`;
or a static one-value scale), and when

- the fused op's scale_a is that quantizer's scale (possibly reshaped), and
- qfuse's quantizer computes exactly what was written (bounds, rounding, scale dtype: `fold_verdict`),

the pair becomes `qfuse::quant_scaled_mm(x, ...)`: dynamic per-token (scale_a None) or static.
Otherwise the quantization stays in Inductor's code and the record's note says why.

On CUDA the other kernels' activation quant may go to qfuse's Triton quantizer instead
(`qfuse.passes.forms.triton_quantizer`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from qfuse.errors import contain_internal_error
from qfuse.kernels import get_kernel
from qfuse.ops import RECORD_KEY
from qfuse.ops.scaled_mm import QuantScaledMmArgs, ScaledMmArgs
from qfuse.passes.core.fused_linear import NotFusable, PassContext
from qfuse.passes.core.graph_utils import aten, dtype_of, insert_call, shape_of, strip_views
from qfuse.passes.forms.quant_forms import fold_verdict, match_quantize, match_token_scale
from qfuse.passes.forms.triton_quantizer import take_over_quant
from qfuse.passes.core.transaction import UndoFailed, new_nodes_removed_on_error

FAMILY = "activation_quant"
FOLDED_PATTERN = "activation quant folded into quant_scaled_mm"


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


def can_fold_quant(call: ScaledMmArgs) -> FoldableQuant:
    """How the fused call's activation was quantized, if it can fold into the GEMM; NotFusable says why not."""
    if call.scale_a is None or call.azp_a is not None or call.azp_b is not None:
        raise NotFusable("the activation has no scale of its own or carries a zero point")
    _, view_shape = strip_views(call.a)
    quantizer = match_quantize(call.a)
    if quantizer is None:
        raise NotFusable("the quantized activation is not produced by a known quantize form (divide, clamp, cast)")
    if not _same_scale(call.scale_a, quantizer.scale):
        raise NotFusable("the activation is quantized with another scale than the one the GEMM rescales by")
    dynamic = match_token_scale(quantizer.scale)
    if dynamic is None and isinstance(quantizer.scale, Node) and any(size != 1 for size in shape_of(quantizer.scale)):
        raise NotFusable("the per-token scale is computed in a form qfuse does not know")
    reason = fold_verdict(quantizer, dynamic)
    if reason:
        raise NotFusable(reason)
    if dynamic is not None:
        return FoldableQuant(quantizer.x, view_shape, None, dynamic.eps)
    return FoldableQuant(quantizer.x, view_shape, call.scale_a, 0.0)


def fold_replacement(graph: Graph, fused: Node, call: ScaledMmArgs, fold: FoldableQuant) -> Node:
    """Insert the `qfuse::quant_scaled_mm` call that takes over from `fused` (before it)."""
    with graph.inserting_before(fused):
        x = fold.x if fold.view_shape is None else insert_call(graph, aten.reshape.default, (fold.x, fold.view_shape))
        folded = QuantScaledMmArgs(
            x=x, b=call.b, scale_a=fold.static_scale, scale_b=call.scale_b, bias=call.bias,
            quant_dtype=dtype_of(call.a), eps=fold.eps, out_dtype=call.out_dtype, kernel=call.kernel,
        )
        return insert_call(graph, folded.op, folded.as_args())


def run(graph: Graph, context: PassContext) -> None:
    for fused in list(graph.find_nodes(op="call_function", target=ScaledMmArgs.op)):
        call = ScaledMmArgs.of(fused)
        if not get_kernel(call.kernel).fuses_activation_quant:
            take_over_quant(graph, fused, call, context)
            continue
        record = fused.meta.get(RECORD_KEY)
        try:
            fold = can_fold_quant(call)
            with new_nodes_removed_on_error(graph):
                replacement = fold_replacement(graph, fused, call, fold)
        except NotFusable as reason:
            if record is not None:
                record.add_note(f"activation quant not folded: {reason}")
            continue
        except UndoFailed:
            raise  # the pass manager restores the graph as it was before this family
        except Exception as error:
            if record is not None:
                record.add_note(contain_internal_error(f"folding the activation quant of {fused.name}", error,
                                                       "the activation quant is left to Inductor"))
            continue
        fused.replace_all_uses_with(replacement)
        context.report.matches[FOLDED_PATTERN] += 1
        if record is not None:
            record.pattern += " + activation quant"
            replacement.meta[RECORD_KEY] = record
