"""Inductor lowering of `qfuse::scaled_mm` for the `torch` and `cutlass` kernels: Inductor's own GEMM.

An opaque custom-op call would hide the epilogue from Inductor: it could no longer fuse the
scales, the bias and the next op into one loop, and each call would pay Python dispatch. For the
`torch` kernel the op therefore lowers to what that kernel computes, in Inductor IR:

    int8      acc = aten._int_mm(a, b)                    (Inductor's tuned int8 GEMM lowering;
                                                           CPU K == 1: the int32 outer product)
              acc -= azp_a * colsum(b) + rowsum(a) * azp_b - K * azp_a * azp_b   (zero points)
    fp8 CUDA  out = aten._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)  when ATen takes the
              scales itself (both per-tensor, or per-row x per-column with a bf16 output, above 128
              rows on Hopper: below, its row-wise GEMM is slower than cuBLAS with unit scales), else
              acc = aten._scaled_mm(a, b, 1, 1, out_dtype=float32)
    fp8 CPU   acc = aten.mm(float32(a), float32(b))
    out       = (float32(acc) * scale_a * scale_b + bias).to(out_dtype)        (pointwise IR)

The `cutlass` kernel without vLLM is ATen's row-wise CUTLASS fp8 GEMM; where it needs no padding
(K and N multiples of 16) it lowers to that same call, scales expanded to row-wise:

    fp8 cutlass  out = aten._scaled_mm(a, b, scale_a [M, 1], scale_b [1, N], bias, bfloat16)

The `onednn` kernel with a per-row activation scale: oneDNN's qlinear takes one activation scale,
so the extern op runs qlinear with the weight scale alone (float32 out) and the per-row scale, the
bias and the cast follow in pointwise IR, where they fuse with the consumer:

    int8 onednn  out = (qfuse.scaled_mm(a, b, None, scale_b, None, azp_a, azp_b, float32) * scale_a + bias).to(out_dtype)

Where M is dynamic, kernel choice saw no M; the lowering picks per M bucket, guarded
(`ir.rows_at_most`, so each bucket gets its own compiled code) where another kernel is measured
faster: an fp8 M of at most 16 runs the Triton template instead of ATen's row-wise CUTLASS GEMM,
and on Hopper an fp8 M above 16 runs cuBLAS instead of the Triton template, with unit scales up to
128 rows (`_kernel_for_m_bucket`; block scales stay on the template).

Cases it does not cover stay an extern call of the op (which is always correct): other kernels,
per-group / block scales, CUDA int8 without a static M > 16 (cuBLAS rejects small M; the op pads),
an fp8 weight that is not column-major on CUDA.
"""

from __future__ import annotations

import sympy
import torch
from torch._inductor import ir
from torch._inductor import lowering as inductor_lowering
from torch._inductor.virtualized import V

from qfuse.kernels.cutlass import ALIGNMENT, cutlass_backend
from qfuse.kernels.torch_native import zero_point_correction
from qfuse.lowerings import triton_template
from qfuse.lowerings.ir import (IR_OPS, convert, current_record, extern_call, falls_back_to_extern_call, known_equal,
                                lower, numel, record_lowering, rows_at_most, tensor_constant)
from qfuse.lowerings.triton_template import why_not_template
from qfuse.ops.scaled_mm import ScaledMmArgs
from qfuse.platform import CUDA_INT_MM_MIN_ROWS, current_platform
from qfuse.schemes import FP8_DTYPE, GROUP_SIZE

aten, prims = torch.ops.aten, torch.ops.prims


def _scale_shape(scale, count, shape, last_dim=None) -> list | None:
    """The 2D broadcast shape of a scale (or zero point) that is one value or one per row / column,
    else None. One per row / column is `count` values whose last dimension is `last_dim` (where given),
    as the op's normalisation reads them: a [K / 128, N / 128] block scale can hold N values."""
    if scale is None or known_equal(numel(scale), 1):
        return [1, 1]
    if known_equal(numel(scale), count) and (last_dim is None or known_equal(scale.get_size()[-1], last_dim)):
        return shape
    return None


def _row_scale_shape(scale, rows) -> list | None:
    return _scale_shape(scale, rows, [rows, 1], last_dim=1)


def _column_scale_shape(scale, n) -> list | None:
    return _scale_shape(scale, n, [1, n], last_dim=n)


def _why_unaligned(b) -> str:
    """Why ATen's fp8 `_scaled_mm` cannot take this [K, N] weight as it is, or ''."""
    if not all(known_equal(sympy.Mod(size, ALIGNMENT), 0) for size in b.get_size()):
        return f"K or N is not a multiple of {ALIGNMENT}: ATen's fp8 GEMM needs them so (the op pads the weight once)"
    return ""


def _why_not_aten_cutlass(a, b) -> str:
    if cutlass_backend(current_platform("cuda")) != "aten":
        return "the cutlass kernel calls vLLM's CUTLASS op"
    return _why_unaligned(b)


def _splits_onednn_epilogue(a, scale_a, azp_a, rows, kernel: str) -> bool:
    """onednn with a per-row activation scale: qlinear takes one scale, so the op would scale the
    rows in eager torch ops after it; in IR that epilogue fuses with the consumer instead."""
    return (kernel == "onednn" and a.get_dtype() == torch.int8 and scale_a is not None
            and not known_equal(numel(scale_a), 1) and known_equal(numel(scale_a), rows)
            and (azp_a is None or known_equal(numel(azp_a), 1)))


def why_not_lowered(a, b, scale_a, scale_b, rows, kernel: str) -> str:
    """'' if the lowering covers this call, else why it stays an extern call."""
    if kernel == "triton":
        return why_not_template(a.get_device(), rows, a.get_size()[-1]) or _why_not_triton_scales(scale_a, scale_b, rows, b)
    if kernel not in ("torch", "cutlass"):
        return f"kernel {kernel!r} runs as an extern call"
    if kernel == "cutlass" and (reason := _why_not_aten_cutlass(a, b)):
        return reason
    if _row_scale_shape(scale_a, rows) is None or _column_scale_shape(scale_b, b.get_size()[1]) is None:
        return "per-group or block scales"
    on_cuda = a.get_device().type == "cuda"
    if on_cuda and a.get_dtype() == FP8_DTYPE and (reason := _why_unaligned(b)):
        return reason
    if on_cuda and a.get_dtype() == torch.int8 and not V.graph.sizevars.statically_known_geq(rows, CUDA_INT_MM_MIN_ROWS):
        # not a guarded bucket: where a caller drops Dynamo's guards (vLLM), a bucket would be a crash, not a slow call
        return f"CUDA int8 GEMM needs at least {CUDA_INT_MM_MIN_ROWS} rows and M is not known to be that large"
    if on_cuda and a.get_dtype() == FP8_DTYPE and not known_equal(b.get_stride()[0], 1):
        return "the fp8 weight is not column-major"
    return ""


def _int8_accumulator(a2d, b, azp_a, azp_b, rows, k):
    on_cpu = a2d.get_device().type == "cpu"
    if on_cpu and known_equal(k, 1):  # _int_mm is wrong there (torch_native.int8_matmul)
        # The activation gets a buffer of its own: inlined into this pointwise product, the chain that
        # quantized it (clamp, casts to uint8, then int8 and int32) loses its clamp in Inductor's CPU
        # code (torch 2.13), and saturated values wrap around.
        a2d.realize()
        acc = lower(aten.mul.Tensor, convert(a2d, torch.int32), convert(b, torch.int32))
    else:
        if on_cpu and known_equal(rows, 1):  # size-1 dims with their dense strides (torch_native.dense_unit_strides)
            a2d = ir.ExternKernel.require_exact_strides(a2d, [k, 1])
        if on_cpu and known_equal(b.get_size()[1], 1):
            b = ir.ExternKernel.require_exact_strides(b, [1, k])
        acc = lower(aten._int_mm.default, a2d, b)
    zero_a = None if azp_a is None else lower(aten.reshape.default, convert(azp_a, torch.int32),
                                               _scale_shape(azp_a, rows, [rows, 1]))
    zero_b = None if azp_b is None else lower(aten.reshape.default, convert(azp_b, torch.int32), [1, -1])
    acc = zero_point_correction(acc, a2d, b, zero_a, zero_b, k, IR_OPS)
    return convert(acc, torch.float32)


def _fp8_accumulator(a2d, b):
    if a2d.get_device().type == "cuda":
        unit = tensor_constant(torch.ones((), dtype=torch.float32, device=a2d.get_device()))
        return lower(aten._scaled_mm.default, a2d, b, unit, unit, None, None, torch.float32)
    return lower(aten.mm.default, convert(a2d, torch.float32), convert(b, torch.float32))


def _cublas_scaled(a2d, b, scale_a, scale_b, bias, rows, out_dtype):
    """fp8 on CUDA with the scales (and bias) inside ATen's `_scaled_mm`, or None when it cannot take
    them, or (row-wise scales up to ROWWISE_SLOW_MAX_ROWS rows on Hopper, a dynamic M guarded) when
    its row-wise GEMM is slower than cuBLAS with unit scales and Inductor's epilogue after it."""
    from qfuse.kernels.cutlass import aten_rowwise_slow_max_rows

    if a2d.get_device().type != "cuda" or scale_a is None or scale_b is None:
        return None
    if bias is not None and bias.get_dtype() != out_dtype:
        return None
    tensorwise = known_equal(numel(scale_a), 1) and known_equal(numel(scale_b), 1)
    slow_below = aten_rowwise_slow_max_rows(current_platform("cuda"))
    rowwise = (not known_equal(numel(scale_a), 1) and not known_equal(numel(scale_b), 1)
               and out_dtype == torch.bfloat16 and not (slow_below and rows_at_most(rows, slow_below)))
    if not (tensorwise or rowwise):
        return None
    shapes = ([], []) if tensorwise else ([rows, 1], [1, b.get_size()[1]])
    sa, sb = (lower(aten.reshape.default, convert(scale, torch.float32), shape) for scale, shape in zip((scale_a, scale_b), shapes))
    return lower(aten._scaled_mm.default, a2d, b, sa, sb, bias, None, out_dtype)


def _rowwise_scale(scale, shape, device):
    """A contiguous float32 scale of `shape` ([M, 1] or [1, N]) from one value or one per row / column.

    One per row / column is a view of the scale itself (no kernel on the hot path); one value or none
    is broadcast into a new buffer."""
    if scale is not None and not known_equal(numel(scale), 1):  # ATen checks stride(1) == 1
        return ir.ExternKernel.require_contiguous(lower(aten.reshape.default, convert(scale, torch.float32), shape))
    unit = lower(aten.full.default, shape, 1.0, dtype=torch.float32, device=device)
    if scale is None:
        return unit
    return ir.ExternKernel.require_contiguous(lower(aten.mul.Tensor, unit, lower(aten.reshape.default, convert(scale, torch.float32), [1, 1])))


def _aten_cutlass_scaled(a2d, b, scale_a, scale_b, bias, rows):
    """The cutlass kernel's ATen call: row-wise scaled fp8 GEMM (CUTLASS inside ATen), bf16 out."""
    sa = _rowwise_scale(scale_a, [rows, 1], a2d.get_device())
    sb = _rowwise_scale(scale_b, [1, b.get_size()[1]], a2d.get_device())
    return lower(aten._scaled_mm.default, a2d, b, sa, sb, bias, None, torch.bfloat16)


def _scaled_epilogue(out, scale_a, scale_b, bias, rows, out_dtype):
    """(float32(out) * scale_a * scale_b + (scale_a - scale_a) + bias).to(out_dtype) on [rows, N], in
    pointwise IR (the scale_a - scale_a term: `torch_native.nan_where_not_finite`)."""
    for scale, shape in ((scale_a, _row_scale_shape(scale_a, rows)), (scale_b, [1, -1])):
        if scale is not None:
            shape = shape if not known_equal(numel(scale), 1) else [1, 1]
            factor = lower(aten.reshape.default, convert(scale, torch.float32), shape)
            out = lower(aten.mul.Tensor, out, factor)
            if scale is scale_a:
                out = lower(aten.add.Tensor, out, lower(aten.sub.Tensor, factor, factor))
    if bias is not None:
        out = lower(aten.add.Tensor, out, convert(bias, torch.float32))
    return convert(out, out_dtype)


def _triton_scale_kinds(scale_a, scale_b, rows, k, n):
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


def _why_not_triton_scales(scale_a, scale_b, rows, b) -> str:
    kind_a, kind_b = _triton_scale_kinds(scale_a, scale_b, rows, *b.get_size())
    if kind_a is None:
        return "scale_a is neither one value, one per row, nor one per row and 128-group of K"
    if kind_b is None:
        return "scale_b is neither one value, one per column, nor one per 128x128 block"
    return ""


def _triton_template_linear(a2d, b, scale_a, scale_b, bias, rows, k, out_dtype):
    """The triton kernel as an Inductor template; the output cast (and what follows) in its store. Where
    the template splits K (`triton_template.k_splits`), it writes the unscaled sums of each K range, and
    their sum and this module's epilogue follow in Inductor's code."""
    kinds = _triton_scale_kinds(scale_a, scale_b, rows, k, b.get_size()[1])
    splits = triton_template.k_splits(a2d, b, blocked=_has_block_scale(kinds))
    if splits > 1:
        acc, how = triton_template.split_k_product(a2d, b, splits, out_dtype)
        record_lowering(how + " (scales, bias, cast)")
        return _scaled_epilogue(convert(acc, torch.float32), scale_a, scale_b, bias, rows, out_dtype)
    (kind_a, sa), (kind_b, sb) = ((kind, None if shape is None else lower(aten.reshape.default, convert(scale, torch.float32), shape))
                                  for scale, (kind, shape) in zip((scale_a, scale_b), kinds))
    out, how = triton_template.scaled_linear(a2d, b, sa, kind_a, sb, kind_b, bias, out_dtype)
    record_lowering(how + "; scales and bias inside it, the output cast and what follows fused into its store")
    return convert(out, out_dtype)


@falls_back_to_extern_call(ScaledMmArgs)
def lower_scaled_mm(*args, **kwargs):
    call = ScaledMmArgs(*args, **kwargs)
    *lead, k = call.a.get_size()
    n = call.b.get_size()[1]
    rows = sympy.Mul(*lead) if lead else sympy.Integer(1)
    if _splits_onednn_epilogue(call.a, call.scale_a, call.azp_a, rows, call.kernel):
        record_lowering("extern call (oneDNN qlinear, weight scale); per-row scale, bias and cast in Inductor's pointwise code")
        acc = extern_call(call._replace(scale_a=None, bias=None, out_dtype=torch.float32))
        acc = lower(aten.reshape.default, acc, [rows, n])
        out = _scaled_epilogue(acc, call.scale_a, None, call.bias, rows, call.out_dtype)
        return lower(aten.reshape.default, out, [*lead, n])
    reason = why_not_lowered(call.a, call.b, call.scale_a, call.scale_b, rows, call.kernel)
    if reason:
        return extern_call(call, reason)
    return lower(aten.reshape.default, _lowered_linear(call, rows, k), [*lead, n])


def _kernel_for_m_bucket(call: ScaledMmArgs, rows) -> tuple[str, str]:
    """(the kernel that runs this call's M bucket, why it is not the pass's choice, or ''). Kernel
    choice saw no M where M is dynamic; in a bucket where a later kernel is measured faster, and can
    run the call as lowered here, the lowering takes it (the bucket guarded, `ir.rows_at_most`), as
    kernel choice does for a static M (`Kernel.why_slower_here`): fp8 M <= 128 passes over ATen's
    row-wise CUTLASS GEMM, and fp8 M > 16 over the Triton template on Hopper (to cuBLAS). It stays
    where the configuration forced, preferred or disabled kernels (`LinearRecord.kernel_constrained`),
    and for an op the passes did not emit (no record)."""
    from qfuse.kernels.cutlass import fp8_small_m_yields, rowwise_slow_max_rows
    from qfuse.kernels.triton import FP8_TEMPLATE_MAX_ROWS, fp8_template_yields_to_cublas

    record = current_record()
    if record is None or record.kernel_constrained or sympy.sympify(rows).is_number or call.a.get_dtype() != FP8_DTYPE:
        return call.kernel, ""
    platform = current_platform("cuda")
    args = call.a, call.b, call.scale_a, call.scale_b, rows
    kernel, reasons = call.kernel, []
    bound = rowwise_slow_max_rows(platform)
    if kernel == "cutlass" and bound and not why_not_lowered(*args, "triton") and rows_at_most(rows, bound):
        kernel = "triton"
        reasons.append(f"M at most {bound} (a dynamic M, guarded) {fp8_small_m_yields(platform)}")
    if kernel == "triton" and not why_not_lowered(*args, "torch"):
        kinds = _triton_scale_kinds(call.scale_a, call.scale_b, rows, call.a.get_size()[-1], call.b.get_size()[1])
        reason = fp8_template_yields_to_cublas(_has_block_scale(kinds), platform)
        if reason and not rows_at_most(rows, FP8_TEMPLATE_MAX_ROWS):
            kernel = "torch"
            reasons.append(f"M above {FP8_TEMPLATE_MAX_ROWS} (a dynamic M, guarded) {reason}")
    return kernel, "; ".join(reasons)


def _lowered_linear(call: ScaledMmArgs, rows, k):
    """The [rows, N] result of a call that `why_not_lowered` accepted, in Inductor IR."""
    kernel, why_this_kernel = _kernel_for_m_bucket(call, rows)
    if why_this_kernel:  # the report says why, before how the bucket's kernel was lowered
        out = _lowered_linear(call._replace(kernel=kernel), rows, k)
        record_lowering(f"{why_this_kernel}: {current_record().lowered}")
        return out
    a2d = lower(aten.reshape.default, call.a, [rows, k])
    b, scale_a, scale_b, bias, out_dtype = call.b, call.scale_a, call.scale_b, call.bias, call.out_dtype
    if call.kernel == "triton":
        return _triton_template_linear(a2d, b, scale_a, scale_b, bias, rows, k, out_dtype)
    if call.kernel == "cutlass":
        record_lowering("ATen row-wise _scaled_mm (CUTLASS), scales and bias inside the GEMM")
        return _aten_cutlass_scaled(a2d, b, scale_a, scale_b, bias, rows)
    if a2d.get_dtype() == FP8_DTYPE:
        fused = _cublas_scaled(a2d, b, scale_a, scale_b, bias, rows, out_dtype)
        if fused is not None:
            record_lowering("ATen _scaled_mm (cuBLAS), scales and bias inside the GEMM")
            return fused
    if a2d.get_dtype() == torch.int8:
        out = _int8_accumulator(a2d, b, call.azp_a, call.azp_b, rows, k)
    else:
        out = _fp8_accumulator(a2d, b)
    record_lowering("Inductor's own GEMM lowering; scales, bias and cast in its fused pointwise code")
    return _scaled_epilogue(out, scale_a, scale_b, bias, rows, out_dtype)


def register() -> None:
    inductor_lowering.register_lowering(ScaledMmArgs.op, type_promotion_kind=None)(lower_scaled_mm)
