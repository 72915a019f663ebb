"""eager_roundings: Inductor's code for a float16 / bfloat16 quantizer rounds where eager does.

Inductor computes a chain of float16 / bfloat16 pointwise ops in float32 and rounds once, where it stores;
eager rounds after every op. In most code that moves a result by less than its last bit, but a quantizer
turns it into whole integer steps: its scale amax / 127 and its quotient x / s, left unrounded, can put
round(x / s) one step from eager's q (session 37's GPU run: a float16 fake quant per token, one q one step
off, 2.05e-3 of the output's largest against the suite's 2e-3, where plain Inductor's float output happened
to stay within it).

Inductor rounds each op of a node that asks for it: `low_precision_pointwise_barrier` in the node's meta,
what its global `emulate_precision_casts` setting marks on every node of a graph. A fused linear on a GPU
marks the nodes of its activation's quantizer that way (`round_quantizer_as_eager`): the casts, rounds and
clamps between q and the division, the division x / s, and the scale's computation from x. The quantizer stays
one kernel of Inductor's; the roundings cost a few instructions of a memory-bound pass.

On the CPU, Inductor's C++ code "legalizes" float16 / bfloat16 arithmetic inside a kernel to float32 and drops
a round trip where it sees one: the scale, inlined into the fused linear's epilogue, stayed unrounded while the
quantizer's kernel rounded it (torch 2.13), eager's q with Inductor's scale, further from both than Inductor's own
result. So the CPU lowering's epilogue reads a half activation scale realized in its dtype
(`qfuse.lowerings.aten_linear.scaled_epilogue`), and the marks hold there too (session 39).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from qfuse.passes.core.graph_utils import (VIEW_OPS, aten, converted_dtype, dtype_of, fake_value, prims, same_shape,
                                          shape_of)
from qfuse.passes.forms.quant_forms import is_round_or_clamp

#: the meta key Inductor's pointwise lowering reads (torch/_inductor/lowering.py, `make_pointwise`)
BARRIER = "low_precision_pointwise_barrier"
LOW_PRECISION = (torch.float16, torch.bfloat16)
#: between q and its quantizer: views, and the zero rows a shape padding adds (sliced off again)
PASSED_THROUGH = (*VIEW_OPS, aten.constant_pad_nd.default, aten.slice.Tensor)
QUOTIENTS = (aten.div.Tensor, aten.mul.Tensor)
#: how far back from the scale the walk looks for x (amax, abs, eps clamp, divide, casts: a handful)
SCALE_DEPTH = 8


def round_quantizer_as_eager(q) -> None:
    """Mark the float16 / bfloat16 nodes of the quantizer that produced `q` (the fused op's quantized
    activation), if the graph computes it; on a GPU its quotient's scale of no dimensions takes the quotient's
    dtype first (`_scale_in_the_quotients_dtype`)."""
    nodes = quantizer_nodes(q)
    for node in nodes:
        if _in_low_precision(node):
            node.meta[BARRIER] = True
    if quotient := next((node for node in nodes if node.target in QUOTIENTS), None):
        _scale_in_the_quotients_dtype(quotient)


def _scale_in_the_quotients_dtype(quotient: Node) -> None:
    """A float16 / bfloat16 x / s with s a float32 tensor of no dimensions on the GPU: eager's CUDA kernel reads s
    converted to the quotient's dtype (x / float16(0.05)); Inductor's code divides by the float32 value, and folds
    a conversion of a constant into a float32 constant of the unrounded value (session 39's GPU run, seed 46: a q
    one step off). The quotient reads s rounded to its dtype instead: a constant with the rounded value, or a
    marked conversion. On the CPU eager divides by the scalar's own value (its reduced-float division reads the
    original scalar), which Inductor's code already does."""
    dtype = dtype_of(quotient)
    value = fake_value(quotient)
    if dtype not in LOW_PRECISION or value is None or value.device.type != "cuda":
        return
    for operand in quotient.all_input_nodes:
        scalar = fake_value(operand)
        if scalar is None or scalar.dtype == dtype or not scalar.dtype.is_floating_point or scalar.dim() \
                or scalar.device.type != "cuda":  # (a CPU scalar: eager multiplies by its reciprocal)
            continue
        constant = operand.target == aten.full.default and isinstance(operand.args[1], (int, float))
        if constant and (rounded := float(torch.tensor(operand.args[1], dtype=scalar.dtype).to(dtype))) == operand.args[1]:
            continue  # (already its dtype's value: a sibling's quantizer, shared, was given it)
        with quotient.graph.inserting_before(quotient):
            if constant:  # (the same float32 constant, of the rounded value)
                scale = quotient.graph.call_function(aten.full.default, ([], rounded), dict(operand.kwargs))
                scale.meta["val"] = scalar
            else:
                scale = quotient.graph.call_function(prims.convert_element_type.default, (operand, dtype))
                scale.meta.update(val=scalar.to(dtype), **{BARRIER: True})
        quotient.replace_input_with(operand, scale)


def quantizer_nodes(q) -> list[Node]:
    """q's casts, rounds and clamps back to the quotient x / s (or x * (1 / s), however the reciprocal is
    written), the quotient, and the scale's nodes back to x: x is the quotient's operand of its own shape.
    Empty where q comes another way (a uint8 activation shifted to int8 by `bitwise_xor`: float32 in PT2E)."""
    nodes = []
    node = q
    while isinstance(node, Node) and (node.target in PASSED_THROUGH or converted_dtype(node) is not None
                                      or is_round_or_clamp(node)):
        nodes.append(node)
        node = node.args[0]
    if not (isinstance(node, Node) and node.target in QUOTIENTS):
        return []
    activations = [arg for arg in node.all_input_nodes if same_shape(shape_of(arg) or (), shape_of(node) or ())]
    if len(activations) != 1:
        return []
    x = activations[0]
    return nodes + [node] + _ancestors_to([arg for arg in node.all_input_nodes if arg is not x], x)


def _ancestors_to(scale: list[Node], x: Node) -> list[Node]:
    """The call_function nodes computing the scale (its reciprocal, if x is multiplied by it) back to x (x
    excluded), SCALE_DEPTH levels at most."""
    found, frontier = [], scale
    for _ in range(SCALE_DEPTH):
        frontier = [node for node in frontier if isinstance(node, Node) and node is not x
                    and node.op == "call_function" and node not in found]
        found += frontier
        frontier = [parent for node in frontier for parent in node.all_input_nodes]
    return found


def _in_low_precision(node: Node) -> bool:
    return any(dtype_of(value) in LOW_PRECISION for value in (node, *node.all_input_nodes))
