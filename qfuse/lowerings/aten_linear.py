"""What the lowerings of `qfuse::scaled_mm` share: the operand checks of ATen's GEMMs in Inductor's code,
and the dequantize epilogue written as Inductor pointwise IR after a GEMM.

    scaled_epilogue    out = (float32(acc) * scale_a * scale_b + (scale_a - scale_a) + bias).to(out_dtype)

Inductor fuses that epilogue with the op that reads the linear's output (a SiLU, a residual add), so a
kernel that leaves its scales to it (`torch`, `onednn` with per-row scales, the `triton` template's
split-K sums) costs no launch of its own for them.
"""

from __future__ import annotations

import sympy
import torch
from torch._inductor import ir
from torch._inductor.virtualized import V

from qfuse.kernels.cutlass import ALIGNMENT
from qfuse.lowerings.ir import convert, known_equal, lower, numel
from qfuse.platform import CUDA_INT_MM_MIN_ROWS
from qfuse.schemes import FP8_DTYPE

aten = torch.ops.aten


def scale_shape(scale, count, shape, last_dim=None) -> list | None:
    """The 2D broadcast shape of a scale (or zero point) that is one value or one per row / column,
    else None. One per row / column is `count` values whose last dimension is `last_dim` (where given),
    as the op's normalisation reads them: a [K / 128, N / 128] block scale can hold N values."""
    if scale is None or known_equal(numel(scale), 1):
        return [1, 1]
    if known_equal(numel(scale), count) and (last_dim is None or known_equal(scale.get_size()[-1], last_dim)):
        return shape
    return None


def row_scale_shape(scale, rows) -> list | None:
    return scale_shape(scale, rows, [rows, 1], last_dim=1)


def column_scale_shape(scale, n) -> list | None:
    return scale_shape(scale, n, [1, n], last_dim=n)


def why_unaligned(b) -> str:
    """Why ATen's fp8 `_scaled_mm` cannot take this [K, N] weight as it is, or ''."""
    if not all(known_equal(sympy.Mod(size, ALIGNMENT), 0) for size in b.get_size()):
        return f"K or N is not a multiple of {ALIGNMENT}: ATen's fp8 GEMM needs them so (the op pads the weight once)"
    return ""


def why_not_aten_gemm(call, rows) -> str:
    """'' if an ATen GEMM in Inductor's code takes the `qfuse::scaled_mm` call's operands as they are,
    else why (the op's extern call pads, pads rows, or transposes them)."""
    a, b = call.a, call.b
    if row_scale_shape(call.scale_a, rows) is None or column_scale_shape(call.scale_b, b.get_size()[1]) is None:
        return "per-group or block scales"
    on_cuda = a.get_device().type == "cuda"
    if on_cuda and a.get_dtype() == FP8_DTYPE and (reason := why_unaligned(b)):
        return reason
    if on_cuda and a.get_dtype() == torch.int8 and not V.graph.sizevars.statically_known_geq(rows, CUDA_INT_MM_MIN_ROWS):
        # not a guarded bucket: where a caller drops Dynamo's guards (vLLM), a bucket would be a crash, not a slow call
        return f"CUDA int8 GEMM needs at least {CUDA_INT_MM_MIN_ROWS} rows and M is not known to be that large"
    if on_cuda and a.get_dtype() == FP8_DTYPE and not known_equal(b.get_stride()[0], 1):
        return "the fp8 weight is not column-major"
    return ""


def scaled_epilogue(out, scale_a, scale_b, bias, rows, out_dtype):
    """(float32(out) * scale_a * scale_b + (scale_a - scale_a) + bias).to(out_dtype) on [rows, N], in
    pointwise IR (the scale_a - scale_a term: `torch_native.nan_where_not_finite`)."""
    if scale_a is not None and scale_a.get_dtype() in (torch.float16, torch.bfloat16) and scale_a.get_device().type == "cpu":
        # stored in its dtype, so rounded as eager and the quantizer round it: Inductor's C++ code computes a half
        # scale inlined here in float32 and drops the round trip (`qfuse.passes.forms.eager_roundings`)
        scale_a = ir.ExternKernel.realize_input(scale_a)
    for scale, shape in ((scale_a, row_scale_shape(scale_a, rows)), (scale_b, [1, -1])):
        if scale is not None:
            shape = shape if not known_equal(numel(scale), 1) else [1, 1]
            factor = lower(aten.reshape.default, convert(scale, torch.float32), shape)
            out = lower(aten.mul.Tensor, out, factor)
            if scale is scale_a:
                out = lower(aten.add.Tensor, out, lower(aten.sub.Tensor, factor, factor))
    if bias is not None:
        out = lower(aten.add.Tensor, out, convert(bias, torch.float32))
    return convert(out, out_dtype)
