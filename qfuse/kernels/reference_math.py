"""Plain torch math for every qfuse op: the ground truth, and the default quantizer.

Quantize (dtype of x is kept for the scale, like a model written in plain torch computes it):

    symmetric   scale = max(amax(|x|), eps) / qmax          q = clamp(round(x / scale), qmin, qmax)
    asymmetric  scale = max(max(x, 0) - min(x, 0), eps) / (qmax - qmin)
                zero_point = qmin - round(min(x, 0) / scale)
                q = clamp(round(x / scale) + zero_point, qmin, qmax)
    fp8         like symmetric, without the round (the cast rounds)

Scaled mm, in float64 (int8 sums and fp8 products are exact there), for every scale granularity:

    out = ((a - azp_a) * scale_a) @ ((b - azp_b) * scale_b) + bias, cast to out_dtype

Weight-only (W8A16), the same with a float activation x that carries no scale or zero point:

    out = x @ (b * scale_b) + bias, cast to out_dtype

These functions are also every kernel's default quantizer (`Kernel.dynamic_quant` and friends).
"""

from __future__ import annotations

import torch

from qfuse.schemes import FP8_DTYPE, GROUP_SIZE, Granularity, quant_range, symmetric_quant_max


def _reduce_abs_max(x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """amax(|x|) per tensor ([]), per token ([..., 1]) or per group of 128 ([..., K / 128])."""
    if granularity == Granularity.PER_TENSOR:
        return x.abs().amax()
    if granularity == Granularity.PER_TOKEN:
        return x.abs().amax(dim=-1, keepdim=True)
    return x.unflatten(-1, (-1, GROUP_SIZE)).abs().amax(dim=-1)


def _broadcast_scale(scale: torch.Tensor, x: torch.Tensor, granularity: Granularity) -> torch.Tensor:
    """Expand a per-group scale [..., K / 128] to x's shape; other scales already broadcast."""
    if granularity == Granularity.PER_GROUP:
        return scale.repeat_interleave(GROUP_SIZE, dim=-1)
    return scale


def _round_and_cast(scaled: torch.Tensor, zero_point: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    qmin, qmax = quant_range(dtype)
    if dtype == FP8_DTYPE:
        return scaled.clamp(qmin, qmax).to(dtype)
    rounded = torch.round(scaled)
    if zero_point is not None:
        rounded = rounded + zero_point
    return rounded.clamp(qmin, qmax).to(dtype)


def dynamic_quant(x: torch.Tensor, quant_dtype: torch.dtype, granularity: Granularity, eps: float):
    """Symmetric dynamic quantization: returns (q, scale)."""
    amax = _reduce_abs_max(x, granularity)
    if eps > 0:
        amax = amax.clamp(min=eps)
    scale = amax / symmetric_quant_max(quant_dtype)
    q = _round_and_cast(x / _broadcast_scale(scale, x, granularity), None, quant_dtype)
    return q, scale


def dynamic_quant_asymmetric(x: torch.Tensor, quant_dtype: torch.dtype, granularity: Granularity, eps: float):
    """Asymmetric (zero point) dynamic int8/uint8 quantization: returns (q, scale, zero_point int32)."""
    qmin, qmax = quant_range(quant_dtype)
    if granularity == Granularity.PER_TENSOR:
        low, high = x.amin().clamp(max=0), x.amax().clamp(min=0)
    else:
        low, high = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((high - low).clamp(min=eps) if eps > 0 else high - low) / (qmax - qmin)
    zero_point = (qmin - torch.round(low / scale)).clamp(qmin, qmax).to(torch.int32)
    q = _round_and_cast(x / scale, zero_point, quant_dtype)
    return q, scale, zero_point


def static_quant(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, quant_dtype: torch.dtype):
    """Quantize with a given scale (and zero point)."""
    return _round_and_cast(x / scale, zero_point, quant_dtype)


def _expand_block_scale(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Expand a 2D scale to [rows, cols]: each dim is full size, 1 (broadcast), or one per 128."""
    for dim, size in enumerate((rows, cols)):
        if scale.shape[dim] not in (size, 1):
            scale = scale.repeat_interleave(GROUP_SIZE, dim=dim).narrow(dim, 0, size)
    return scale.expand(rows, cols)


def scaled_mm(a, b, scale_a, scale_b, bias, azp_a, azp_b, out_dtype):
    """(dequant(a) @ dequant(b) + bias) in float64, cast to out_dtype.

    Scales as normalised by the op: scale_a one value, [M, 1] or [M, ceil(K / 128)];
    scale_b one value, [1, N] or [ceil(K / 128), ceil(N / 128)].
    """
    (m, k), n = a.shape, b.shape[1]
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    if azp_a is not None:
        a64 = a64 - azp_a.to(torch.float64)
    if azp_b is not None:
        b64 = b64 - azp_b.to(torch.float64)
    if scale_a is not None:
        scale = scale_a.to(torch.float64)
        a64 = a64 * (scale if scale.numel() == 1 else _expand_block_scale(scale, m, k))
    if scale_b is not None:
        scale = scale_b.to(torch.float64)
        b64 = b64 * (scale if scale.numel() == 1 else _expand_block_scale(scale, k, n))
    out = a64 @ b64
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(out_dtype)


def weight_only_scaled_mm(x, b, scale_b, bias, azp_b, out_dtype):
    """Weight-only (W8A16): x @ ((b - azp_b) * scale_b) + bias in float64, cast to out_dtype; x is a
    float activation [M, K] that is not quantized (no scale, no zero point)."""
    return scaled_mm(x, b, None, scale_b, bias, None, azp_b, out_dtype)
