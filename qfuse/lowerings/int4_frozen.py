"""The CPU int4 weight-only linear on a frozen weight: ATen's int4pack kernel called from the generated code.

Without freezing the `torch` kernel's int4 linear is an extern call of `qfuse::int4_weight_only_mm`:
its Python repacks the weight once (`ops.int4_weight_only.prepared_int4_weight`) and calls
`aten._weight_int4pack_mm_for_cpu` on every call, 0.4-0.5 ms more than the bare kernel at M = 1 on
the GPU machine's AMX host. Under freezing (`torch._inductor.config.freezing`) the stored words,
scales and zero points are constants of the graph when the op is lowered, so the same preparation
runs here, at compile time, and its packed weight and scales become new graph constants:

    out = (aten._weight_int4pack_mm_for_cpu(x2d[:, order]?, packed, g, scales_and_zeros) + bias).to(out_dtype)

through Inductor's own lowering of that op (an extern ATen call, or under max-autotune also its C++
template on the constant weight). The math is the kernel's (`kernels.int4_cpu.int4pack_mm`).
A weight whose preparation is no int4pack layout (dequantized once: DENSE) stays the op's extern call.
"""

from __future__ import annotations

import functools

import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import unset_fake_temporarily

from qfuse.kernels.int4_cpu import PACKING
from qfuse.lowerings.ir import convert, lower, record_lowering
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


def frozen_weight(call: Int4WeightOnlyMmArgs):
    """The kernel's prepared weight where the call runs the CPU `torch` kernel under freezing and its
    weight tensors are graph constants, and that preparation is ATen's int4pack layout; else None."""
    if not inductor_config.freezing or call.kernel != "torch" or call.x.get_device().type != "cpu":
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
    with unset_fake_temporarily():  # real tensors: the preparation runs now, once
        _, weight = prepared_int4_weight(call.kernel, values["packed"], values.get("shifts"), values["scales"],
                                         values.get("packed_zeros"), call.group_size, values.get("g_idx"),
                                         call.zero_convention, call.packed_along_n)
    return weight if weight.packing == PACKING else None


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
