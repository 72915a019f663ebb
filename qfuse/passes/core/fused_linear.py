"""What every linear-fusing pass shares: the description of a fused linear, kernel choice, emission.

A pass that recognises a quantized linear fills a `FusedLinear` (operands as graph nodes, pending
calls or Python numbers, the scheme) and calls `fuse_linear`: it asks the kernel registry, records
the outcome in the report, and if a kernel can run it, inserts the operands' pending calls and one
fused op (`_fused_op_args` says which) that replaces `replaces`. Where no kernel runs it, its
`fallback` (the same linear read another way: W4A8 as int4 weight-only) is tried, with the reason in
the record's note. Until then the graph is untouched, so a linear that no kernel can run stays
exactly as it was.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch._inductor import config as inductor_config
from torch.fx import Graph, Node

from qfuse.errors import contain_internal_error
from qfuse.kernels import GemmKey, KernelRequest
from qfuse.ops import RECORD_KEY
from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs
from qfuse.ops.scaled_mm import ScaledMmArgs
from qfuse.ops.verify import CheckCloseArgs, tolerance_for
from qfuse.ops.w4a8 import PER_CHANNEL, W4a8ScaledMmArgs
from qfuse.ops.weight_only import WeightOnlyScaledMmArgs
from qfuse.passes.core.graph_utils import (
    PendingCall,
    PendingConstant,
    aten,
    fake_value,
    insert_call,
    materialize,
    module_path,
    prims,
    scalar_tensor,
    static_int,
)
from qfuse.passes.core.report import LinearRecord, PassReport
from qfuse.passes.forms.eager_roundings import round_quantizer_as_eager
from qfuse.passes.forms.scale_algebra import ScaleProduct
from qfuse.passes.core.transaction import UndoFailed, new_nodes_removed_on_error
from qfuse.platform import current_platform
from qfuse.schemes import INT4_DTYPE, Granularity, QuantScheme

if TYPE_CHECKING:
    from qfuse.config import QfuseConfig

GraphValue = Node | PendingCall | PendingConstant  # a graph value, or one a rewrite will insert
Operand = GraphValue | float | int | None
Scale = Operand | ScaleProduct


#: the matmuls of float operands a linear can be written with (its anchor, where it is one of them)
FLOAT_GEMMS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


class NotFusable(Exception):
    """A `can_fuse_*` check failed; the message is the near-miss reason."""


@dataclasses.dataclass
class PassContext:
    """What a pass needs besides the graph: the configuration and the report to fill."""

    config: QfuseConfig
    report: PassReport = dataclasses.field(default_factory=PassReport)


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """The stored tensors of an int4 weight (`qfuse::int4_weight_only_mm`'s operands)."""

    packed: GraphValue  # int32 [N, K / 8] (the transpose of a K-major [K / 8, N]: a pending view), AWQ [K, N / 8];
    #                     or int8 [N, K], one value a byte (torchao's intx)
    shifts: GraphValue | None  # int32 [8], None: nibble i at bits 4i
    scales: GraphValue  # [N, K / group_size]
    packed_zeros: GraphValue | None  # int32 [N / 8, K / group_size] (int8 [N, K / group_size]), None: symmetric
    group_size: int
    g_idx: Node | None = None  # [K], the group of each input channel (GPTQ's act order)
    zero_convention: str = "stored"  # how the zero points are stored (`qfuse.ops.int4_weight_only`)
    packed_along_n: bool = False  # `packed` is [K, N / 8] (AWQ)

    @property
    def k_and_n(self) -> tuple[int, int]:
        packed = fake_value(self.packed)
        rows, cols = packed.shape
        if packed.dtype == torch.int8:
            return cols, rows
        return (rows, cols * 8) if self.packed_along_n else (cols * 8, rows)


@dataclasses.dataclass
class FusedLinear:
    """A recognised quantized linear: out = ((a - azp_a) sa) @ ((b - azp_b) sb) + bias."""

    anchor: Node  # the matmul node, for the report
    family: str
    pattern: str
    a: GraphValue  # quantized activation [..., K]
    b: GraphValue  # quantized weight, logically [K, N]
    scheme: QuantScheme
    out_dtype: torch.dtype
    replaces: Node  # the node whose value the fused op takes over
    output_shape: list | None = None  # reshape the [M, N] result to this (absorbed views)
    output_padding: tuple[int, int] = (0, 0)  # zero rows, columns to append (Inductor's shape padding)
    scale_a: Scale = None
    scale_b: Scale = None
    bias: GraphValue | None = None
    azp_a: Operand = None
    azp_b: Operand = None
    note: str = ""  # e.g. why the epilogue stopped where it did
    per_call_weight: bool = False  # the quantized weight is computed on every call (fake-quantized float weight)
    int4: Int4Weight | None = None  # an int4 weight packed along K (then `b` is its packed tensor)
    fallback: FusedLinear | None = None  # fused instead where no kernel runs this one (W4A8 -> weight-only)
    row_nan: GraphValue | None = None  # [..., 1] of a's rows: 1, or nan where eager's float activation holds a nan

    def noted(self, note: str) -> FusedLinear:
        """A copy with `note` added to its note."""
        return dataclasses.replace(self, note=f"{self.note}; {note}" if self.note else note)

    def gemm_key(self) -> GemmKey:
        k, n = self.int4.k_and_n if self.int4 else fake_value(self.b).shape
        rows = math.prod(fake_value(self.a).shape[:-1])
        return GemmKey(
            scheme=self.scheme, m=static_int(rows), n=static_int(n), k=static_int(k), out_dtype=self.out_dtype,
            bias_dtype=None if self.bias is None else fake_value(self.bias).dtype, device_type=fake_value(self.a).device.type,
            weight_zero_point=self.azp_b is not None or (self.int4 is not None and self.int4.packed_zeros is not None),
            weight_zero_point_foldable=self.int4 is not None and fake_value(self.int4.packed).dtype == torch.int8,
            per_call_weight=self.per_call_weight,
            weight_scale_dtype=fake_value(self.int4.scales).dtype if self.int4 else None,
            cuda_graphs=bool(inductor_config.triton.cudagraphs),
            act_order=self.int4 is not None and self.int4.g_idx is not None,
            cpp_wrapper=bool(inductor_config.cpp_wrapper or inductor_config.aot_inductor.output_path),
            float_gemm_as_written=self.anchor.target in FLOAT_GEMMS and fake_value(self.anchor).dtype.is_floating_point,
        )


def record_near_miss(context: PassContext, anchor: Node, family: str, reason: str) -> None:
    context.report.add(
        LinearRecord(node=anchor.name, module=module_path(anchor), family=family, fused=False, reason=reason)
    )


def _as_tensor_node(graph: Graph, operand: Scale, dtype: torch.dtype, device: torch.device) -> Node | None:
    """Python numbers from the graph become 0-dim constants, scale products and pending calls
    nodes; nodes pass through, moved to the linear's device where they are elsewhere: a Python float
    that Dynamo leaves unspecialized (dynamic=True) reaches the graph as a 0-dim CPU tensor, which eager's
    `x * scale` reads from the CPU and a GPU kernel cannot."""
    if isinstance(operand, ScaleProduct):
        node = operand.emit(graph, device)
    elif isinstance(operand, (int, float)):
        return scalar_tensor(graph, operand, dtype, device)
    else:
        node = materialize(graph, operand)
    if node is not None and fake_value(node).device != device:
        node = insert_call(graph, prims.device_put.default, (node, device))
    return node


def _fused_op_args(graph: Graph, linear: FusedLinear, kernel: str, device: torch.device):
    """The fused op's arguments, every operand inserted as a node (at the current insertion point):
    `qfuse::int4_weight_only_mm` for a packed int4 weight, `qfuse::weight_only_scaled_mm` for another
    weight-only scheme (a float activation), `qfuse::w4a8_scaled_mm` for int4 values with int8
    activations, else `qfuse::scaled_mm`."""
    if linear.int4 is not None:
        int4 = linear.int4
        return Int4WeightOnlyMmArgs(
            x=materialize(graph, linear.a), packed=materialize(graph, int4.packed),
            shifts=materialize(graph, int4.shifts), scales=materialize(graph, int4.scales),
            packed_zeros=materialize(graph, int4.packed_zeros), bias=materialize(graph, linear.bias),
            group_size=int4.group_size, out_dtype=linear.out_dtype, kernel=kernel, g_idx=int4.g_idx,
            zero_convention=int4.zero_convention, packed_along_n=int4.packed_along_n,
        )
    scale_b = _as_tensor_node(graph, linear.scale_b, torch.float32, device)
    if linear.scheme.weight_dtype == INT4_DTYPE and not linear.scheme.is_weight_only:
        scheme = linear.scheme
        return W4a8ScaledMmArgs(
            a=materialize(graph, linear.a), scale_a=_as_tensor_node(graph, linear.scale_a, torch.float32, device),
            b=materialize(graph, linear.b), scale_b=scale_b, bias=materialize(graph, linear.bias),
            group_size=scheme.weight_group_size if scheme.weight_granularity == Granularity.PER_GROUP else PER_CHANNEL,
            out_dtype=linear.out_dtype, kernel=kernel,
        )
    if linear.scheme.is_weight_only:
        return WeightOnlyScaledMmArgs(
            x=materialize(graph, linear.a), b=materialize(graph, linear.b), scale_b=scale_b,
            bias=materialize(graph, linear.bias), azp_b=_as_tensor_node(graph, linear.azp_b, torch.int32, device),
            out_dtype=linear.out_dtype, kernel=kernel,
        )
    return ScaledMmArgs(
        a=materialize(graph, linear.a),
        b=materialize(graph, linear.b),
        scale_a=_as_tensor_node(graph, linear.scale_a, torch.float32, device),
        scale_b=scale_b,
        bias=materialize(graph, linear.bias),
        azp_a=_as_tensor_node(graph, linear.azp_a, torch.int32, device),
        azp_b=_as_tensor_node(graph, linear.azp_b, torch.int32, device),
        out_dtype=linear.out_dtype,
        kernel=kernel,
    )


def fuse_linear(graph: Graph, linear: FusedLinear, context: PassContext) -> Node | None:
    """Replace `linear.replaces` with a call of the fused op (`_fused_op_args`), if a kernel can run it.

    All or nothing: if choosing the kernel or emitting the op raises (a bug in qfuse), the nodes
    already inserted are removed, the linear stays as it was, and the report says why."""
    try:
        with new_nodes_removed_on_error(graph):
            return _fuse_linear(graph, linear, context)
    except UndoFailed:
        raise  # the pass manager restores the graph as it was before this pattern family
    except Exception as error:
        reason = contain_internal_error(f"fusing {linear.anchor.name} [{linear.family}]", error, "the linear is left as it was")
        record_near_miss(context, linear.anchor, linear.family, reason)
        return None


def _fuse_linear(graph: Graph, linear: FusedLinear, context: PassContext) -> Node | None:
    config = context.config
    device = fake_value(linear.a).device
    request = KernelRequest(linear.gemm_key(), forced=config.kernel, preference=config.kernel_preference,
                            disabled=config.disabled_kernels)
    choice = request.choose(current_platform(device.type))
    record = LinearRecord(
        node=linear.anchor.name, module=module_path(linear.anchor), family=linear.family, fused=choice.kernel is not None, pattern=linear.pattern,
        scheme=linear.scheme.describe(), rejected_kernels=choice.rejected, note=linear.note, request=request,
        int4_in_place=config.int4_in_place and linear.scheme.weight_dtype == INT4_DTYPE and linear.scheme.is_weight_only,
    )
    if choice.kernel is None and linear.fallback is not None:
        fallback = linear.fallback
        why = (f"read as {linear.scheme.describe()}, no kernel runs it ({choice.rejections()}); "
               f"falls back to {fallback.scheme.describe()}")
        return _fuse_linear(graph, fallback.noted(why), context)
    if choice.kernel is None:
        record.reason = "no kernel can run it: " + choice.rejections()
        context.report.add(record)
        return None
    record.kernel = choice.kernel.name
    with graph.inserting_before(linear.replaces):
        call = _fused_op_args(graph, linear, choice.kernel.name, device)
        fused = insert_call(graph, call.op, call.as_args())
        fused.meta[RECORD_KEY] = record  # later passes (activation_quant) add to the record
        if isinstance(call, (ScaledMmArgs, W4a8ScaledMmArgs)):  # an activation quantized by the graph's own code
            round_quantizer_as_eager(call.a)
        if linear.row_nan is not None:  # x 1 or nan: every finite, infinite or signed-zero value kept
            row_nan = insert_call(graph, prims.convert_element_type.default, (materialize(graph, linear.row_nan), linear.out_dtype))
            fused = insert_call(graph, aten.mul.Tensor, (fused, row_nan))
        if linear.output_shape is not None:
            fused = insert_call(graph, aten.reshape.default, (fused, linear.output_shape))
        if any(linear.output_padding):
            rows, columns = linear.output_padding
            fused = insert_call(graph, aten.constant_pad_nd.default, (fused, [0, columns, 0, rows], 0.0))
    if context.config.verify:
        fused = _check_against_original(graph, fused, linear, f"{context.report.graph_name}/{linear.anchor.name}")
    linear.replaces.replace_all_uses_with(fused, delete_user_cb=lambda user: user is not fused)
    context.report.add(record)
    return fused


def _check_against_original(graph: Graph, fused: Node, linear: FusedLinear, label: str) -> Node:
    """Verify mode: keep the original subgraph and compare it with the fused op (qfuse::check_close)."""
    check = CheckCloseArgs(fused=fused, original=linear.replaces, label=label,
                           tolerance=tolerance_for(linear.scheme, linear.out_dtype))
    with graph.inserting_after(linear.replaces):
        return insert_call(graph, check.op, check.as_args())


def fuse_anchored_linears(
    graph: Graph,
    context: PassContext,
    family: str,
    anchors: Sequence,
    analyze: Callable[[Node], FusedLinear | None],
) -> None:
    """Run `analyze` on every call of an anchor op (a matmul) and fuse what it recognises.

    `analyze` only reads the graph: it returns None for a matmul that is no candidate at all, a
    FusedLinear (the nodes it needs as pending calls) for a linear, and raises NotFusable for a
    near miss, which is recorded with its reason. Any other exception is a bug in qfuse: the
    matmul is recorded as not fused, with the error, and qfuse warns once.
    """
    for target in anchors:
        for anchor in list(graph.find_nodes(op="call_function", target=target)):
            try:
                linear = analyze(anchor)
            except NotFusable as near_miss:
                record_near_miss(context, anchor, family, str(near_miss))
                continue
            except Exception as error:
                reason = contain_internal_error(f"recognising {anchor.name} [{family}]", error, "the matmul is left as it was")
                record_near_miss(context, anchor, family, reason)
                continue
            if linear is not None:
                fuse_linear(graph, linear, context)
