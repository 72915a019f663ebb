"""Take back the int8 weight-only linears that Inductor's own pattern took before qfuse's pass ran.

Inductor's post-grad lowering patterns (`torch._inductor.fx_passes.quantization`, `woq_int8`) turn
`mm(x, w.t().to(bf16)) * s`, with an int8 weight and bf16 x and scale (torchao's int8 weight-only
linear, `F.linear(x, w.to(bf16)) * s`), into one node that lowers to `aten._weight_int8pack_mm`.
They run before a `post_grad_custom_post_pass`, on CPU, CUDA and XPU. What that costs a user:

- on CUDA, ATen's `_weight_int8pack_mm` is a kernel whose time grows with every row, many times the
  bf16 matmul's from the first rows on
  (measured: docs/benchmarks.md, "torchao's int8 weight-only on the GPU, and W8A16 batched decode", and
  "Measurements first quoted in code comments" for M = 128);
- where the kernel's checks fail, the compiled model does, though eager runs: on CPU K not a
  multiple of 16 crashes the process, a per-tensor scale raises.

So before its families run, qfuse puts back the ATen form each such node came from,

    y = mm(x.reshape(-1, K), w.permute(1, 0).to(x.dtype)) [.reshape(*x.shape[:-1], N)] * s

which is the model's own arithmetic (a bf16 matmul, then the scale: two roundings, as eager), and
the `reference_linear` family fuses it like any other scale-after weight-only linear: kernel choice
picks per device (on CPU ATen's int8pack up to 64 rows, as Inductor's pattern would have; on CUDA
the `triton` template). A linear kernel choice then passes over stays in that ATen form and runs as
Inductor's own dequantize + mm, which compiles on every device.

Inductor's concat-linear variant (three weights, freezing only) builds `_weight_int8pack_mm` nodes
directly, not this node; it is left alone and reported as Inductor's.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from qfuse.passes.core.graph_utils import fake_value, insert_call
from qfuse.passes.core.transaction import new_nodes_removed_on_error

aten, prims = torch.ops.aten, torch.ops.prims
INDUCTOR_PATTERNS = "torch._inductor.fx_passes.quantization"
DEVICES = ("cpu", "cuda")  # where qfuse has a kernel for the linear (XPU keeps Inductor's)
_COPIED_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "original_aten")


def is_inductor_woq_int8(node: Node) -> bool:
    """Whether `node` is what Inductor's int8 weight-only lowering pattern left of a linear."""
    target = node.target
    return (node.op == "call_function" and getattr(target, "__module__", "") == INDUCTOR_PATTERNS
            and getattr(target, "__name__", "") == "woq_int8" and {"x", "weight", "scales"} <= set(node.kwargs))


def reclaim_woq_int8(graph: Graph) -> list[str]:
    """Replace each of Inductor's `woq_int8` nodes in `graph` that reads a 2D int8 weight on CPU or CUDA
    by the ATen linear it matched; the names of the linears' new `mm` nodes (what qfuse's report calls
    them). A node whose rebuilt output would not have the matched shape is left as it is."""
    reclaimed = []
    for node in list(graph.nodes):
        if not is_inductor_woq_int8(node) or not _takes(node):
            continue
        before = set(graph.nodes)
        with new_nodes_removed_on_error(graph), graph.inserting_before(node):
            linear, mm = _aten_linear(graph, node)
        if not _same_shape(fake_value(linear), fake_value(node)):
            for inserted in reversed([new for new in graph.nodes if new not in before]):
                graph.erase_node(inserted)
            continue
        for inserted in (mm, linear):
            inserted.meta.update({key: node.meta[key] for key in _COPIED_META if key in node.meta})
        node.replace_all_uses_with(linear)
        graph.erase_node(node)
        reclaimed.append(mm.name)
    return reclaimed


def _takes(node: Node) -> bool:
    """x [..., K] and a 2D int8 weight [N, K] with static K and N, on a device with a qfuse kernel."""
    x, weight = fake_value(node.kwargs["x"]), fake_value(node.kwargs["weight"])
    return (x is not None and weight is not None and weight.dim() == 2 and x.dim() >= 2 and x.device.type in DEVICES
            and all(isinstance(size, int) for size in weight.shape)
            and statically_known_true(x.shape[-1] == weight.shape[1]))


def _aten_linear(graph: Graph, node: Node) -> tuple[Node, Node]:
    """(the linear's output, its mm): y = mm(x.reshape(-1, K), w.permute(1, 0).to(x.dtype)), viewed as the
    matched output (the matched reshape's size where the pattern had one, else x's leading sizes), times s:
    the form `tests/peers/test_weight_only_forms.py` records for the scale-after linear."""
    x, weight, scales = node.kwargs["x"], node.kwargs["weight"], node.kwargs["scales"]
    x_value, out_value = fake_value(x), fake_value(node)
    k = weight.meta["val"].shape[1]
    rows = x if x_value.dim() == 2 else insert_call(graph, aten.reshape.default, (x, [-1, k]))
    weight_t = insert_call(graph, prims.convert_element_type.default,
                           (insert_call(graph, aten.permute.default, (weight, [1, 0])), x_value.dtype))
    mm = insert_call(graph, aten.mm.default, (rows, weight_t))
    out = mm
    if out_value.dim() != 2 or x_value.dim() != 2:
        matched_size = node.args[-1] if node.args and isinstance(node.args[-1], (list, tuple)) else None
        if matched_size is None or len(matched_size) != out_value.dim():  # bmm: x's leading sizes
            matched_size = [size if isinstance(size, int) else insert_call(graph, aten.sym_size.int, (x, dim))
                            for dim, size in enumerate(x_value.shape[:-1])] + [weight.meta["val"].shape[0]]
        out = insert_call(graph, aten.reshape.default, (mm, list(matched_size)))
    return insert_call(graph, aten.mul.Tensor, (out, scales)), mm


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and a.dtype == b.dtype and all(
        statically_known_true(left == right) for left, right in zip(a.shape, b.shape))

