"""The `triton` kernel's lowering of `qfuse::scaled_mm`: its Triton template in Inductor's code
(`qfuse.lowerings.triton.template`), the scales and bias inside it, the output cast and the next
pointwise ops fused into its store:

    out = template(A [M, K], B [K, N], scale_a, scale_b, bias).to(out_dtype)

int8 from 2048 rows on Hopper runs the persistent TMA kernel's main loop instead. Where the template
splits K (up to 128 rows, `template.k_splits`), it writes each K range's unscaled sums, and their sum
and the dequantize epilogue follow in Inductor's code (`aten_linear.scaled_epilogue`).

Stays an extern call of the op: K not a multiple of 16 (the op pads the weight once), a device other
than CUDA, a scale of no kind the kernel reads (`scale_kinds`, as the op's normalisation reads them).
"""

from __future__ import annotations

import sympy
import torch

from qfuse.lowerings.aten_linear import scaled_epilogue
from qfuse.lowerings.ir import as_matrix, rows_and_k, convert, known_equal, lower, numel, record_lowering
from qfuse.lowerings.triton import template
from qfuse.ops.scaled_mm import ScaledMmArgs
from qfuse.schemes import GROUP_SIZE

aten = torch.ops.aten


def scale_kinds(scale_a, scale_b, rows, k, n):
    """(kind, shape) of scale_a and of scale_b as the Triton kernel takes them (the op's normalisation:
    one value, one per row / column, else one per block; kind NO_SCALE and shape None for no scale),
    or None for a scale that fits none."""
    from qfuse.kernels.triton.scaled_mm import BLOCK_SCALE, NO_SCALE, TENSOR_SCALE, VECTOR_SCALE

    groups, column_groups = sympy.ceiling(k / GROUP_SIZE), sympy.ceiling(n / GROUP_SIZE)

    def kind(scale, vector_shape, block_shape, block_last_dims):
        """As the op's normalisation: by the count of values and the last dimension(s), in this order."""
        if scale is None:
            return NO_SCALE, None
        size = scale.get_size()
        candidates = ((TENSOR_SCALE, [1, 1], []), (VECTOR_SCALE, vector_shape, vector_shape[-1:]),
                      (BLOCK_SCALE, block_shape, block_last_dims))
        return next(((kind, shape) for kind, shape, last in candidates
                     if known_equal(numel(scale), sympy.Mul(*shape)) and len(size) >= len(last)
                     and all(known_equal(a, b) for a, b in zip(size[len(size) - len(last):], last))), None)

    return (kind(scale_a, [rows, 1], [rows, groups], [groups]),
            kind(scale_b, [1, n], [groups, column_groups], [groups, column_groups]))


def _has_block_scale(kinds) -> bool:
    from qfuse.kernels.triton.scaled_mm import BLOCK_SCALE

    return any(kind == BLOCK_SCALE for kind, _ in kinds)


def _why_not_scales(scale_a, scale_b, rows, b) -> str:
    kind_a, kind_b = scale_kinds(scale_a, scale_b, rows, *b.get_size())
    if kind_a is None:
        return "scale_a is neither one value, one per row, nor one per row and 128-group of K"
    if kind_b is None:
        return "scale_b is neither one value, one per column, nor one per 128x128 block"
    return ""


def _template_linear(a2d, b, scale_a, scale_b, bias, rows, k, out_dtype):
    """The triton kernel as an Inductor template; the output cast (and what follows) in its store. Where
    the template splits K (`template.k_splits`), it writes the unscaled sums of each K range, and
    their sum and this module's epilogue follow in Inductor's code."""
    kinds = scale_kinds(scale_a, scale_b, rows, k, b.get_size()[1])
    splits = template.k_splits(a2d, b, blocked=_has_block_scale(kinds))
    if splits > 1:
        acc, how = template.split_k_product(a2d, b, splits, out_dtype)
        record_lowering(how + " (scales, bias, cast)")
        return scaled_epilogue(convert(acc, torch.float32), scale_a, scale_b, bias, rows, out_dtype)
    (kind_a, sa), (kind_b, sb) = ((kind, None if shape is None else lower(aten.reshape.default, convert(scale, torch.float32), shape))
                                  for scale, (kind, shape) in zip((scale_a, scale_b), kinds))
    out, how = template.scaled_linear(a2d, b, sa, kind_a, sb, kind_b, bias, out_dtype)
    record_lowering(how + "; scales and bias inside it, the output cast and what follows fused into its store")
    return convert(out, out_dtype)


def why_not(call: ScaledMmArgs) -> str:
    rows, k = rows_and_k(call.a)
    return (template.why_not_template(call.a.get_device(), rows, k, call.b.get_size()[1])
            or _why_not_scales(call.scale_a, call.scale_b, rows, call.b))


def lower_call(call: ScaledMmArgs):
    a2d, lead, rows, k = as_matrix(call.a)
    out = _template_linear(a2d, call.b, call.scale_a, call.scale_b, call.bias, rows, k, call.out_dtype)
    return lower(aten.reshape.default, out, [*lead, call.b.get_size()[1]])
