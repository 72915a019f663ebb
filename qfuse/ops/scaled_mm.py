"""`qfuse::scaled_mm` and `qfuse::quant_scaled_mm`: the fused quantized linear.

    scaled_mm(a, b, scale_a, scale_b, bias, azp_a, azp_b, out_dtype, kernel)
        = ((a - azp_a) * scale_a) @ ((b - azp_b) * scale_b) + bias, cast to out_dtype
    quant_scaled_mm(x, b, scale_a, scale_b, bias, quant_dtype, eps, out_dtype, kernel)
        = scaled_mm(quantize(x), ...), quantizing x dynamically per token (scale_a None) or with
          the given static scale_a, inside the kernel.

Operands: `a` is [..., K] int8 or fp8 (the output is [..., N]); `b` is the weight as a [K, N]
matrix of the same dtype family, any strides (a `w.t()` view of a stored [N, K] weight is the
usual case). Scales: `scale_a` one value, one per row of a (any shape with that many elements and
a trailing 1), or one per row and 128-group of K; `scale_b` one value, [N] / [1, N], or one per
128x128 block [ceil(K/128), ceil(N/128)]; `bias` [N]; integer zero points `azp_a` (one value or
one per row) and `azp_b` (one value or one per output channel). `kernel` names the registry kernel
the compiler chose for this call; its prepared form of the weight is made once per weight
(`qfuse.kernels.prepared`).

Passes and lowerings read and emit these calls through `ScaledMmArgs` / `QuantScaledMmArgs`, the
ops' arguments by name (`qfuse.ops.arguments`), never by position.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qfuse.kernels import get_kernel
from qfuse.kernels.prepared import prepare_once
from qfuse.ops.arguments import op_arguments
from qfuse.schemes import FP8_DTYPE, GROUP_SIZE

OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_dtypes(a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype, op: str) -> None:
    if a_dtype not in (torch.int8, FP8_DTYPE):
        raise ValueError(f"qfuse::{op}: quantized activation must be int8 or float8_e4m3fn, got {a_dtype}")
    if b_dtype != a_dtype:
        raise ValueError(f"qfuse::{op}: weight dtype {b_dtype} does not match activation dtype {a_dtype}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"qfuse::{op}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def _output_shape(a: torch.Tensor, b: torch.Tensor, op: str) -> tuple:
    if b.dim() != 2:
        raise ValueError(f"qfuse::{op}: weight must be a [K, N] matrix, got shape {tuple(b.shape)}")
    if a.shape[-1] != b.shape[0]:
        raise ValueError(
            f"qfuse::{op}: activation has K={a.shape[-1]} but the [K, N] weight has {b.shape[0]} rows"
        )
    return (*a.shape[:-1], b.shape[1])


def _normalize_scale_a(scale: torch.Tensor | None, rows: int, k: int, name: str) -> torch.Tensor | None:
    """One value -> [], per row -> [M, 1], per row and 128-group -> [M, ceil(K / 128)]."""
    if scale is None or scale.numel() == 1:
        return None if scale is None else scale.reshape(())
    groups = math.ceil(k / GROUP_SIZE)
    if scale.shape[-1] == 1 and scale.numel() == rows:
        return scale.reshape(rows, 1)
    if scale.shape[-1] == groups and scale.numel() == rows * groups:
        return scale.reshape(rows, groups)
    raise ValueError(
        f"{name} of shape {tuple(scale.shape)} is neither one value, one per row ({rows}), "
        f"nor one per row and 128-group of K ({rows} x {groups})"
    )


def _normalize_scale_b(scale: torch.Tensor | None, k: int, n: int) -> torch.Tensor | None:
    """One value -> [], per channel -> [1, N], per 128x128 block -> [ceil(K/128), ceil(N/128)]."""
    if scale is None or scale.numel() == 1:
        return None if scale is None else scale.reshape(())
    if scale.shape[-1] == n and scale.numel() == n:
        return scale.reshape(1, n)
    blocks = (math.ceil(k / GROUP_SIZE), math.ceil(n / GROUP_SIZE))
    if tuple(scale.shape) == blocks:
        return scale
    raise ValueError(
        f"scale_b of shape {tuple(scale.shape)} is neither one value, one per output channel ({n}), "
        f"nor one per 128x128 weight block {blocks}"
    )


def _normalize_zero_point(zero_point, count: int, name: str, op: str, shape: tuple):
    if zero_point is None:
        return None
    if zero_point.dtype.is_floating_point:
        raise ValueError(f"qfuse::{op}: {name} must be an integer zero point, got {zero_point.dtype}")
    if zero_point.numel() == 1:
        return zero_point.reshape(())
    if zero_point.numel() != count:
        raise ValueError(f"qfuse::{op}: {name} must have one value or {count}, got shape {tuple(zero_point.shape)}")
    return zero_point.reshape(shape)


def _flatten_operands(a, b, scale_a, scale_b, bias, azp_a, azp_b, op):
    """a as [M, K] and the scales and zero points in the normalised shapes that kernels receive."""
    k, n = b.shape
    if a.dtype == FP8_DTYPE and (azp_a is not None or azp_b is not None):
        raise ValueError(f"qfuse::{op}: fp8 is symmetric; zero points (azp_a, azp_b) apply to int8 only")
    a2d = a.reshape(-1, k)
    rows = a2d.shape[0]
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"qfuse::{op}: bias must have shape [{n}], got {tuple(bias.shape)}")
    return (
        a2d,
        _normalize_scale_a(scale_a, rows, k, "scale_a"),
        _normalize_scale_b(scale_b, k, n),
        _normalize_zero_point(azp_a, rows, "azp_a", op, (rows, 1)),
        _normalize_zero_point(azp_b, n, "azp_b", op, (1, n)),
    )


def prepared_kernel(kernel: str, b: torch.Tensor, scale_b, azp_b) -> tuple:
    """(the kernel named `kernel`, its prepared form of the weight b, made once per weight)."""
    implementation = get_kernel(kernel)
    return implementation, prepare_once(implementation, b, scale_b, azp_b)


def _checked_output_shape(a: torch.Tensor, gemm_dtype: torch.dtype, b: torch.Tensor, out_dtype: torch.dtype,
                          op: str) -> tuple:
    """The output shape, after checking the dtypes: `gemm_dtype` is the activation's dtype in the GEMM
    (a's own, or the one quant_scaled_mm quantizes it to)."""
    _check_dtypes(gemm_dtype, b.dtype, out_dtype, op)
    return _output_shape(a, b, op)


@torch.library.custom_op("qfuse::scaled_mm", mutates_args=())
def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor | None, scale_b: Tensor | None, bias: Tensor | None,
              azp_a: Tensor | None, azp_b: Tensor | None, out_dtype: torch.dtype, kernel: str) -> Tensor:
    out_shape = _checked_output_shape(a, a.dtype, b, out_dtype, "scaled_mm")
    a2d, scale_a, scale_b, azp_a, azp_b = _flatten_operands(a, b, scale_a, scale_b, bias, azp_a, azp_b, "scaled_mm")
    implementation, weight = prepared_kernel(kernel, b, scale_b, azp_b)
    # contiguous, as the fake says: a kernel that pads N returns its columns of a wider buffer (cutlass)
    return implementation.apply(a2d, weight, scale_a, bias, azp_a, out_dtype).reshape(out_shape).contiguous()


@scaled_mm.register_fake
def _(a, b, scale_a, scale_b, bias, azp_a, azp_b, out_dtype, kernel):
    return a.new_empty(_checked_output_shape(a, a.dtype, b, out_dtype, "scaled_mm"), dtype=out_dtype)


class ScaledMmArgs(op_arguments(torch.ops.qfuse.scaled_mm.default)):
    """`qfuse::scaled_mm`'s arguments by name; its fields are the parameters of `scaled_mm` above."""


def _quant_scaled_mm_output_shape(x: torch.Tensor, b: torch.Tensor, quant_dtype: torch.dtype,
                                  out_dtype: torch.dtype) -> tuple:
    if not x.dtype.is_floating_point:
        raise ValueError(f"qfuse::quant_scaled_mm: activation must be floating point, got {x.dtype}")
    return _checked_output_shape(x, quant_dtype, b, out_dtype, "quant_scaled_mm")


@torch.library.custom_op("qfuse::quant_scaled_mm", mutates_args=())
def quant_scaled_mm(x: Tensor, b: Tensor, scale_a: Tensor | None, scale_b: Tensor | None, bias: Tensor | None,
                    quant_dtype: torch.dtype, eps: float, out_dtype: torch.dtype, kernel: str) -> Tensor:
    out_shape = _quant_scaled_mm_output_shape(x, b, quant_dtype, out_dtype)
    x2d, scale_a, scale_b, _, _ = _flatten_operands(x, b, scale_a, scale_b, bias, None, None, "quant_scaled_mm")
    implementation, weight = prepared_kernel(kernel, b, scale_b, None)
    return implementation.quant_apply(x2d, weight, scale_a, bias, quant_dtype, eps, out_dtype).reshape(out_shape)


@quant_scaled_mm.register_fake
def _(x, b, scale_a, scale_b, bias, quant_dtype, eps, out_dtype, kernel):
    return x.new_empty(_quant_scaled_mm_output_shape(x, b, quant_dtype, out_dtype), dtype=out_dtype)


class QuantScaledMmArgs(op_arguments(torch.ops.qfuse.quant_scaled_mm.default)):
    """`qfuse::quant_scaled_mm`'s arguments by name; its fields are the parameters of `quant_scaled_mm` above."""
