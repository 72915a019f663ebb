"""The `triton` kernel's lowerings of `qfuse::dynamic_quant` and `qfuse::silu_mul_quant`: its Triton
quantizers launched from Inductor's code.

On CUDA, with a per-token or per-group scale, the op enters Inductor's generated
code as a user-defined Triton kernel (`qfuse.kernels.triton.quant._dynamic_quant_kernel`, as
`torch.library.wrap_triton` would put it there): the wrapper launches it directly, with no Python op
between the compiled graph and the launch. It reads x in its own dtype and writes q and the scale,
computed in `scale_dtype` (the passes hand it a bf16 activation whose model code upcast it first).
`silu_mul_quant` reads gate and up (rows of either may be strided, as slices of one merged gate_up
GEMM output are) and never writes their product.

Everything else (a CPU, a per-tensor scale, rows too wide for a program) is an extern call of the op.
"""

from __future__ import annotations

import sympy
import torch
from torch._inductor import ir

from qfuse.kernels.triton import TritonKernel
from qfuse.lowerings.ir import launch_user_triton_kernel, lower, numel, record_lowering
from qfuse.ops.quantize import DynamicQuantArgs, SiluMulQuantArgs
from qfuse.schemes import GROUP_SIZE, Granularity

aten = torch.ops.aten
GRANULARITIES = {Granularity.PER_TOKEN.value, Granularity.PER_GROUP.value}


def why_not(call) -> str:
    """'' if the call (`DynamicQuantArgs` or `SiluMulQuantArgs`) is launched as a Triton quantizer from
    the generated code, else why not."""
    x = call.x if isinstance(call, DynamicQuantArgs) else call.gate
    if x.get_device().type != "cuda":
        return "the Triton quantizer enters generated code on CUDA only"
    if isinstance(call, DynamicQuantArgs) and call.granularity not in GRANULARITIES:
        return f"granularity {call.granularity!r}: the Triton quantizer takes per-token and per-group scales"
    if not x.get_size() or not isinstance(x.get_size()[-1], (int, sympy.Integer)):
        return "the quantized dim is not a static size"
    if int(x.get_size()[-1]) > TritonKernel.quant_max_row:
        return f"rows of {x.get_size()[-1]} values: wider than a program of the Triton quantizer holds"
    return ""


def _outputs(size: list, quant_dtype: torch.dtype, scale_dtype: torch.dtype, groups: int, device):
    """Empty q [size] and scale [size[:-1], groups] buffers for the kernel to write."""
    q = lower(aten.empty_strided.default, size, None, dtype=quant_dtype, device=device)
    scale = lower(aten.empty_strided.default, [*size[:-1], groups], None, dtype=scale_dtype, device=device)
    return q, scale


def _rows(node, width: int):
    return sympy.simplify(numel(node) / width) if width else sympy.Integer(0)


def _row_stride(node):
    """`node` ready for a kernel that reads rows of unit stride, and its row stride: a 2D buffer whose
    layout is fixed with a unit last stride as it is (a slice of a merged gate_up output), else a
    contiguous one."""
    if len(node.get_size()) == 2 and ir.is_storage_and_layout(node):
        _, layout = ir.as_storage_and_layout(node, freeze=False)
        if isinstance(layout, ir.FixedLayout) and layout.stride[1] == 1:
            return node, layout.stride[0]
    node = ir.ExternKernel.require_contiguous(node)
    return node, node.get_size()[-1]


def lower_dynamic_quant(call: DynamicQuantArgs):
    from qfuse.kernels.triton.quant import _dynamic_quant_kernel, dynamic_quant_warps, next_power_of_2, quant_constants

    x = ir.ExternKernel.require_contiguous(call.x)
    size = list(x.get_size())
    width = int(size[-1])
    group = width if call.granularity == Granularity.PER_TOKEN.value else GROUP_SIZE
    groups = width // group
    rows = _rows(x, width)
    scale_dtype = call.scale_dtype or x.get_dtype()  # the op's fake checked it (a wider float)
    device = x.get_device()
    q, scale = _outputs(size, call.quant_dtype, scale_dtype, groups, device)
    block = next_power_of_2(group)
    launch_user_triton_kernel(
        _dynamic_quant_kernel, grid=(rows, groups, 1), num_warps=dynamic_quant_warps(block),
        tensors={"x_ptr": x, "q_ptr": q, "scale_ptr": scale},
        scalars={"width": width, "groups": groups, "stride_x": width, "stride_q": width, "GROUP": group,
                 "BLOCK": block, **quant_constants(call.quant_dtype, call.eps, interpreted=False)},
    )
    record_lowering("the Triton quantizer, launched from Inductor's generated code")
    return q, scale


def lower_silu_mul_quant(call: SiluMulQuantArgs):
    from qfuse.kernels.triton.quant import (_silu_mul_quant_kernel, next_power_of_2, quant_constants,
                                            silu_mul_quant_warps)

    gate, stride_gate = _row_stride(call.gate)
    up, stride_up = _row_stride(call.up)
    size = list(gate.get_size())
    width = int(size[-1])
    q, scale = _outputs(size, call.quant_dtype, call.scale_dtype or up.get_dtype(), 1, gate.get_device())
    block = next_power_of_2(width)
    launch_user_triton_kernel(
        _silu_mul_quant_kernel, grid=(_rows(gate, width), 1, 1), num_warps=silu_mul_quant_warps(block),
        tensors={"gate_ptr": gate, "up_ptr": up, "q_ptr": q, "scale_ptr": scale},
        scalars={"width": width, "stride_gate": stride_gate, "stride_up": stride_up, "stride_q": width,
                 "BLOCK": block, **quant_constants(call.quant_dtype, call.eps, interpreted=False)},
    )
    record_lowering("the Triton SiLU * mul quantizer, launched from Inductor's generated code")
    return q, scale
