"""Triton quantizers: one pass over the activation, fp8 and int8.

    dynamic, symmetric    per row r (or per 128-group g of row r):
                          scale = max(amax(|x[r, g]|), eps) / qmax, rounded to x's dtype first,
                          q = quantize(x / scale)    (int8: round, clamp; fp8: clamp, cast)
    static                q = quantize(x / scale (+ zero point)) with a given per-tensor scale

One program per (row, group) holds its whole slice in registers, so x is read once and q and the
scale are written once: the HBM traffic is the minimum (2 bytes read + 1 written per bf16 element).
The scale is rounded to x's dtype before it divides, so the scale returned is exactly the one used.
Divisions round as eager's do on a GPU: x / scale is IEEE division (`tl.math.div_rn`; Triton's `/` is
an approximate division on NVIDIA GPUs, which moved 5 in 65536 int8 values by one on an H200), and
amax / qmax, a division by a Python number, is a multiplication by its float32 reciprocal, as eager
computes it on CUDA and Inductor on every device (on a CPU eager divides: one float32 step apart, at
times). A nan in a row makes its scale nan, as eager's amax does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qfuse.schemes import FP8_DTYPE, GROUP_SIZE, Granularity, quant_range, symmetric_quant_max


@triton.jit
def _round_half_even(value):
    """torch.round's rounding (half to even), portable across Triton backends and the interpreter."""
    floor = tl.floor(value)
    fraction = value - floor
    floor_is_odd = (floor - 2.0 * tl.floor(floor * 0.5)) != 0.0
    round_up = (fraction > 0.5) | ((fraction == 0.5) & floor_is_odd)
    return tl.where(round_up, floor + 1.0, floor)


@triton.jit
def _round_to_e4m3(value):
    """Round float32 to the nearest e4m3 value (ties to even), in float32, so the cast is exact.

    GPUs round correctly in the cast itself; Triton's interpreter (3.x) drops the carry when
    rounding reaches the next power of two (125.9 -> 64). So this runs only in the interpreter
    (ROUND_FP8_FIRST), where its extra arithmetic costs nothing that matters."""
    magnitude = tl.maximum(tl.abs(value), 1e-30)
    exponent = tl.maximum(tl.floor(tl.log2(magnitude)), -6.0)  # e4m3: normals from 2**-6
    step = tl.exp2(exponent - 3.0)  # 3 mantissa bits
    return _round_half_even(value / step) * step


@triton.jit
def _dynamic_quant_kernel(
    x_ptr, q_ptr, scale_ptr, width, groups, stride_x, stride_q, eps,
    QMAX: tl.constexpr, IS_INT8: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
    ROUND_FP8_FIRST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, BLOCK)
    mask = (offs < width) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    # tl.max passes over nan; eager's amax is nan for a row holding one (and so is its output row)
    nan_in_row = tl.sum(tl.where(x != x, x, 0.0))  # 0.0, or nan
    amax = tl.maximum(tl.max(tl.abs(x)), eps) + nan_in_row
    scale = (amax * (1.0 / QMAX)).to(scale_ptr.dtype.element_ty)  # eager's `amax / qmax` on CUDA (below)
    scaled = tl.math.div_rn(x, scale.to(tl.float32))
    if IS_INT8:
        q = tl.clamp(_round_half_even(scaled), -128.0, 127.0).to(q_ptr.dtype.element_ty)
    else:
        q = tl.clamp(scaled, -QMAX, QMAX)
        if ROUND_FP8_FIRST:
            q = _round_to_e4m3(q)
        q = q.to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
    tl.store(scale_ptr + row * groups + group, scale)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_dynamic_quant(x: torch.Tensor, quant_dtype: torch.dtype, granularity: Granularity, eps: float,
                         scale_dtype: torch.dtype | None = None, num_warps: int | None = None):
    """(q, scale) for x [..., K]: scale [..., 1] per token or [..., K / 128] per group, in x's dtype
    (or `scale_dtype`: the scale is rounded to it before it divides). `num_warps` overrides the
    launcher's (benchmarks/gpu_quant.py)."""
    width = x.shape[-1]
    x2d = x.reshape(-1, width)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    rows = x2d.shape[0]
    group = width if granularity == Granularity.PER_TOKEN else GROUP_SIZE
    groups = triton.cdiv(width, group)
    q = torch.empty((rows, width), device=x.device, dtype=quant_dtype)
    scale = torch.empty((rows, groups), device=x.device, dtype=scale_dtype or x.dtype)
    if rows:
        block = triton.next_power_of_2(group)
        _dynamic_quant_kernel[(rows, groups)](
            x2d, q, scale, width, groups, x2d.stride(0), q.stride(0), eps,
            QMAX=symmetric_quant_max(quant_dtype), IS_INT8=quant_dtype == torch.int8, GROUP=group, BLOCK=block,
            ROUND_FP8_FIRST=_interpreted(),
            num_warps=num_warps or min(16, max(1, block // 512)),
        )
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], groups)


@triton.jit
def _static_quant_kernel(x_ptr, q_ptr, scale_ptr, numel, QMIN: tl.constexpr, QMAX: tl.constexpr,
                         IS_FP8: tl.constexpr, BLOCK: tl.constexpr, ROUND_FP8_FIRST: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scaled = tl.math.div_rn(x, tl.load(scale_ptr).to(tl.float32))
    if IS_FP8:
        q = tl.clamp(scaled, QMIN, QMAX)
        if ROUND_FP8_FIRST:
            q = _round_to_e4m3(q)
        q = q.to(q_ptr.dtype.element_ty)
    else:
        q = tl.clamp(_round_half_even(scaled), QMIN, QMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + offs, q, mask=mask)


def triton_static_quant(x: torch.Tensor, scale: torch.Tensor, quant_dtype: torch.dtype) -> torch.Tensor:
    """q = quantize(x / scale) for a per-tensor scale (symmetric)."""
    flat = x.contiguous().reshape(-1)
    q = torch.empty_like(flat, dtype=quant_dtype)
    qmin, qmax = quant_range(quant_dtype)
    block = 1024
    if flat.numel():
        _static_quant_kernel[(triton.cdiv(flat.numel(), block),)](
            flat, q, scale.reshape(1), flat.numel(), QMIN=qmin, QMAX=qmax, IS_FP8=quant_dtype == FP8_DTYPE, BLOCK=block,
            ROUND_FP8_FIRST=_interpreted(),
        )
    return q.reshape(x.shape)
