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
eager does (`qfuse.kernels.cpu.int4_zero_points`). torchao's int8 storage has its zero points looked at
when the weight is prepared: those that fold into the values (all zero, for its symmetric default) leave
no zero point; values outside [-8, 7] get a weight dequantized once (`Packing.DENSE`, exact, twice the int8
weight's memory).

Against Inductor's own code for the GPTQ form (bf16) the compiled op is far faster at decode, its lead
shrinking with M until Inductor's dequantize + mm is faster at 256 rows (measured: docs/benchmarks.md,
"qfuse's int4 weight-only linear"). So a static M above `MAX_ROWS` is left to Inductor
(`TorchKernel.can_implement`); a dynamic M runs here at every M. In float32 the kernel's time grows by about
its one-row time with every row (docs/benchmarks.md, "torchao's int4 \"intx\" form"), so float32 runs here at a
static M = 1 only.
"""

from __future__ import annotations

import torch

from qfuse.kernels.cpu import int4_zero_points
from qfuse.kernels.prepared import Packing, PreparedWeight, dense_int4_weight
from qfuse.schemes import INT4_OFFSET

GROUP_SIZES = (32, 64, 128, 256)
MAX_ROWS = 128
N_MULTIPLE = 16
_INNER_K_TILES = 1  # what the CPU kernel's repack takes (it ignores other values)
#: what `pack` prepares: ATen's layout, or qfuse's kernel with zero points (`int4pack_mm` runs either)
PACKINGS = (Packing.INT4PACK_CPU, Packing.INT4_ZERO_POINTS_BF16, Packing.INT4_ZERO_POINTS_FP16)


def holds_zero_points(activation_dtype: torch.dtype) -> bool:
    """Whether the float zero f = -z * s is exact enough in this activation dtype (the module docstring)."""
    return activation_dtype == torch.float32


def pack(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> PreparedWeight:
    """The int4 weight (int8 [K, N] values in [-8, 7], scale [K / g, N], zero point [K / g, N] or None)
    in ATen's CPU layout; where the zero points are not held exactly (scales in bf16 / fp16), in the layout of
    qfuse's exact kernel with zero points (`qfuse.kernels.cpu.int4_zero_points`), or DENSE where that cannot
    hold the weight (values outside [-8, 7], odd K or group) or did not build here."""
    if zero_point is not None and not holds_zero_points(scale.dtype):
        group_size = values.shape[0] // scale.shape[0]
        if not (reason := int4_zero_points.why_not(values, group_size) or int4_zero_points.why_not_built(scale.dtype)):
            return int4_zero_points.pack(values, scale, zero_point)
        return dense_int4_weight(values, scale, zero_point, f"qfuse's int4 kernel with zero points cannot take it: {reason}")
    unsigned = (values.to(torch.int32) + INT4_OFFSET).t().contiguous()  # [N, K], 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, _INNER_K_TILES)
    zero = torch.zeros_like(scale) if zero_point is None else -zero_point.to(scale.dtype) * scale
    return PreparedWeight(packed, torch.stack([scale, zero], dim=-1).contiguous(), None, *values.shape, packing=Packing.INT4PACK_CPU)


def int4pack_mm(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ w + bias, cast to `out_dtype` (the bias added in x's dtype, as a float linear would), on the
    kernel `pack` prepared the weight for."""
    if weight.packing in (Packing.INT4_ZERO_POINTS_BF16, Packing.INT4_ZERO_POINTS_FP16):
        return int4_zero_points.int4_zero_points_mm(x, weight, bias, out_dtype)
    group_size = weight.k // weight.scale.shape[0]
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), weight.data, group_size,
                                                     weight.scale.to(x.dtype))
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(out_dtype)
