"""Inductor lowering of `qfuse::weight_only_scaled_mm`: the `torch` kernel's CPU int8 path here, the
`triton` kernel's W8A16 in `qfuse.lowerings.w8a16`.

The torch kernel computes a weight-only int8 linear with `aten._weight_int8pack_mm` (see
`qfuse.kernels.torch_native`). Lowered into Inductor IR that is the same call, through Inductor's own
lowering of that op (an extern ATen call, or under max-autotune also its C++ GEMM template), and the
bias and output cast become pointwise IR that fuses with what follows: no Python op per call.

    out = (float32(aten._weight_int8pack_mm(x2d bf16, b^T, scale_b [N] as bf16)) + bias).to(out_dtype)

Above M = 64 rows (`INT8PACK_MAX_ROWS`, measured) it lowers to Inductor's own dequantize + bf16 mm
instead, the faster there; a dynamic M is guarded on that bound (`ir.rows_at_most`), so each side of
it gets its own compiled code.
A call with a weight zero point stays an extern call too: the eager kernel drops an all-zero one (PT2E's
symmetric weights) at run time, which generated code cannot decide at compile time.

Other kernels (onednn's fp8 W8A16) and other weights stay an extern call of the op.
"""

from __future__ import annotations

import sympy
import torch
from torch._inductor import ir
from torch._inductor import lowering as inductor_lowering

from qfuse.kernels.torch_native import BF16_INT8PACK_K_MULTIPLE, INT8PACK_MAX_ROWS
from qfuse.lowerings import w8a16
from qfuse.lowerings.ir import (convert, extern_call, falls_back_to_extern_call, known_equal, lower, numel, record_lowering,
                                rows_at_most)
from qfuse.ops.weight_only import WeightOnlyScaledMmArgs

aten = torch.ops.aten


def why_not_lowered(call: WeightOnlyScaledMmArgs) -> str:
    """'' if this call lowers to `aten._weight_int8pack_mm`, else why it stays an extern call."""
    if call.kernel != "torch":
        return f"kernel {call.kernel!r} runs as an extern call"
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


@falls_back_to_extern_call(WeightOnlyScaledMmArgs)
def lower_weight_only_scaled_mm(*args, **kwargs):
    call = WeightOnlyScaledMmArgs(*args, **kwargs)
    reason = w8a16.why_not_lowered(call) if call.kernel == "triton" else why_not_lowered(call)
    if reason:
        return extern_call(call, reason)
    if call.kernel == "triton":
        return w8a16.lower_w8a16(call)
    *lead, k = call.x.get_size()
    n = call.b.get_size()[1]
    x2d = lower(aten.reshape.default, call.x, [-1, k])
    if not rows_at_most(sympy.Mul(*lead), INT8PACK_MAX_ROWS):  # prefill: Inductor's dequantize + bf16 mm is faster
        weight = convert(call.b, torch.float32)
        if call.scale_b is not None:
            weight = lower(aten.mul.Tensor, weight, lower(aten.reshape.default, convert(call.scale_b, torch.float32), [1, -1]))
        out = lower(aten.mm.default, x2d, convert(weight, torch.bfloat16))
        return _bias_and_cast(call, out, lead, n, "Inductor's own dequantize + bf16 mm (M > 64, where it is faster)")
    weight = lower(aten.permute.default, call.b, [1, 0])  # [N, K]: the stored weight of a w.t() view
    if call.scale_b is None:
        scale = lower(aten.full.default, [n], 1.0, dtype=torch.bfloat16, device=call.x.get_device())
    else:
        scale = lower(aten.expand.default, lower(aten.reshape.default, convert(call.scale_b, torch.bfloat16), [-1]), [n])
    scale = ir.ExternKernel.require_contiguous(scale)  # the ATen call reads a realized [N] buffer
    x2d = ir.ExternKernel.require_contiguous(x2d)  # K = 1 views can have another stride
    out = lower(aten._weight_int8pack_mm.default, x2d, weight, scale)
    return _bias_and_cast(call, out, lead, n, "Inductor's lowering of aten._weight_int8pack_mm; bias and cast in "
                          "its fused pointwise code")


def _bias_and_cast(call: WeightOnlyScaledMmArgs, out, lead, n, how: str):
    if call.bias is not None:
        out = lower(aten.add.Tensor, convert(out, torch.float32), convert(call.bias, torch.float32))
    record_lowering(how)
    return lower(aten.reshape.default, convert(out, call.out_dtype), [*lead, n])


def register() -> None:
    inductor_lowering.register_lowering(WeightOnlyScaledMmArgs.op, type_promotion_kind=None)(lower_weight_only_scaled_mm)
