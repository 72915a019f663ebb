"""int4 weight-only linears on frozen weights: the preparation a kernel makes once, made at compile time.

Under freezing (`torch._inductor.config.freezing`) the stored words, scales, zero points and `g_idx`
of a linear are constants of the graph when `qfuse::int4_weight_only_mm` is lowered, so the work the
op's Python would do once per weight (`ops.int4_weight_only.prepared_int4_weight`) runs here, at
compile time, and its result becomes new graph constants:

- CPU, the `torch` kernel: ATen's int4pack layout, called from the generated code through Inductor's
  own lowering of that op (an extern ATen call, or under max-autotune also its C++ template on the
  constant weight). Without freezing the op's extern call repacks once and calls the kernel with
  0.4-0.5 ms of Python a call more than the bare kernel at M = 1 (the GPU machine's AMX host):

      out = (aten._weight_int4pack_mm_for_cpu(x2d[:, order]?, packed, g, scales_and_zeros) + bias).to(out_dtype)

  A weight whose preparation is no int4pack layout (dequantized once: DENSE) stays the op's extern call.
- CUDA, the `triton` kernel, act order (a `g_idx`): the weight's rows sorted by group, packed back into
  words [N, K / 8] with their scales and zero points, and the activation's columns gathered in that
  order in Inductor's code (`act_order_on_constants`). The call is then GPTQ's plain form, which the
  Triton templates read (the nibble-plane template fuses the gather into its activation copy);
  without freezing act order reads every column's scale and zero point through `g_idx`.
"""

from __future__ import annotations

import functools

import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import unset_fake_temporarily

from qfuse.kernels.int4_cpu import PACKING
from qfuse.lowerings.ir import convert, lower, record_lowering, rows_at_most
from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs, prepared_int4_weight

aten = torch.ops.aten
_WEIGHT_FIELDS = ("packed", "shifts", "scales", "packed_zeros", "g_idx")


def _constant_value(node) -> torch.Tensor | None:
    """The tensor of an FX argument that is a graph constant (a frozen parameter: a get_attr of the
    graph's module), else None. Asked of the FX node, not of its IR: Inductor inlines constants of
    up to 8 values (a shift table) as pointwise IR."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        value = functools.reduce(getattr, node.target.split("."), V.graph.module)
        return value if isinstance(value, torch.Tensor) else None
    return None


def _constant_weight(call: Int4WeightOnlyMmArgs) -> dict | None:
    """The call's weight tensors by field, where freezing made every one of them a graph constant; else None."""
    if not inductor_config.freezing:
        return None
    node = V.graph.current_node
    if node is None or node.target != Int4WeightOnlyMmArgs.op:
        return None
    fx_call = Int4WeightOnlyMmArgs.of(node)
    values = {}
    for field in _WEIGHT_FIELDS:
        node = getattr(fx_call, field)
        if node is not None and (values.setdefault(field, _constant_value(node)) is None):
            return None
    return values


def _prepared(call: Int4WeightOnlyMmArgs, values: dict | None):
    """The kernel's prepared weight, made now from the constant weight tensors `values` (None: None)."""
    if values is None:
        return None
    with unset_fake_temporarily():  # real tensors: the preparation runs now, once
        _, weight = prepared_int4_weight(call.kernel, values["packed"], values.get("shifts"), values["scales"],
                                         values.get("packed_zeros"), call.group_size, values.get("g_idx"),
                                         call.zero_convention, call.packed_along_n)
    return weight


def frozen_weight(call: Int4WeightOnlyMmArgs):
    """The kernel's prepared weight where the call runs the CPU `torch` kernel under freezing and its
    weight tensors are graph constants, and that preparation is ATen's int4pack layout; else None."""
    if call.kernel != "torch" or call.x.get_device().type != "cpu":
        return None
    weight = _prepared(call, _constant_weight(call))
    return weight if weight is not None and weight.packing == PACKING else None


def int4pack_on_constants(call: Int4WeightOnlyMmArgs, weight, x2d):
    """x2d @ w + bias, cast to the op's output dtype, with `weight` (int4pack layout) as graph constants."""
    packed = V.graph.add_tensor_constant(weight.data, "qfuse_int4pack_weight")
    scales_and_zeros = V.graph.add_tensor_constant(weight.scale.to(x2d.get_dtype()), "qfuse_int4pack_scales")
    if weight.input_order is not None:  # act order: the weight's rows were sorted by group
        order = V.graph.add_tensor_constant(weight.input_order, "qfuse_int4pack_order")
        x2d = lower(aten.index.Tensor, x2d, [None, order])
    group_size = weight.k // weight.scale.shape[0]
    x2d = ir.ExternKernel.require_contiguous(x2d)  # as the kernel's x.contiguous()
    out = lower(aten._weight_int4pack_mm_for_cpu.default, x2d, packed, group_size, scales_and_zeros)
    if call.bias is not None:
        out = lower(aten.add.Tensor, out, convert(call.bias, out.get_dtype()))
    record_lowering("ATen's _weight_int4pack_mm_for_cpu on the frozen weight, packed at compile time; the bias, "
                    "the cast and what follows in Inductor's code")
    return convert(out, call.out_dtype)


def act_order_on_constants(call: Int4WeightOnlyMmArgs, x2d, rows, max_rows: int) -> Int4WeightOnlyMmArgs | None:
    """The call of the same linear without act order, where the call runs the `triton` kernel on CUDA
    under freezing with a `g_idx`, constant weight tensors and at most `max_rows` rows (a dynamic M
    guarded on it): the weight sorted by group at compile time (the kernel's own layout: words
    [N, K / 8], scales [N, K / g], zero points [N / 8, K / g]) and x2d [M, K] gathered in that order.
    None where that does not hold, or where `g_idx` sorts into no groups of the group size (the op
    then multiplies a dense weight: left to its extern call's rule)."""
    from qfuse.kernels.triton import INT4_PACKING, INT4_ZEROS_MINUS_ONE

    if call.g_idx is None or call.kernel != "triton" or call.x.get_device().type != "cuda":
        return None
    values = _constant_weight(call)
    if values is None or not rows_at_most(rows, max_rows):  # a dynamic M guarded only where the sort would run
        return None
    weight = _prepared(call, values)
    if weight is None or weight.packing not in (INT4_PACKING, INT4_ZEROS_MINUS_ONE):
        return None
    constant = V.graph.add_tensor_constant
    order = constant(weight.input_order, "qfuse_int4_order")
    return call._replace(
        x=lower(aten.index.Tensor, x2d, [None, order]), packed=constant(weight.data, "qfuse_int4_words"), shifts=None,
        scales=constant(weight.scale, "qfuse_int4_scales"),
        packed_zeros=None if weight.zero_point is None else constant(weight.zero_point, "qfuse_int4_zeros"),
        g_idx=None, zero_convention="plus_one" if weight.packing == INT4_ZEROS_MINUS_ONE else "stored",
        packed_along_n=False)
