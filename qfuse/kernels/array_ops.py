"""One statement of a kernel's integer math, for eager tensors and Inductor IR alike.

A formula written against `ArrayOps` (the few ops that integer corrections need) runs on torch
tensors with `TORCH_OPS`, and in a lowering builds Inductor IR with `qfuse.lowerings.ir.IR_OPS`, so
a kernel's eager path and the code Inductor generates for it compute the same thing by construction:

    torch_native.zero_point_correction   acc - za colsum(b) - rowsum(a) zb + K za zb   (int8 zero points)
    torch_native.int8_matmul_in_float32  a @ b of int8 matrices as exact float32 GEMMs  (CPUs without int8 dot products)
    ops.int4_weight_only.apply_zero_convention   an int4 zero point read from its stored word

Operands are int32 (the caller converts), broadcasting as torch does; `int32_sum` keeps the summed dim; `narrow`
and `float32_mm_as_int32` take the int8 matrices themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class ArrayOps:
    add: Callable[[Any, Any], Any]
    sub: Callable[[Any, Any], Any]
    mul: Callable[[Any, Any], Any]
    bitwise_and: Callable[[Any, int], Any]
    int32_sum: Callable[[Any, int], Any]  # (t, dim): the int32 sum over dim, kept as a size-1 dim
    narrow: Callable[[Any, int, int, int], Any]  # (t, dim, start, length), as torch.narrow
    float32_mm_as_int32: Callable[[Any, Any], Any]  # (a, b): the float32 GEMM of a and b, converted to int32


TORCH_OPS = ArrayOps(
    add=torch.add, sub=torch.sub, mul=torch.mul, bitwise_and=torch.bitwise_and,
    int32_sum=lambda tensor, dim: tensor.sum(dim=dim, keepdim=True, dtype=torch.int32),
    narrow=torch.narrow,
    float32_mm_as_int32=lambda left, right: torch.mm(left.float(), right.float()).to(torch.int32),
)
