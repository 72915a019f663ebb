"""A weight dequantized by 128 x 128 block scales, in the two spellings model code uses.

The fp8 block-quantized checkpoints (DeepSeek-V3 style: `weight` [N, K] fp8 e4m3fn, `weight_scale_inv`
[ceil(N / 128), ceil(K / 128)] float32) are dequantized in plain torch as

    repeat  w.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
            (vLLM's and SGLang's `block_quant_dequant`; any order of the two repeats, the slice only
            where a size is no multiple of 128), traced as unsqueeze / expand / clone / reshape per axis
    view    (w.float().view(N / 128, 128, K / 128, 128) * s[:, None, :, None]).view(N, K)
            (N and K multiples of 128)

`match_block_dequantize(node)` returns the stored quantized tensor and the compact scale [N / 128,
K / 128] as a `Dequantized` of granularity BLOCK when `node` is one of them, after proving from the
shapes that every element of the weight meets the scale of its own block: each axis repeated
exactly 128 times (or viewed as 128-wide blocks) and cut back to the weight's size. The caller
decides what q is (`fake_quant_linear`: a stored fp8 / int8 tensor upcast).
"""

from __future__ import annotations

from collections.abc import Callable

from torch.fx import Node

from qfuse.passes.core.graph_utils import VIEW_OPS, aten, is_call, shape_of, static_int
from qfuse.passes.forms.dequantized_linear import Dequantized
from qfuse.schemes import GROUP_SIZE, Granularity

# q -> (q, the dtype to cast it to or None, kind) when q is a float tensor of quantized values
QuantizedValues = Callable[[Node], tuple | None]



def _blocks(size: int) -> int:
    return -(-size // GROUP_SIZE)


def _repeated_axis(node) -> tuple[Node, int] | None:
    """(x, axis) when `node` = x.repeat_interleave(128, axis) of a 2D x, as traced:
    reshape(clone(expand(unsqueeze(x, axis + 1), ... 128 at axis + 1 ...)), [rows, columns])."""
    if not is_call(node, *VIEW_OPS) or len(shape_of(node)) != 2:
        return None
    expanded = node.args[0]
    while is_call(expanded, aten.clone.default):
        expanded = expanded.args[0]
    if not is_call(expanded, aten.expand.default):
        return None
    unsqueezed = expanded.args[0]
    if not is_call(unsqueezed, aten.unsqueeze.default) or unsqueezed.args[1] not in (1, 2):
        return None
    axis = unsqueezed.args[1] - 1
    source = unsqueezed.args[0]
    if len(shape_of(source)) != 2 or static_int(shape_of(expanded)[axis + 1]) != GROUP_SIZE:
        return None
    expected = list(shape_of(source))
    expected[axis] *= GROUP_SIZE
    return (source, axis) if list(shape_of(node)) == expected else None


def _leading_slice(node) -> Node | None:
    """x when `node` = x[..., :size] along one axis (a slice from 0, step 1)."""
    if not is_call(node, aten.slice.Tensor):
        return None
    args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
    start, step = args[2], args[4]
    return node.args[0] if start in (0, None) and step == 1 else None


def repeated_block_scale(scale, weight_shape) -> Node | None:
    """The compact [ceil(N / 128), ceil(K / 128)] scale under `scale`, when `scale` is it repeated 128
    times along both axes and sliced back to the [N, K] `weight_shape`; else None."""
    if not isinstance(scale, Node) or shape_of(scale) is None or len(weight_shape) != 2:
        return None
    node, repeated = scale, set()
    while True:  # slices from 0 keep every element's block, wherever they sit in the chain
        if (sliced := _leading_slice(node)) is not None:
            node = sliced
            continue
        found = _repeated_axis(node)
        if found is None or found[1] in repeated:
            break
        node = found[0]
        repeated.add(found[1])
    n, k = (static_int(size) for size in weight_shape)
    if repeated != {0, 1} or n is None or k is None or [static_int(size) for size in shape_of(node)] != [_blocks(n), _blocks(k)]:
        return None
    return node if [static_int(size) for size in shape_of(scale)] == [n, k] else None


def _viewed_block_dequantize(node, quantized_values: QuantizedValues) -> Dequantized | None:
    """`(q.view(N / 128, 128, K / 128, 128) * s[:, None, :, None]).view(N, K)`."""
    if not is_call(node, *VIEW_OPS) or len(shape_of(node)) != 2 or not is_call(node.args[0], aten.mul.Tensor):
        return None
    n, k = (static_int(size) for size in shape_of(node))
    if n is None or k is None or n % GROUP_SIZE or k % GROUP_SIZE:
        return None
    blocked = [n // GROUP_SIZE, GROUP_SIZE, k // GROUP_SIZE, GROUP_SIZE]
    product = node.args[0]
    for values, scale in (product.args, product.args[::-1]):
        if not (is_call(values, *VIEW_OPS) and [static_int(size) for size in shape_of(values)] == blocked
                and [static_int(size) for size in shape_of(values.args[0])] == [n, k]):
            continue
        compact = _compact_of_broadcast(scale, blocked)
        found = quantized_values(values.args[0]) if compact is not None else None
        if found is not None:
            q, cast_to, kind = found
            return Dequantized(q, compact, 0, Granularity.BLOCK, f"{kind}, 128x128 block scales (view)", cast_to=cast_to)
    return None


def _compact_of_broadcast(scale, blocked: list[int]) -> Node | None:
    """s [N / 128, K / 128] when `scale` is s with unit axes at 1 and 3 (unsqueezes or a view)."""
    if not isinstance(scale, Node) or [static_int(size) for size in shape_of(scale) or ()] != [blocked[0], 1, blocked[2], 1]:
        return None
    node = scale
    while is_call(node, aten.unsqueeze.default, *VIEW_OPS) and len(shape_of(node.args[0])) >= 2:
        node = node.args[0]
    return node if [static_int(size) for size in shape_of(node)] == [blocked[0], blocked[2]] else None


def match_block_dequantize(node, quantized_values: QuantizedValues) -> Dequantized | None:
    """The block-scaled dequantize at `node` (module docstring), with q as `quantized_values` finds it."""
    if not isinstance(node, Node):
        return None
    if is_call(node, aten.mul.Tensor) and len(shape_of(node)) == 2:
        for values, scale in (node.args, node.args[::-1]):
            compact = repeated_block_scale(scale, shape_of(node))
            found = quantized_values(values) if compact is not None else None
            if found is not None:
                q, cast_to, kind = found
                return Dequantized(q, compact, 0, Granularity.BLOCK, f"{kind}, 128x128 block scales (repeat)",
                                   cast_to=cast_to)
        return None
    return _viewed_block_dequantize(node, quantized_values)
