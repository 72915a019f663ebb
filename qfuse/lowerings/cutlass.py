"""The `cutlass` kernel's lowering of `qfuse::scaled_mm`: without vLLM the kernel is ATen's row-wise
CUTLASS fp8 GEMM, and where it needs no padding (K and N multiples of 16) the lowering is that same
call in Inductor's code, its scales expanded to row-wise (`qfuse.kernels.cutlass`):

    out = aten._scaled_mm(a, b, scale_a [M, 1], scale_b [1, N], bias, bfloat16)

vLLM's CUTLASS op, and weights that need padding, stay the op's extern call.
"""

from __future__ import annotations

import torch
from torch._inductor import ir

from qfuse.kernels.cutlass import CutlassKernel, cutlass_backend
from qfuse.lowerings.aten_linear import why_not_aten_gemm, why_unaligned
from qfuse.lowerings.dispatch import KernelLowering
from qfuse.lowerings.ir import as_matrix, rows_and_k, convert, known_equal, lower, numel, record_lowering
from qfuse.ops.scaled_mm import ScaledMmArgs
from qfuse.platform import current_platform

aten = torch.ops.aten


def _why_not(call: ScaledMmArgs) -> str:
    if cutlass_backend(current_platform("cuda")) != "aten":
        return "the cutlass kernel calls vLLM's CUTLASS op"
    return why_unaligned(call.b) or why_not_aten_gemm(call, rows_and_k(call.a)[0])


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


def _lower(call: ScaledMmArgs):
    """The row-wise scaled fp8 GEMM (CUTLASS inside ATen), bf16 out."""
    a2d, lead, rows, _ = as_matrix(call.a)
    n = call.b.get_size()[1]
    sa = _rowwise_scale(call.scale_a, [rows, 1], a2d.get_device())
    sb = _rowwise_scale(call.scale_b, [1, n], a2d.get_device())
    record_lowering("ATen row-wise _scaled_mm (CUTLASS), scales and bias inside the GEMM")
    out = lower(aten._scaled_mm.default, a2d, call.b, sa, sb, call.bias, None, torch.bfloat16)
    return lower(aten.reshape.default, out, [*lead, n])


KERNEL = CutlassKernel.name
LOWERINGS = {ScaledMmArgs: KernelLowering(_why_not, _lower)}
