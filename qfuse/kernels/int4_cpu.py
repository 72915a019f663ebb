"""int4 weight-only GEMM on CPU with ATen's `_weight_int4pack_mm_for_cpu` (the `torch` kernel's W4A16).

    w[k, n] = (v[k, n] - z[k // g, n]) * s[k // g, n]      qfuse's int4 convention: v, z in [-8, 7]
            = (u[k, n] - 8) * s + f                         ATen's: u = v + 8 in [0, 15], a float zero
    f       = (8 - (z + 8)) * s = -z * s                    f = 0 for a symmetric weight

ATen wants the [N, K] values 0..15 repacked by `_convert_weight_to_int4pack_for_cpu` (N a multiple
of 16) and `scales_and_zeros` [K / g, N, 2] in the activation's dtype, g in {32, 64, 128, 256}.
The float zero f is held in that dtype: in float32 it is -z * s within one float32 rounding, as
eager's (q - z) * s is; in bf16 or fp16 a 4-bit integer times the scale can need more mantissa
bits than the dtype has, and the rounding of f would be a new error of up to 8 scale units. ATen's
kernel therefore takes zero points with float32 activations only (`holds_zero_points`); with bf16 /
fp16 activations `pack` prepares the weight for qfuse's own C++ kernel, which rounds each (q - z) * s as
eager does (`qfuse.kernels.cpu.int4_zero_points`). With float32 activations that kernel takes every weight
(zero points or none): ATen's float32 kernel's time grows by its one-row time with every row (about 15 ms a row
at K = N = 4096 on the development CPU), while qfuse's computes eager's float32 product (q - z) * s itself and
beat Inductor's own dequantize + mm by 22x at one row and 1.95x at 128 (docs/benchmarks.md, "int4 with float32
activations on the CPU"); ATen's layout is the fallback where it did not build. torchao's int8 storage has its
zero points looked at when the weight is prepared: those that fold into the values (all zero, for its symmetric
default) leave no zero point; values outside [-8, 7] get a weight dequantized once (`Packing.DENSE`, exact, twice the int8
weight's memory).

Against Inductor's own code for the GPTQ form (bf16) the compiled op is far faster at decode, its lead
shrinking with M until Inductor's dequantize + mm is faster at 256 rows (measured: docs/benchmarks.md,
"qfuse's int4 weight-only linear"). So a static M above `max_rows` (`MAX_ROWS`; fewer on an AMX CPU for values
stored a byte each, whose dequantize is cheap for Inductor's code) is left to Inductor
(`TorchKernel.why_inductor_is_faster`), and a dynamic M is guarded there: above it, the lowering writes Inductor's
own dequantize + mm (`TorchKernel.speed_row_bounds`, `lowerings.dispatch`).
"""

from __future__ import annotations

import torch

from qfuse.kernels.cpu import int4_zero_points
from qfuse.kernels.prepared import Packing, PreparedWeight, dense_int4_weight
from qfuse.schemes import INT4_OFFSET

GROUP_SIZES = (32, 64, 128, 256)
MAX_ROWS = 128
#: On an AMX CPU Inductor's bf16 GEMM runs on AMX tiles, and an int4 weight stored a byte a value (torchao's intx) is
#: dequantized by its code at a byte's cost: its dequantize + mm then passes the CPU int4 kernels above these many rows,
#: per activation dtype (measured on a 2-core AMX Xeon, 1024^2 to 4096^2: bf16 1.0-9.3x Inductor up to 8 rows,
#: 0.74-0.86x at 16, 0.33-0.45x at 64; float32 0.83-4.3x up to 16, 0.68x at 64 up to 2048^2; docs/benchmarks.md,
#: "cpu_grid on an AMX Xeon"). Words packed eight a value stay ahead there (1.1-2.2x at 64 rows).
BYTE_STORAGE_MAX_ROWS_ON_AMX = {torch.bfloat16: 8, torch.float32: 16}
N_MULTIPLE = 16
_INNER_K_TILES = 1  # what the CPU kernel's repack takes (it ignores other values)
#: what `pack` prepares: ATen's layout, or qfuse's C++ kernel's for each activation dtype (`int4pack_mm` runs either)
PACKINGS = (Packing.INT4PACK_CPU, *int4_zero_points.PACKINGS.values())


def max_rows(activation_dtype: torch.dtype, stored_a_byte_a_value: bool, amx: bool) -> int:
    """Up to how many rows the CPU int4 kernels beat Inductor's own dequantize + mm."""
    if amx and stored_a_byte_a_value:
        return BYTE_STORAGE_MAX_ROWS_ON_AMX.get(activation_dtype, MAX_ROWS)
    return MAX_ROWS


def holds_zero_points(activation_dtype: torch.dtype) -> bool:
    """Whether the float zero f = -z * s is exact enough in this activation dtype (the module docstring)."""
    return activation_dtype == torch.float32


def pack(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> PreparedWeight:
    """The int4 weight (int8 [K, N] values in [-8, 7], scale [K / g, N], zero point [K / g, N] or None)
    in the layout of qfuse's exact C++ kernel (`qfuse.kernels.cpu.int4_zero_points`) for float32 activations, and
    for bf16 / fp16 ones where the zero points are not held exactly (the module docstring); else in ATen's CPU
    layout. Where qfuse's kernel cannot hold the weight (values outside [-8, 7], odd K or group): DENSE (exact);
    where it did not build here: ATen's layout in float32, DENSE with bf16 / fp16 zero points."""
    float32 = scale.dtype == torch.float32
    rounded_zero_points = zero_point is not None and not holds_zero_points(scale.dtype)
    if float32 or rounded_zero_points:
        if reason := int4_zero_points.why_not(values, values.shape[0] // scale.shape[0]):
            return dense_int4_weight(values, scale, zero_point, f"qfuse's CPU int4 kernel cannot take it: {reason}")
        if not (reason := int4_zero_points.why_not_built(scale.dtype)):
            return int4_zero_points.pack(values, scale, zero_point)
        if rounded_zero_points:
            return dense_int4_weight(values, scale, zero_point, f"qfuse's CPU int4 kernel: {reason}")
    unsigned = (values.to(torch.int32) + INT4_OFFSET).t().contiguous()  # [N, K], 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, _INNER_K_TILES)
    zero = torch.zeros_like(scale) if zero_point is None else -zero_point.to(scale.dtype) * scale
    return PreparedWeight(packed, torch.stack([scale, zero], dim=-1).contiguous(), None, *values.shape, packing=Packing.INT4PACK_CPU)


def int4pack_mm(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ w + bias, cast to `out_dtype` (the bias added in x's dtype, as a float linear would), on the
    kernel `pack` prepared the weight for."""
    if weight.packing in int4_zero_points.PACKINGS.values():
        return int4_zero_points.int4_zero_points_mm(x, weight, bias, out_dtype)
    group_size = weight.k // weight.scale.shape[0]
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), weight.data, group_size,
                                                     weight.scale.to(x.dtype))
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)
