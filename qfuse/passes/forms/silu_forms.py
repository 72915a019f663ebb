"""The SiLU * mul in front of a Llama MLP's down projection, as the post-grad graph spells it.

    F.silu(gate) * up,  up bf16 / fp16, gate of up's dtype or float32, one shape:
        mul(convert(silu32, up.dtype), up)            (either operand order)
        silu32 = div(g, add(exp(neg(g)), 1))          (Inductor's decomposition of aten.silu)
               | mul(g, sigmoid(g)) | silu(g)
        g = convert(gate, float32), or gate itself when it is float32: a linear's output whose
            bf16 round trip Inductor's `pointless_convert` removed (a gate projection's, in
            Llama's MLP compiled by torch 2.11)

`match_silu_and_mul(node)` returns (gate, up) for such a node, else None. The roundings the graph
writes (silu to up's dtype, then the product) are the ones `qfuse::silu_mul_quant` makes.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from qfuse.passes.core.graph_utils import aten, converted_dtype, dtype_of, is_call, same_shape, shape_of

HALF_DTYPES = (torch.bfloat16, torch.float16)


def _gate(g, dtype: torch.dtype) -> Node | None:
    """The gate under g: x for g = convert(x, float32) with x of `dtype`, or g itself if it is float32."""
    if not isinstance(g, Node) or dtype_of(g) != torch.float32:
        return None
    if converted_dtype(g) == torch.float32 and dtype_of(g.args[0]) == dtype:
        return g.args[0]
    return g


def _is_one(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1


def _same_value(left, right) -> bool:
    """The same node, or the same conversion of one node (`g.float()` written twice)."""
    if left is right:
        return True
    return (isinstance(left, Node) and isinstance(right, Node) and converted_dtype(left) is not None
            and converted_dtype(left) == converted_dtype(right) and left.args[0] is right.args[0])


def _silu_input(node) -> Node | None:
    """g for node = silu(g) in one of its float32 spellings."""
    if is_call(node, aten.silu.default):
        return node.args[0]
    if is_call(node, aten.mul.Tensor):
        left, right = node.args
        for g, sigmoid in ((left, right), (right, left)):
            if is_call(sigmoid, aten.sigmoid.default) and _same_value(sigmoid.args[0], g):
                return g
    if is_call(node, aten.div.Tensor):
        g, denominator = node.args
        if is_call(denominator, aten.add.Tensor):
            exp = next((a for a, b in (denominator.args, denominator.args[::-1]) if _is_one(b)), None)
            if (is_call(exp, aten.exp.default) and is_call(exp.args[0], aten.neg.default)
                    and _same_value(exp.args[0].args[0], g)):
                return g
    return None


def match_silu_and_mul(node) -> tuple[Node, Node] | None:
    """(gate, up) if `node` is silu(gate) * up as the post-grad graph writes it, else None."""
    if not is_call(node, aten.mul.Tensor):
        return None
    for rounded, up in (node.args, node.args[::-1]):
        if not (isinstance(rounded, Node) and isinstance(up, Node)):
            continue
        dtype = converted_dtype(rounded)
        if dtype not in HALF_DTYPES or dtype_of(up) != dtype:
            continue
        gate = _gate(_silu_input(rounded.args[0]), dtype)
        if gate is not None and same_shape(shape_of(gate), shape_of(up)):
            return gate, up
    return None
