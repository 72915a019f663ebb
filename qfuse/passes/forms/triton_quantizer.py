"""triton_quantizer: on CUDA, hand a fused linear's activation quant to qfuse's Triton quantizer.

Inductor generates the per-token quant as a reduction (amax, then a second pass to quantize) that
runs well short of the HBM floor; qfuse's one-pass kernel runs at the floor
(measured: docs/benchmarks.md, "The activation quant on qfuse's Triton quantizers, inside Inductor's code").
So on CUDA, for a `qfuse::scaled_mm` whose kernel does not quantize by itself, a dynamic per-token
quant that qfuse's quantizer computes exactly (`quant_forms.fold_verdict`: bounds, rounding, eps, the
scale's dtype), computed in float32, is replaced by

    qfuse::dynamic_quant(x, ..., kernel="triton")           x a graph input, a GEMM's or attention's
                                                            output: nothing for Inductor to fuse
    qfuse::silu_mul_quant(gate, up, ..., kernel="triton")   x = silu(gate) * up, a Llama MLP's
                                                            down-projection input, gate and up written
                                                            by their GEMMs anyway: one pass over them,
                                                            the product never written

whose lowerings launch the kernels from the generated code (`qfuse.lowerings.triton.quantize`), where M is
dynamic or at least `MIN_ROWS` (a smaller static M saves less GPU time than the launch costs). An x made
by another pointwise op (RMSNorm's scaling, a residual add), or a SiLU * mul whose gate or up is a
GEMM epilogue in Inductor's pointwise code (the `torch` kernel's), keeps Inductor's fused reduction,
which reads its inputs once: there qfuse's kernel would first make those a buffer, and an fp8 Llama
MLP lost time that way at prefill (measured in the same section). The new q and scale equal the old
ones bit for bit, so every use of the old ones (the GEMM, its epilogue, another GEMM reading the same
activation) reads the new ones, and Inductor drops the old quant. For `silu_mul_quant` the roundings
are eager's but the SiLU's exp and division are the GPU's fast ones (as in Inductor's own code), so q
may sit one step apart where the product lies within float32 error of a bf16 rounding boundary. Only
a quant computed in float32 is taken (as vLLM's torch fallbacks write it: `x.float() / s`), since the
kernel divides in float32. The record's note says which quantizer took the quant, or why none did.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from qfuse.errors import contain_internal_error
from qfuse.kernels import get_kernel
from qfuse.ops import RECORD_KEY
from qfuse.ops.scaled_mm import ScaledMmArgs
from qfuse.passes.core.fused_linear import NotFusable, PassContext
from qfuse.passes.core.graph_utils import aten, dtype_of, fake_value, insert_call, is_call, same_shape, shape_of, strip_views
from qfuse.passes.forms.quant_forms import Quantizer, TokenScale, float_source, fold_verdict, match_quantize, match_token_scale
from qfuse.passes.forms.silu_forms import match_silu_and_mul
from qfuse.passes.core.transaction import UndoFailed, new_nodes_removed_on_error
from qfuse.platform import current_platform

PATTERN = "activation quant on qfuse's Triton quantizer"
UPCAST_SOURCES = (torch.bfloat16, torch.float16, torch.float32)  # read as they are, upcast to float32 exactly
# The least static M each quantizer is taken at. In default mode a user kernel launched from the wrapper
# costs more host time than one of Inductor's own (and fp8's unit-scale form adds a pointwise kernel for
# the scale's product), which the quant alone saves back in GPU time only at large M; silu(gate) * up
# saves more, so it is taken from fewer rows
# (measured: docs/benchmarks.md, "The activation quant on qfuse's Triton quantizers, inside Inductor's code").
MIN_ROWS = {torch.ops.qfuse.dynamic_quant.default: 2048, torch.ops.qfuse.silu_mul_quant.default: 256}
QUANTIZER_NOTES = {
    torch.ops.qfuse.dynamic_quant.default:
        "activation quant on qfuse's Triton quantizer (no pointwise producer for Inductor to fuse)",
    torch.ops.qfuse.silu_mul_quant.default:
        "activation quant and the SiLU * mul before it on qfuse's Triton quantizer (one pass over gate and up)",
}


SLICES = (aten.slice.Tensor, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default)


def _under_slices(node):
    """The tensor under views, slices and split outputs (a merged gate_up output's halves)."""
    while True:
        node, _ = strip_views(node)
        if is_call(node, operator.getitem) and is_call(node.args[0], *SLICES):
            node = node.args[0].args[0]
        elif is_call(node, *SLICES):
            node = node.args[0]
        else:
            return node


def producer_fuses_into_quant(x: Node) -> bool:
    """Whether Inductor would fuse the op that produces `x` into the quant's reduction (or any kernel of
    its own that reads x): a pointwise op or a reduction does, and so does a fused linear whose kernel
    leaves its epilogue in Inductor's pointwise code (`Kernel.output_fuses_into_consumers`); a graph
    input, a GEMM template, attention or another extern op does not."""
    producer = _under_slices(x)
    if not isinstance(producer, Node) or producer.op != "call_function":
        return False
    if producer.target == ScaledMmArgs.op:
        return get_kernel(ScaledMmArgs.of(producer).kernel).output_fuses_into_consumers
    tags = getattr(producer.target, "tags", ())
    return torch.Tag.pointwise in tags or torch.Tag.reduction in tags


def exact_token_quant(a: Node) -> tuple[Quantizer, TokenScale]:
    """The dynamic per-token quantizer that produced `a`, if qfuse's computes exactly the same; else NotFusable."""
    quantizer = match_quantize(a)
    if quantizer is None:
        raise NotFusable("the quantized activation is not produced by a known quantize form (divide, clamp, cast)")
    dynamic = match_token_scale(quantizer.scale)
    if dynamic is None:
        raise NotFusable("not a dynamic per-token scale of a form qfuse knows")
    if reason := fold_verdict(quantizer, dynamic):
        raise NotFusable(reason)
    return quantizer, dynamic


def quantizer_call(quantizer: Quantizer, dynamic: TokenScale) -> tuple:
    """(op, args) of the qfuse quantizer that computes `quantizer` on CUDA; NotFusable says why none does."""
    kernel = get_kernel("triton")
    supported, why = kernel.is_supported(current_platform("cuda"))
    if not supported:
        raise NotFusable(why)
    scale_dtype = dtype_of(quantizer.x)
    if scale_dtype != torch.float32:
        raise NotFusable(f"the quant divides in {scale_dtype}; qfuse's quantizer divides in float32")
    if 0 < dynamic.eps < torch.finfo(torch.float32).tiny:
        raise NotFusable(f"eps {dynamic.eps!r} is below float32's normal range, where Triton computes with it "
                         "in float64")
    x = float_source(quantizer.x)
    if dtype_of(x) not in UPCAST_SOURCES:
        x = quantizer.x  # not an exact upcast from a narrower float: the kernel reads the float32 values
    if shape_of(x)[-1] > kernel.quant_max_row:
        raise NotFusable(f"rows of {shape_of(x)[-1]} values; qfuse's quantizer holds at most {kernel.quant_max_row}")
    if not producer_fuses_into_quant(x):
        call = torch.ops.qfuse.dynamic_quant.default, (x, quantizer.dtype, "per_token", dynamic.eps, "triton", scale_dtype)
    elif (gate_and_up := match_silu_and_mul(x)) is None:
        raise NotFusable("Inductor fuses the op that produces the activation into the quant")
    elif any(producer_fuses_into_quant(operand) for operand in gate_and_up):
        raise NotFusable("Inductor fuses the SiLU * mul and what produces gate or up (a GEMM's epilogue) into the "
                         "quant; a kernel of qfuse's own would write them out first")
    else:
        call = torch.ops.qfuse.silu_mul_quant.default, (*gate_and_up, quantizer.dtype, dynamic.eps, "triton", scale_dtype)
    if reason := too_few_rows(call[0], shape_of(x)):
        raise NotFusable(reason)
    return call


def too_few_rows(target, shape) -> str:
    """Why a static M is too small for the quantizer `target` to pay for its launch ('' if it is not, or M is
    dynamic: a dynamic M is a serving engine's, whose decode steps replay CUDA graphs, where launches cost
    nothing, and whose prefill is GPU-bound)."""
    rows = 1
    for size in shape[:-1]:
        if not isinstance(size, int):
            return ""
        rows *= size
    least = MIN_ROWS[target]
    if rows >= least:
        return ""
    return (f"M = {rows}: below {least} rows the quantizer saves less GPU time than its launch costs on the host "
            f"(measured on an H100: docs/benchmarks.md, \"The activation quant on qfuse's Triton quantizers, "
            f"inside Inductor's code\")")


def _quantized_by_qfuse(a: Node) -> Node | None:
    """The qfuse quantizer call whose q `a` is (under views), if an earlier linear put one there."""
    base, _ = strip_views(a)
    if isinstance(base, Node) and base.target is operator.getitem and base.args[0].target in QUANTIZER_NOTES:
        return base.args[0]
    return None


def _replace_quant(graph: Graph, quantizer: Quantizer, target, args: tuple, q_old: Node) -> None:
    """Insert target(*args) before the old scale and make every user of the old q and scale read its outputs."""
    s_old = quantizer.scale
    with graph.inserting_before(s_old):
        both = insert_call(graph, target, args)
        q_new = insert_call(graph, operator.getitem, (both, 0))
        s_new = insert_call(graph, operator.getitem, (both, 1))
    for old, new in ((q_old, q_new), (s_old, s_new)):
        if dtype_of(old) != dtype_of(new) or not same_shape(shape_of(old), shape_of(new)):
            raise NotFusable(f"{old.name} is {dtype_of(old)}{list(shape_of(old))}, qfuse's quantizer gives "
                             f"{dtype_of(new)}{list(shape_of(new))}")
    q_old.replace_all_uses_with(q_new)
    s_old.replace_all_uses_with(s_new)


def take_over_quant(graph: Graph, fused: Node, call: ScaledMmArgs, context: PassContext) -> None:
    """Give the activation quant of `fused` to qfuse's Triton quantizer where that pays (CUDA)."""
    record = fused.meta.get(RECORD_KEY)
    value = fake_value(call.a)
    if value is None or value.device.type != "cuda" or call.scale_a is None:
        return
    note = record.add_note if record is not None else (lambda _: None)
    if (earlier := _quantized_by_qfuse(call.a)) is not None:  # the activation of another linear too
        note(QUANTIZER_NOTES[earlier.target])
        return
    try:
        quantizer, dynamic = exact_token_quant(call.a)
        target, args = quantizer_call(quantizer, dynamic)
        with new_nodes_removed_on_error(graph):
            _replace_quant(graph, quantizer, target, args, strip_views(call.a)[0])
    except NotFusable as reason:
        note(f"activation quant in Inductor's code: {reason}")
        return
    except UndoFailed:
        raise  # the pass manager restores the graph as it was before this family
    except Exception as error:
        note(contain_internal_error(f"quantizing the activation of {fused.name}", error,
                                    "the activation quant is left to Inductor"))
        return
    context.report.matches[PATTERN] += 1
    note(QUANTIZER_NOTES[target])
