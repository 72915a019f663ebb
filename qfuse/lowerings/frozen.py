"""int4 weight-only linears on frozen weights: the preparation a kernel makes once, made at compile time.

Under freezing (`torch._inductor.config.freezing`) the stored words, scales, zero points and `g_idx`
of a linear are constants of the graph when `qfuse::int4_weight_only_mm` is lowered, so the work the
op's Python would do once per weight (`ops.int4_weight_only.prepared_int4_weight`) runs here, at
compile time, and its result becomes new graph constants.

Two kernels' lowerings use it: the `torch` kernel's on the CPU (ATen's int4pack layout packed at compile
time and called from the generated code: `lowerings.torch_native`) and the `triton` kernel's for act
order (the weight sorted by group at compile time: `lowerings.triton.int4`).
"""

from __future__ import annotations

import functools

import torch
from torch._inductor import config as inductor_config
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import unset_fake_temporarily

from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs, prepared_int4_weight

_WEIGHT_FIELDS = ("packed", "shifts", "scales", "packed_zeros", "g_idx")


def _constant_value(node) -> torch.Tensor | None:
    """The tensor of an FX argument that is a graph constant (a frozen parameter: a get_attr of the
    graph's module), else None. Asked of the FX node, not of its IR: Inductor inlines constants of
    up to 8 values (a shift table) as pointwise IR."""
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        value = functools.reduce(getattr, node.target.split("."), V.graph.module)
        return value if isinstance(value, torch.Tensor) else None
    return None


def constant_weight(call: Int4WeightOnlyMmArgs) -> dict | None:
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


def prepared_now(call: Int4WeightOnlyMmArgs, values: dict | None):
    """The call kernel's prepared weight, made now from the constant weight tensors `values` (None: None)."""
    if values is None:
        return None
    with unset_fake_temporarily():  # real tensors: the preparation runs now, once
        _, weight = prepared_int4_weight(call.kernel, values["packed"], values.get("shifts"), values["scales"],
                                         values.get("packed_zeros"), call.group_size, values.get("g_idx"),
                                         call.zero_convention, call.packed_along_n)
    return weight
