"""The `torch` kernel's lowerings: what `qfuse.kernels.torch_native` computes, as ATen calls and
pointwise IR in Inductor's generated code (no Python op per call, the epilogue fused with what follows).

`qfuse::scaled_mm` (an opaque call would hide the epilogue from Inductor and pay Python dispatch):

    int8      acc = aten._int_mm(a, b)                    (Inductor's tuned int8 GEMM lowering;
                                                           CPU K == 1: the int32 outer product; a CPU
                                                           without int8 dot instructions, M >= 8: exact
                                                           float32 GEMMs of K <= 1024 chunks, summed in int32)
              acc -= azp_a * colsum(b) + rowsum(a) * azp_b - K * azp_a * azp_b   (zero points)
    fp8 CUDA  out = aten._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)  when ATen takes the
              scales itself (both per-tensor, or per-row x per-column with a bf16 output, above 128
              rows on Hopper: below, its row-wise GEMM is slower than cuBLAS with unit scales), else
              acc = aten._scaled_mm(a, b, 1, 1, out_dtype=float32)
    fp8 CPU   acc = aten.mm(float32(a), float32(b))
    out       = (float32(acc) * scale_a * scale_b + bias).to(out_dtype)        (`aten_linear.scaled_epilogue`)

Stays an extern call (always correct): per-group / block scales, CUDA int8 without a static M > 16
(cuBLAS rejects small M; the op pads), an fp8 weight that is not column-major or aligned on CUDA.

`qfuse::weight_only_scaled_mm` on the CPU (int8 weights, bf16 activations):

    out = (float32(aten._weight_int8pack_mm(x2d bf16, b^T, scale_b [N] as bf16)) + bias).to(out_dtype)

through Inductor's own lowering of that op (an extern ATen call, or under max-autotune also its C++
GEMM template). Above M = 64 rows (`INT8PACK_MAX_ROWS`, measured) Inductor's own dequantize + bf16 mm
instead, the faster there (in float32 on a CPU without bf16 dot products, where a bf16 mm is emulated: the same
products and sums); a dynamic M guarded on that bound. A weight zero point stays an extern call:
the eager kernel drops an all-zero one (PT2E's symmetric weights) at run time, which generated code
cannot decide at compile time.

`qfuse::int4_weight_only_mm` on the CPU under freezing: the weight is a graph constant, so it is packed
into ATen's int4pack layout at compile time (`lowerings.frozen`) and the kernel called from the code
(under max-autotune also Inductor's C++ template on the constant weight):

    out = (aten._weight_int4pack_mm_for_cpu(x2d[:, order]?, packed, g, scales_and_zeros) + bias).to(out_dtype)

Without freezing the op's extern call repacks once and calls the kernel, with Python on every call that
costs more than the bare kernel at M = 1 (docs/benchmarks.md, "Again with freezing, qfuse in the joint-graph
stage": the AMX host).
"""

from __future__ import annotations

import sympy
import torch
from torch._inductor import ir

from qfuse.kernels.prepared import Packing
from qfuse.kernels.torch_native import (BF16_INT8PACK_K_MULTIPLE, FLOAT32_INT8_MIN_ROWS, INT8PACK_MAX_ROWS, TorchKernel,
                                       int8_matmul_in_float32, zero_point_correction)
from qfuse.lowerings.aten_linear import scale_shape, scaled_epilogue, why_not_aten_gemm
from qfuse.lowerings.dispatch import KernelLowering
from qfuse.lowerings.frozen import constant_weight, prepared_now
from qfuse.lowerings.ir import (IR_OPS, as_matrix, rows_and_k, convert, extern_call, known_equal, lower, numel, record_lowering,
                                rows_at_most, tensor_constant)
from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs
from qfuse.ops.scaled_mm import ScaledMmArgs
from qfuse.ops.weight_only import WeightOnlyScaledMmArgs
from qfuse.platform import current_platform
from qfuse.schemes import FP8_DTYPE

aten = torch.ops.aten


# qfuse::scaled_mm


def _why_not_scaled_mm(call: ScaledMmArgs) -> str:
    return why_not_aten_gemm(call, rows_and_k(call.a)[0])


def _int8_accumulator(a2d, b, azp_a, azp_b, rows, k):
    """(the float32 accumulator of (a - azp_a) @ (b - azp_b), what the record adds to the lowering's description:
    '' for `aten._int_mm` and for the K == 1 outer product, else the float32 GEMMs)."""
    how = ""
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
        if on_cpu and _int8_sums_in_float32(rows, k):
            acc = int8_matmul_in_float32(a2d, b, int(k), IR_OPS)
            how = ("; the int8 GEMM as exact float32 GEMMs of K <= 1024, summed in int32 (this CPU has no int8 dot "
                   "instructions: torch._int_mm is emulated, slower from 8 rows)")
        else:
            acc = lower(aten._int_mm.default, a2d, b)
    zero_a = None if azp_a is None else lower(aten.reshape.default, convert(azp_a, torch.int32),
                                               scale_shape(azp_a, rows, [rows, 1]))
    zero_b = None if azp_b is None else lower(aten.reshape.default, convert(azp_b, torch.int32), [1, -1])
    acc = zero_point_correction(acc, a2d, b, zero_a, zero_b, k, IR_OPS)
    return convert(acc, torch.float32), how


def _int8_sums_in_float32(rows, k) -> bool:
    """Whether the CPU int8 GEMM runs as exact float32 GEMMs (`torch_native.int8_matmul_in_float32`): on a CPU
    without int8 dot instructions, a static K, and M from FLOAT32_INT8_MIN_ROWS (a dynamic M guarded)."""
    return (not current_platform("cpu").cpu_has_int8_dot_products and isinstance(k, (int, sympy.Integer))
            and not rows_at_most(rows, FLOAT32_INT8_MIN_ROWS - 1))


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


def _lower_scaled_mm(call: ScaledMmArgs):
    a2d, lead, rows, k = as_matrix(call.a)
    b, scale_a, scale_b, bias, out_dtype = call.b, call.scale_a, call.scale_b, call.bias, call.out_dtype
    if a2d.get_dtype() == FP8_DTYPE and (fused := _cublas_scaled(a2d, b, scale_a, scale_b, bias, rows, out_dtype)) is not None:
        record_lowering("ATen _scaled_mm (cuBLAS), scales and bias inside the GEMM")
        out = fused
    else:
        how = ""
        if a2d.get_dtype() == torch.int8:
            acc, how = _int8_accumulator(a2d, b, call.azp_a, call.azp_b, rows, k)
        else:
            acc = _fp8_accumulator(a2d, b)
        record_lowering("Inductor's own GEMM lowering; scales, bias and cast in its fused pointwise code" + how)
        out = scaled_epilogue(acc, scale_a, scale_b, bias, rows, out_dtype)
    return lower(aten.reshape.default, out, [*lead, b.get_size()[1]])


# qfuse::weight_only_scaled_mm


def _why_not_weight_only(call: WeightOnlyScaledMmArgs) -> str:
    """'' if this call lowers to `aten._weight_int8pack_mm` (or above its rows Inductor's dequantize + mm)."""
    if call.x.get_device().type != "cpu" or call.b.get_dtype() != torch.int8 or call.x.get_dtype() != torch.bfloat16:
        return "only the CPU int8 weight-only GEMM of a bf16 activation is lowered"
    if call.azp_b is not None:
        return "a weight zero point: the op drops an all-zero one at run time, which the generated code cannot see"
    k, n = call.b.get_size()
    if not known_equal(sympy.Mod(k, BF16_INT8PACK_K_MULTIPLE), 0):
        return f"K is not a multiple of {BF16_INT8PACK_K_MULTIPLE}"
    if call.scale_b is not None and not (known_equal(numel(call.scale_b), 1) or known_equal(numel(call.scale_b), n)):
        return "the weight scale is neither one value nor one per output channel"
    return ""


def _lower_weight_only(call: WeightOnlyScaledMmArgs):
    x2d, lead, rows, _ = as_matrix(call.x)
    n = call.b.get_size()[1]
    if not rows_at_most(rows, INT8PACK_MAX_ROWS):  # prefill: Inductor's dequantize + mm is faster
        weight = convert(call.b, torch.float32)
        if call.scale_b is not None:
            weight = lower(aten.mul.Tensor, weight, lower(aten.reshape.default, convert(call.scale_b, torch.float32), [1, -1]))
        weight = ir.ExternKernel.realize_input(convert(weight, torch.bfloat16))  # rounded to bf16, as the op's math
        how = "Inductor's own dequantize + mm (M > 64, where it is faster)"
        if current_platform("cpu").cpu_has_bf16_dot_products:
            out = lower(aten.mm.default, x2d, weight)
            how += " in bf16"
        else:  # the same products, exact in float32, and the same float32 sums
            out = lower(aten.mm.default, convert(x2d, torch.float32), convert(weight, torch.float32))
            how += " in float32: this CPU has no bf16 dot products, where a bf16 mm is emulated"
    else:
        weight = lower(aten.permute.default, call.b, [1, 0])  # [N, K]: the stored weight of a w.t() view
        if call.scale_b is None:
            scale = lower(aten.full.default, [n], 1.0, dtype=torch.bfloat16, device=call.x.get_device())
        else:
            scale = lower(aten.expand.default, lower(aten.reshape.default, convert(call.scale_b, torch.bfloat16), [-1]), [n])
        scale = ir.ExternKernel.require_contiguous(scale)  # the ATen call reads a realized [N] buffer
        x2d = ir.ExternKernel.require_contiguous(x2d)  # K = 1 views can have another stride
        out = lower(aten._weight_int8pack_mm.default, x2d, weight, scale)
        how = "Inductor's lowering of aten._weight_int8pack_mm; bias and cast in its fused pointwise code"
    if call.bias is not None:
        out = lower(aten.add.Tensor, convert(out, torch.float32), convert(call.bias, torch.float32))
    record_lowering(how)
    return lower(aten.reshape.default, convert(out, call.out_dtype), [*lead, n])


# qfuse::int4_weight_only_mm


def _why_not_int4(call: Int4WeightOnlyMmArgs) -> str:
    if call.x.get_device().type != "cpu":
        return "ATen's CUDA tinygemm runs as the op's extern call"
    if constant_weight(call) is None:
        return "the weight is no graph constant (no freezing): the op packs it once, on its first call"
    return ""


def _lower_int4(call: Int4WeightOnlyMmArgs):
    """x2d @ w + bias, cast to the op's output dtype, with the weight packed now into ATen's int4pack
    layout as graph constants (a weight whose preparation is no int4pack layout stays the extern call)."""
    weight = prepared_now(call, constant_weight(call))
    if weight.packing != Packing.INT4PACK_CPU:
        reason = ("the weight was dequantized once (no int4 kernel takes it exactly)" if weight.packing == Packing.DENSE
                  else "qfuse's C++ int4 kernel runs as the op's extern call")
        return extern_call(call, reason)
    x2d, lead, _, _ = as_matrix(call.x)
    packed = tensor_constant(weight.data, "qfuse_int4pack_weight")
    scales_and_zeros = tensor_constant(weight.scale.to(x2d.get_dtype()), "qfuse_int4pack_scales")
    if weight.input_order is not None:  # act order: the weight's rows were sorted by group
        x2d = lower(aten.index.Tensor, x2d, [None, tensor_constant(weight.input_order, "qfuse_int4pack_order")])
    group_size = weight.k // weight.scale.shape[0]
    x2d = ir.ExternKernel.require_contiguous(x2d)  # as the kernel's x.contiguous()
    out = lower(aten._weight_int4pack_mm_for_cpu.default, x2d, packed, group_size, scales_and_zeros)
    if call.bias is not None:
        out = lower(aten.add.Tensor, out, convert(call.bias, out.get_dtype()))
    record_lowering("ATen's _weight_int4pack_mm_for_cpu on the frozen weight, packed at compile time; the bias, "
                    "the cast and what follows in Inductor's code")
    return lower(aten.reshape.default, convert(out, call.out_dtype), [*lead, weight.n])


KERNEL = TorchKernel.name
LOWERINGS = {
    ScaledMmArgs: KernelLowering(_why_not_scaled_mm, _lower_scaled_mm),
    WeightOnlyScaledMmArgs: KernelLowering(_why_not_weight_only, _lower_weight_only),
    Int4WeightOnlyMmArgs: KernelLowering(_why_not_int4, _lower_int4),
}
