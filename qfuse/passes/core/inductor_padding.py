"""Take back the row padding Inductor's `pad_mm` gave a quantized linear's matmul.

On CUDA, Inductor's joint-graph pass `pad_mm` may pad a float matmul's rows (and columns) to a
multiple of 8 where its benchmark finds the padded cuBLAS call faster:

    y = mm(constant_pad_nd(x, [0, 0, 0, p]), w) [: -p]          (addmm alike, a 1D bias as it is)

Its decision is a timing, cached per shape, so the same model may compile either way. Where `w` is
a dequantized weight, the padded activation hides the linear from the forms qfuse reads (a W8A16
linear whose scale multiplies after the slice no longer matches), and sibling linears padded
differently no longer share their activation. A fused kernel takes any M, so the padding is only a
copy of the activation.

So before the families run, each `mm` / `addmm` whose right operand is computed from stored quantized
tensors, whose left operand is `x` padded with rows only, and whose users all slice those rows off,
takes `x` itself: row i of a matmul reads row i of its left operand alone, so the rows kept are the
same values (eager's, unpadded). Float matmuls keep Inductor's choice.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from qfuse.passes.core.graph_utils import fake_value, is_call, stored_quantized_sources
from qfuse.passes.core.report import weight_operand

aten = torch.ops.aten
UNPADDED = "its rows, padded to a multiple of 8 by Inductor's pad_mm, taken back (passes/core/inductor_padding.py)"


def _padded_rows(pad: Node) -> tuple[Node, int] | None:
    """(x, p) where `pad` is constant_pad_nd(x, [0, 0, 0, p]) of a 2D x: rows appended, nothing else."""
    if not is_call(pad, aten.constant_pad_nd.default) or len(pad.users) != 1:
        return None
    source, widths = pad.args[0], list(pad.args[1])
    if not isinstance(source, Node) or fake_value(source) is None or fake_value(source).dim() != 2:
        return None
    if len(widths) != 4 or widths[:3] != [0, 0, 0] or not isinstance(widths[3], int) or widths[3] <= 0:
        return None
    return source, widths[3]


def _slices_the_rows_off(user: Node, rows: int, padding: int) -> bool:
    """Whether `user` is `slice(mm, 0, 0, end)` keeping exactly the first `rows` rows."""
    if not is_call(user, aten.slice.Tensor) or user.kwargs:
        return False
    _, dim, start, end, *step = (*user.args, *[None] * (4 - len(user.args)))
    return dim == 0 and start in (0, None) and end in (-padding, rows) and step in ([], [1])


def unpad_quantized_matmuls(graph: Graph) -> list[str]:
    """Take back `pad_mm`'s row padding of every matmul in `graph` whose weight operand is a dequantize
    (module docstring); the names of the matmuls it changed."""
    unpadded = []
    for node in list(graph.nodes):
        if not is_call(node, aten.mm.default, aten.addmm.default):
            continue
        left = node.args[1] if node.target == aten.addmm.default else node.args[0]
        if (padded := _padded_rows(left)) is None or not stored_quantized_sources(weight_operand(node)):
            continue
        source, padding = padded
        rows = fake_value(source).shape[0]
        if node.target == aten.addmm.default and ((bias := fake_value(node.args[0])) is None or
                                                  bias.dim() == 2 and bias.shape[0] != 1):  # rows of its own: padded too
            continue
        if not node.users or not all(_slices_the_rows_off(user, rows, padding) and isinstance(user.meta.get("val"),
                                                                                             torch.Tensor)
                                     for user in node.users):
            continue
        node.replace_input_with(left, source)
        kept = next(iter(node.users))  # its value: the rows kept (a view of the padded product; a tensor of its own now)
        node.meta.update({key: kept.meta[key] for key in ("val", "tensor_meta") if key in kept.meta})
        node.meta["val"] = node.meta["val"].clone()
        for user in list(node.users):
            user.replace_all_uses_with(node)
            graph.erase_node(user)
        graph.erase_node(left)
        unpadded.append(node.name)
    return unpadded
