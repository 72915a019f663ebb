"""The `cuda` kernel's lowerings: its W4A16 decode kernel called straight from Inductor's generated code.

    qfuse::int4_weight_only_mm           buf = extern_kernels.qfuse_cuda_int4_mma(x, weight tensors..., out=buf)
    qfuse::int4_weight_only_mm_siblings  the same on the members' weights, joined along N

The op's extern call runs torch's custom-op dispatch and the op's Python on every call (its checks, the
product's bookkeeping): several times the kernel's GPU time in host time, so without CUDA graphs it lost to
the Triton templates (docs/benchmarks.md, "The CUDA kernels without CUDA graphs"). Here the call's dtypes and
layout are checked once, at compile time, and the generated code calls a plain function that looks the
prepared weight up (`built_once`: the op's own preparation, the same cache entry, found by the tensors'
identity on a repeated call) and launches the kernel into the buffer Inductor allocated: a lookup and a C++
launch a call, less host time than the templates' launches, so kernel choice takes the kernel without CUDA graphs
too (docs/benchmarks.md, "Default mode on the CUDA int4 kernel").

A call the kernel does not compute with one launch as eager rounds it stays the op's extern call: GPTQ's act
order, int8 storage, a bias of another dtype, an output dtype other than x's or float32, the C++ wrapper. Kernel
choice knows these cases (`qfuse.kernels.cuda._why_not_from_inductors_code`, a bias of any dtype among them) and
without CUDA graphs leaves those linears to the Triton templates.
"""

from __future__ import annotations

import torch
from torch._inductor import ir
from torch._inductor.select_algorithm import extern_kernels
from torch._inductor.virtualized import V

from qfuse.kernels import get_kernel
from qfuse.kernels.cuda import CudaKernel, int4_mma
from qfuse.lowerings.dispatch import KernelLowering
from qfuse.lowerings.ir import as_matrix, current_record, lower, record_lowering
from qfuse.ops import SIBLING_ARGUMENTS
from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs, int4_product, prepared_int4_weight
from qfuse.ops.siblings import prepared_int4_siblings

aten = torch.ops.aten
KERNEL = CudaKernel.name
EXTERN_NAME = "qfuse_cuda_int4_mma"  # its name on Inductor's `extern_kernels`, which the generated code imports
_SOURCES = ("packed", "shifts", "scales", "packed_zeros")  # a member's weight-side tensors, in this order


def int4_mma_out(x: torch.Tensor, *tensors: torch.Tensor, has_bias: bool, present: tuple, siblings: bool,
                 group_size: int, zero_convention: str, packed_along_n: bool, out: torch.Tensor,
                 in_place: bool = False) -> torch.Tensor:
    """out = x [M, K] @ w + bias, w the int4 weight of the sources in `tensors` (after the bias where
    `has_bias`): each member's `_SOURCES` where `present` says so, the others None; `in_place`: their words read
    where they lie where the kernel can (`QfuseConfig.int4_in_place`)."""
    remaining = iter(tensors)
    bias = next(remaining) if has_bias else None
    sources = tuple(next(remaining) if here else None for here in present)
    kernel = get_kernel(KERNEL)
    if siblings:
        weight = prepared_int4_siblings(kernel, *(sources[i::len(_SOURCES)] for i in range(len(_SOURCES))),
                                        group_size, zero_convention, packed_along_n, in_place)
    else:
        weight = prepared_int4_weight(KERNEL, *sources, group_size, None, zero_convention, packed_along_n,
                                      in_place)[1]
    if not int4_mma.takes(weight, x.dtype):
        return out.copy_(int4_product(kernel, x, weight, bias, out.dtype))  # (a weight it could not take: dense)
    return int4_mma.multiply(x, weight, bias, out.dtype, out=out)


if not hasattr(extern_kernels, EXTERN_NAME):
    setattr(extern_kernels, EXTERN_NAME, int4_mma_out)


def _members(call) -> dict[str, list]:
    """The call's weight-side tensors by name, a list of one entry a member (one for the member op)."""
    fields = call._asdict()
    listed = ("bias", "g_idx", *_SOURCES)
    return {name: list(fields[name]) if isinstance(call.scales, (list, tuple)) else [fields[name]] for name in listed}


def _why_not(call) -> str:
    """'' where one launch of the kernel computes the call as eager rounds it, from Inductor's Python code."""
    if V.graph.cpp_wrapper:
        return "Inductor's C++ wrapper calls no Python function: the op's extern call"
    members = _members(call)
    dtype = call.x.get_dtype()
    if any(g_idx is not None for g_idx in members["g_idx"]):
        return "GPTQ's act order (g_idx): the op sorts x's columns each call"
    if any(packed.get_dtype() != torch.int32 for packed in members["packed"]):
        return "int8 storage: the op checks its values are int4 when it prepares them"
    if any(scales.get_dtype() != dtype for scales in members["scales"]):
        return "group scales of another dtype than x's: the op says why the kernel cannot take them"
    if call.out_dtype not in (dtype, torch.float32):
        return f"an output of {call.out_dtype}: the op rounds the kernel's float32 sums"
    biases = [bias for bias in members["bias"] if bias is not None]
    if biases and (len(members["bias"]) > 1 or biases[0].get_dtype() != dtype):
        return "a bias the kernel does not add as eager does (siblings' biases, or another dtype than x's)"
    return ""


def _lower(call):
    members = _members(call)
    x2d, lead, rows, _ = as_matrix(call.x)
    n = sum(scales.get_size()[0] for scales in members["scales"])  # scales [N, K / G] each
    sources = [tensor for member in zip(*(members[name] for name in _SOURCES)) for tensor in member]
    bias = members["bias"][0]
    inputs = [ir.ExternKernel.require_contiguous(x2d),
              *(ir.ExternKernel.realize_input(tensor) for tensor in (bias, *sources) if tensor is not None)]
    layout = ir.FixedLayout(x2d.get_device(), call.out_dtype, [rows, n])
    in_place = bool((record := current_record()) and record.int4_in_place)
    settings = dict(has_bias=bias is not None, present=tuple(tensor is not None for tensor in sources),
                    siblings=isinstance(call.scales, (list, tuple)), group_size=call.group_size,
                    zero_convention=call.zero_convention, packed_along_n=call.packed_along_n, in_place=in_place)
    node = ir.ExternKernelOut(layout, inputs, kwargs=settings, python_kernel_name=f"extern_kernels.{EXTERN_NAME}")
    record_lowering(f"extern_kernels.{EXTERN_NAME}: the kernel launched from Inductor's code (no op dispatch)"
                    + ("; the checkpoint's words read where they lie where the kernel can (int4_in_place)"
                       if in_place else ""))
    return lower(aten.reshape.default, ir.TensorBox.create(node), [*lead, n])


LOWERINGS = {arguments: KernelLowering(_why_not, _lower)
             for arguments in (Int4WeightOnlyMmArgs, SIBLING_ARGUMENTS["int4_weight_only_mm"])}
