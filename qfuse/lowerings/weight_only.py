"""Inductor lowering of `qfuse::weight_only_scaled_mm` for the `torch` kernel's CPU int8 path.

The kernel computes a weight-only int8 linear with `aten._weight_int8pack_mm` (see
`qfuse.kernels.torch_native`). Lowered into Inductor IR that is the same call, through Inductor's own
lowering of that op (an extern ATen call, or under max-autotune also its C++ GEMM template), and the
bias and output cast become pointwise IR that fuses with what follows: no Python op per call.

    out = (float32(aten._weight_int8pack_mm(x2d, b^T, scale_b [N] in x's dtype)) + bias).to(out_dtype)

with a weight zero point the GEMM runs in float32 and subtracts rowsum(x) * azp_b * scale_b, as the
eager kernel (`torch_native.weight_only_int8_mm`) does.

Other kernels (onednn's fp8 W8A16) and other weights stay an extern call of the op.
"""

from __future__ import annotations

import logging

import sympy
import torch
from torch._inductor import ir
from torch._inductor import lowering as inductor_lowering

from qfuse.kernels.torch_native import weight_only_int8_compute_dtype
from qfuse.lowerings.ir import convert, extern_call, known_equal, lower, numel, record_lowering
from qfuse.ops.weight_only import WeightOnlyScaledMmArgs

aten = torch.ops.aten
log = logging.getLogger("qfuse")


def why_not_lowered(call: WeightOnlyScaledMmArgs) -> str:
    """'' if this call lowers to `aten._weight_int8pack_mm`, else why it stays an extern call."""
    if call.kernel != "torch":
        return f"kernel {call.kernel!r} runs as an extern call"
    if call.x.get_device().type != "cpu" or call.b.get_dtype() != torch.int8:
        return "only the CPU int8 weight-only GEMM is lowered"
    k, n = call.b.get_size()
    if not sympy.sympify(k).is_number:
        return "K is symbolic"
    if call.scale_b is not None and not (known_equal(numel(call.scale_b), 1) or known_equal(numel(call.scale_b), n)):
        return "the weight scale is neither one value nor one per output channel"
    return ""


def lower_weight_only_scaled_mm(*args, **kwargs):
    call = WeightOnlyScaledMmArgs(*args, **kwargs)
    reason = why_not_lowered(call)
    if reason:
        log.debug("qfuse: weight_only_scaled_mm stays an extern call: %s", reason)
        record_lowering(f"extern call of qfuse::weight_only_scaled_mm ({reason})")
        return extern_call(call)
    *lead, k = call.x.get_size()
    n = call.b.get_size()[1]
    compute = weight_only_int8_compute_dtype(call.x.get_dtype(), int(k), call.azp_b is not None)  # as the eager kernel
    x2d = lower(aten.reshape.default, call.x, [-1, k])
    weight = lower(aten.permute.default, call.b, [1, 0])  # [N, K]: the stored weight of a w.t() view
    if call.scale_b is None:
        scale = lower(aten.full.default, [n], 1.0, dtype=compute, device=call.x.get_device())
    else:
        scale = lower(aten.expand.default, lower(aten.reshape.default, convert(call.scale_b, compute), [-1]), [n])
    scale = ir.ExternKernel.require_contiguous(scale)  # the ATen call reads a realized [N] buffer
    x2d = ir.ExternKernel.require_contiguous(convert(x2d, compute))  # K = 1 views can have another stride
    out = lower(aten._weight_int8pack_mm.default, x2d, weight, scale)
    if call.azp_b is not None:  # minus rowsum(x) * (azp_b * scale_b), in float32 (torch_native.weight_only_int8_mm)
        row_sums = lower(aten.sum.dim_IntList, convert(x2d, torch.float32), [1], True)
        zero_point = lower(aten.reshape.default, convert(call.azp_b, torch.float32), [1, -1])
        out = lower(aten.sub.Tensor, out, lower(aten.mul.Tensor, row_sums, lower(aten.mul.Tensor, zero_point, scale)))
    if call.bias is not None:
        out = lower(aten.add.Tensor, convert(out, torch.float32), convert(call.bias, torch.float32))
    record_lowering("Inductor's lowering of aten._weight_int8pack_mm; bias and cast in its fused pointwise code")
    return lower(aten.reshape.default, convert(out, call.out_dtype), [*lead, n])


def register() -> None:
    inductor_lowering.register_lowering(WeightOnlyScaledMmArgs.op, type_promotion_kind=None)(lower_weight_only_scaled_mm)
