"""`qfuse::w4a8_scaled_mm`: a linear with int4 weights and int8 activations (W4A8).

    w4a8_scaled_mm(a, scale_a, b, scale_b, bias, group_size, out_dtype, kernel)
        = (a * scale_a) @ (b * scale_b, each scale row covering `group_size` rows of K) + bias,
          cast to out_dtype

Operands: `a` the symmetric int8 activation [..., K] (the output is [..., N]) and `scale_a` its
float scale, one value or one per token ([..., 1]). The model's graph quantizes the activation with
its own formula and the op takes its q and scale, so the rewrite keeps the model's quantizer,
whatever it writes. `b` the int4 weight as a [K, N] int8 matrix of values in [-8, 7], any strides
(usually `w.t()` of a stored [N, K]); kernels that pack it do so once per weight
(`qfuse.kernels.prepared`). `group_size` g > 0 with `scale_b` [K / g, N] (g divides K), or g = -1
for per-channel scales, `scale_b` [N] or [1, N]. `bias` [N].

Kernels: those whose capability table has an int8-activation, int4-weight row (`W4A8_KERNELS`: `xpu`,
oneDNN's int4 x int8 matmul, and `reference`). A kernel that does not read a g-group scale as it is
(`Kernel.reads_group_scales`: the reference math reads a scale per value, row, column or 128-block) gets
it expanded to one per value. This is a separate op because `qfuse::scaled_mm` takes int8 / fp8 weights
whose block scales are 128 x 128; int4 values with any group size do not fit that contract.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qfuse.kernels.prepared import prepare_once
from qfuse.kernels.registry import KERNELS, get_kernel
from qfuse.ops.arguments import op_arguments
from qfuse.ops.scaled_mm import OUT_DTYPES
from qfuse.schemes import INT4_DTYPE

PER_CHANNEL = -1  # group_size for one scale per output channel
#: The kernels that compute W4A8: a capability row of int8 activations and int4 weights
W4A8_KERNELS = tuple(name for name, kernel in KERNELS.items()
                     if any(INT4_DTYPE in row.weight_dtypes and torch.int8 in row.activation_dtypes
                            for row in kernel.capabilities))
_OP = "qfuse::w4a8_scaled_mm"


def _check_operands(a, scale_a, b, scale_b, bias, out_dtype, kernel) -> None:
    if a.dtype != torch.int8:
        raise ValueError(f"{_OP}: activation must be int8 (quantized), got {a.dtype}")
    if not scale_a.dtype.is_floating_point:
        raise ValueError(f"{_OP}: scale_a must be floating point, got {scale_a.dtype}")
    if scale_a.numel() != 1 and tuple(scale_a.shape) != (*a.shape[:-1], 1):
        raise ValueError(f"{_OP}: scale_a must be one value or one per token {(*a.shape[:-1], 1)}, "
                         f"got {tuple(scale_a.shape)}")
    if b.dtype != torch.int8 or b.dim() != 2:
        raise ValueError(f"{_OP}: weight must be an int8 [K, N] matrix of int4 values, got {b.dtype} {tuple(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(f"{_OP}: activation has K={a.shape[-1]} but the [K, N] weight has {b.shape[0]} rows")
    if not scale_b.dtype.is_floating_point:
        raise ValueError(f"{_OP}: scale_b must be floating point, got {scale_b.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[1]):
        raise ValueError(f"{_OP}: bias must have shape [{b.shape[1]}], got {tuple(bias.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{_OP}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if kernel not in W4A8_KERNELS:
        raise ValueError(f"{_OP}: kernel {kernel!r} does not implement W4A8; use one of {W4A8_KERNELS}")


def _group_scale(scale_b: torch.Tensor, k: int, n: int, group_size: int) -> tuple[torch.Tensor, int]:
    """scale_b as [K / g, N] and g (K for per-channel scales)."""
    if group_size == PER_CHANNEL:
        if scale_b.numel() != n:
            raise ValueError(f"{_OP}: per-channel scale_b must have {n} values, got shape {tuple(scale_b.shape)}")
        return scale_b.reshape(1, n), k
    if group_size <= 0 or k % group_size:
        raise ValueError(f"{_OP}: group_size must be -1 (per channel) or a positive divisor of K={k}, got {group_size}")
    if tuple(scale_b.shape) != (k // group_size, n):
        raise ValueError(f"{_OP}: scale_b must have shape {(k // group_size, n)} for group_size {group_size}, "
                         f"got {tuple(scale_b.shape)}")
    return scale_b, group_size


@torch.library.custom_op("qfuse::w4a8_scaled_mm", mutates_args=())
def w4a8_scaled_mm(a: Tensor, scale_a: Tensor, b: Tensor, scale_b: Tensor, bias: Tensor | None, group_size: int,
                   out_dtype: torch.dtype, kernel: str) -> Tensor:
    _check_operands(a, scale_a, b, scale_b, bias, out_dtype, kernel)
    (k, n), out_shape = b.shape, (*a.shape[:-1], b.shape[1])
    scale, group = _group_scale(scale_b, k, n, group_size)
    implementation = get_kernel(kernel)
    if not implementation.reads_group_scales:
        scale = scale.repeat_interleave(group, dim=0)  # [K, N]: one scale a weight value
    weight = prepare_once(implementation, b, scale, None)
    token_scale = scale_a.reshape(1, 1) if scale_a.numel() == 1 else scale_a.reshape(-1, 1)
    out = implementation.apply(a.reshape(-1, k), weight, token_scale, bias, None, out_dtype)
    return out.reshape(out_shape)


@w4a8_scaled_mm.register_fake
def _(a, scale_a, b, scale_b, bias, group_size, out_dtype, kernel):
    _check_operands(a, scale_a, b, scale_b, bias, out_dtype, kernel)
    _group_scale(scale_b, b.shape[0], b.shape[1], group_size)
    return a.new_empty((*a.shape[:-1], b.shape[1]), dtype=out_dtype)


class W4a8ScaledMmArgs(op_arguments(torch.ops.qfuse.w4a8_scaled_mm.default)):
    """`qfuse::w4a8_scaled_mm`'s arguments by name; its fields are the parameters of the op above."""
