"""Triton quantizers: one pass over the activation, fp8 and int8.

    dynamic, symmetric    per row r (or per 128-group g of row r):
                          scale = max(amax(|x[r, g]|), eps) / qmax, rounded to x's dtype first,
                          q = quantize(x / scale)    (int8: round, clamp; fp8: clamp, cast)
    static                q = quantize(x / scale (+ zero point)) with a given per-tensor scale
    silu * mul            dynamic per token of x = silu(gate) * up, rounded to up's dtype (a Llama MLP's
                          down-projection input),
                          read from gate and up in one pass: x is never written

One program per (row, group) holds its whole slice in registers, so x is read once and q and the
scale are written once: the HBM traffic is the minimum (2 bytes read + 1 written per bf16 element).
The scale is rounded to x's dtype before it divides, so the scale returned is exactly the one used.
Divisions round as eager's do on a GPU: x / scale is IEEE division (`_divide_by_scale`; Triton's `/`
is an approximate division on NVIDIA GPUs, which moved some int8 values one step off eager's;
measured: docs/benchmarks.md, "Small M and the activation quant"), and amax / qmax, a division by a
Python number, is a multiplication by its float32 reciprocal, as eager computes it on CUDA and
Inductor on every device (on a CPU eager divides: one float32 step apart, at times). A nan in a row
makes its scale and its values nan, as eager's amax and clamp do.

The per-token kernel runs at the HBM floor, faster than Inductor's generated reduction (measured:
docs/benchmarks.md, "Measurements first quoted in code comments"): one reduction (a maximum that
keeps nan), `rint` for the rounding and three instructions a value for the division. Under the
interpreter (INTERPRETED) portable spellings replace the first two.

The SiLU * mul keeps eager's roundings (silu(gate) to up's dtype, then the product), as the
post-grad graph writes them; its exp and division are the GPU's fast ones, as in Inductor's code
(eager's expf and IEEE division differ in the last float32 bit at times, which moves q only where the
product lies that close to a bf16 rounding boundary).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton import next_power_of_2
from triton.language.extra import libdevice

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
    (INTERPRETED), where its extra arithmetic costs nothing that matters."""
    magnitude = tl.maximum(tl.abs(value), 1e-30)
    exponent = tl.maximum(tl.floor(tl.log2(magnitude)), -6.0)  # e4m3: normals from 2**-6
    step = tl.exp2(exponent - 3.0)  # 3 mantissa bits
    return _round_half_even(value / step) * step


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _divide_by_scale(x, scale):
    """x / scale rounded as IEEE division (eager's), for one scale a program.

    Where the scale and its reciprocal are ordinary numbers this is Markstein's correction: with
    y = 1 / scale correctly rounded and q0 = x * y, the residual r = x - q0 * scale is exact in one
    fma, and q0 + r * y rounds to the correctly rounded quotient; three instructions a value where
    `div_rn` takes about ten. A zero, infinite or nan scale divides."""
    if (scale > 1e-30) & (scale < 1e30):
        reciprocal = tl.math.div_rn(1.0, scale)
        quotient = x * reciprocal
        residual = tl.math.fma(-quotient, scale, x)
        # a zero quotient keeps x's sign (the fma's 0 + -0 is +0; fp8 stores -0 apart), an infinite one
        # stays infinite (an infinite x, or an overflow: the residual would be inf - inf)
        exact = (quotient == 0.0) | (tl.abs(quotient) == float("inf"))
        result = tl.where(exact, quotient, tl.math.fma(residual, reciprocal, quotient))
    else:
        result = tl.math.div_rn(x, scale)
    return result


@triton.jit
def _quantize_and_store(x, q_ptrs, scale_ptr, mask, EPS: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr,
                        INTERPRETED: tl.constexpr):
    """Quantize one row (or group) `x` (float32, masked lanes 0) with its own scale; store q and the scale.
    EPS is a constant, a float32 like x (a float argument that Inductor passes is a float64, which would
    round amax / qmax in float64 where eager rounds in float32)."""
    if INTERPRETED:  # its reductions and maxima pass over nan
        amax = tl.maximum(tl.max(tl.abs(x)), EPS) + tl.sum(tl.where(x != x, x, 0.0))
    else:  # eager's amax is nan for a row holding one (and so is its output row)
        amax = tl.maximum(tl.reduce(tl.abs(x), 0, _max_keeping_nan), EPS, propagate_nan=tl.PropagateNan.ALL)
    scale = (amax * (1.0 / QMAX)).to(scale_ptr.dtype.element_ty)  # eager's `amax / qmax` on CUDA (above)
    scaled = _divide_by_scale(x, scale.to(tl.float32))
    if IS_INT8:
        if INTERPRETED:
            rounded = _round_half_even(scaled)
        else:
            rounded = libdevice.rint(scaled)  # half to even, as torch.round
        q = tl.clamp(rounded, -128.0, 127.0, propagate_nan=tl.PropagateNan.ALL)
    else:
        q = tl.clamp(scaled, -QMAX, QMAX, propagate_nan=tl.PropagateNan.ALL)
        if INTERPRETED:
            q = _round_to_e4m3(q)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def _dynamic_quant_kernel(
    x_ptr, q_ptr, scale_ptr, width, groups, stride_x, stride_q,
    EPS: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, BLOCK)
    mask = (offs < width) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    _quantize_and_store(x, q_ptr + row * stride_q + offs, scale_ptr + row * groups + group, mask,
                        EPS, QMAX, IS_INT8, INTERPRETED)


@triton.jit
def _rounded_to(value, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 `value` as `dtype`, rounded to nearest even. Triton's interpreter (3.x) truncates float32
    to bfloat16, so there the rounding is done on the bits first (the truncation is then exact)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        value = bits.to(tl.float32, bitcast=True)
    return value.to(dtype)


@triton.jit
def _silu_mul_quant_kernel(
    gate_ptr, up_ptr, q_ptr, scale_ptr, width, stride_gate, stride_up, stride_q,
    EPS: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Per token: x = silu(gate) * up, each rounded to up's dtype as eager rounds them; then quantize.
    gate is of up's dtype or float32 (a linear's output whose rounding Inductor dropped)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    gate = tl.load(gate_ptr + row * stride_gate + offs, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = _rounded_to(g / (1.0 + tl.exp(-g)), up.dtype, INTERPRETED)
    x = _rounded_to(silu.to(tl.float32) * up.to(tl.float32), up.dtype, INTERPRETED).to(tl.float32)
    _quantize_and_store(x, q_ptr + row * stride_q + offs, scale_ptr + row, mask, EPS, QMAX, IS_INT8, INTERPRETED)


def silu_mul_quant_warps(block: int) -> int:
    """Warps a program for a row of `block` values of the SiLU * mul quant: two inputs held in registers.
    16 warps reach the HBM floor at Llama's 14336 where 8 do not (measured: docs/benchmarks.md, "Measurements
    first quoted in code comments"); other widths are scaled to that, unmeasured."""
    return max(4, min(16, block // 1024))


def dynamic_quant_warps(block: int) -> int:
    """Warps a program for a row (or group) of `block` values: 4 to 8 reach the HBM floor, more leave fewer,
    larger programs that fill the machine worse (measured: docs/benchmarks.md, "Measurements first quoted in
    code comments")."""
    return 4 if block > 8192 else max(1, min(8, block // 512))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def quant_constants(quant_dtype: torch.dtype, eps: float, interpreted: bool | None = None) -> dict:
    """The constexprs `_quantize_and_store` takes, as the eager launchers and the lowerings
    (`qfuse.lowerings.triton.quantize`) both pass them (`interpreted`: Triton's interpreter, by default as
    TRITON_INTERPRET says)."""
    return {"EPS": float(eps), "QMAX": symmetric_quant_max(quant_dtype), "IS_INT8": quant_dtype == torch.int8,
            "INTERPRETED": _interpreted() if interpreted is None else interpreted}


def triton_silu_mul_quant(gate: torch.Tensor, up: torch.Tensor, quant_dtype: torch.dtype, eps: float,
                          scale_dtype: torch.dtype | None = None):
    """(q, scale [..., 1]) of silu(gate) * up, quantized per token (`_silu_mul_quant_kernel`)."""
    width = gate.shape[-1]
    gate2d, up2d = (t.reshape(-1, width) for t in (gate, up))
    gate2d, up2d = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate2d, up2d))
    rows = gate2d.shape[0]
    q = torch.empty((rows, width), device=gate.device, dtype=quant_dtype)
    scale = torch.empty((rows, 1), device=gate.device, dtype=scale_dtype or up.dtype)
    if rows:
        block = next_power_of_2(width)
        _silu_mul_quant_kernel[(rows,)](
            gate2d, up2d, q, scale, width, gate2d.stride(0), up2d.stride(0), q.stride(0), BLOCK=block,
            num_warps=silu_mul_quant_warps(block), **quant_constants(quant_dtype, eps),
        )
    return q.reshape(gate.shape), scale.reshape(*gate.shape[:-1], 1)


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
        block = next_power_of_2(group)
        _dynamic_quant_kernel[(rows, groups)](
            x2d, q, scale, width, groups, x2d.stride(0), q.stride(0), GROUP=group, BLOCK=block,
            num_warps=num_warps or dynamic_quant_warps(block), **quant_constants(quant_dtype, eps),
        )
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], groups)


@triton.jit
def _static_quant_kernel(x_ptr, q_ptr, scale_ptr, numel, QMIN: tl.constexpr, QMAX: tl.constexpr,
                         IS_FP8: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scaled = _divide_by_scale(x, tl.load(scale_ptr).to(tl.float32))
    if IS_FP8:
        q = tl.clamp(scaled, QMIN, QMAX, propagate_nan=tl.PropagateNan.ALL)
        if INTERPRETED:
            q = _round_to_e4m3(q)
        q = q.to(q_ptr.dtype.element_ty)
    else:
        if INTERPRETED:
            rounded = _round_half_even(scaled)
        else:
            rounded = libdevice.rint(scaled)
        q = tl.clamp(rounded, QMIN, QMAX, propagate_nan=tl.PropagateNan.ALL).to(q_ptr.dtype.element_ty)
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
            INTERPRETED=_interpreted(),
        )
    return q.reshape(x.shape)
