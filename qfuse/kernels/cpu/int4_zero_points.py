"""int4 weight-only GEMM on the CPU, exact, zero points or none (`int4_zero_points.cpp`).

    w[k, n] = (v[k, n] - z[k // g, n]) * s[k // g, n]     qfuse's int4 convention, rounded once to x's dtype

ATen's `_weight_int4pack_mm_for_cpu` holds a zero point as a float in the activation's dtype, which bf16 and
fp16 round (`qfuse.kernels.int4_cpu`); without a kernel, Inductor dequantized such a weight on every call. This
one keeps the values as nibbles ([K / 2, N] uint8, u = v + 8, two rows of K a byte), the scales and the zero
points (u's: z + 8) as float32, and rounds each (u - z) * s to bf16 / fp16 as eager does before the product,
which it sums in float32: within one rounding of eager's output. With float32 activations (any int4 weight, zero
points or none: ATen's float32 kernel is slower, `qfuse.kernels.int4_cpu`) the float32 product (u - z) * s is
eager's weight itself. Its `pack` is once per weight; each call converts x to float32 and runs the compiled kernel
through ctypes (a few µs of Python; the GEMM takes milliseconds on a CPU).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
from pathlib import Path

import torch

from qfuse.kernels.prepared import Packing, PreparedWeight
from qfuse.schemes import INT4_OFFSET

SOURCE = Path(__file__).with_name("int4_zero_points.cpp")
_ENTRY = {torch.bfloat16: "qfuse_int4_zero_points_mm_bf16", torch.float16: "qfuse_int4_zero_points_mm_fp16",
          torch.float32: "qfuse_int4_zero_points_mm_fp32"}
#: the packing of a weight prepared for activations of each dtype (its values rounded to it)
PACKINGS = {torch.bfloat16: Packing.INT4_ZERO_POINTS_BF16, torch.float16: Packing.INT4_ZERO_POINTS_FP16,
            torch.float32: Packing.INT4_ZERO_POINTS_FP32}
_DTYPE_OF_PACKING = {packing: dtype for dtype, packing in PACKINGS.items()}


def why_not(values: torch.Tensor, group_size: int) -> str:
    """Why the kernel's layout cannot hold this int8 [K, N] weight, or ''."""
    k = values.shape[0]
    if k % 2 or group_size % 2:
        return f"K = {k} and groups of {group_size}: the kernel keeps two rows of K a byte (both even)"
    if values.numel() and (values.min() < -8 or values.max() > 7):
        return "values outside int4's range [-8, 7]"
    return ""


@functools.cache
def why_not_built(dtype: torch.dtype) -> str:
    """Why the kernel for `dtype` activations does not run on this machine (its C++ did not build), or ''. Built
    once a process, at the first kernel choice or weight preparation that asks (kernel choice asks for float32 on a
    CPU, whatever platform it is told: the kernel is this machine's): a machine without a working compiler gets
    the weight in another layout, not an error in the model's call."""
    try:
        _function(dtype)
    except Exception as error:  # noqa: BLE001 (a missing or failing compiler raises many types; the reason is kept)
        return f"its C++ did not build here ({type(error).__name__}: {error})"
    return ""


def pack(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> PreparedWeight:
    """int8 [K, N] values in [-8, 7], scale [K / g, N] (bf16 / fp16 / float32: the dtype the weight is rounded to),
    zero point [K / g, N] (integers; None: zero) in the kernel's layout: nibbles, float32 scales and zero points of
    u = v + 8."""
    unsigned = (values.to(torch.int32) + INT4_OFFSET).to(torch.uint8)
    nibbles = (unsigned[0::2] | (unsigned[1::2] << 4)).contiguous()  # [K / 2, N]
    zero = torch.zeros_like(scale, dtype=torch.float32) if zero_point is None else zero_point.to(torch.float32)
    zero = (zero + INT4_OFFSET).contiguous()
    return PreparedWeight(nibbles, scale.to(torch.float32).contiguous(), zero, *values.shape,
                          packing=PACKINGS[scale.dtype])


def int4_zero_points_mm(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] @ w + bias as `out_dtype`: the float32 sums rounded to x's dtype (as a float linear's output),
    the bias added in that dtype (as eager's addmm / add)."""
    dtype = _DTYPE_OF_PACKING[weight.packing]
    if x.dtype != dtype:
        raise ValueError(f"this int4 weight was prepared for {dtype} activations (its values are rounded to it), "
                         f"and x is {x.dtype}")
    m, k = x.shape
    xf = x.to(torch.float32).contiguous()
    sums = torch.empty(m, weight.n, dtype=torch.float32)
    if m:
        _function(dtype)(weight.data.data_ptr(), weight.scale.data_ptr(), weight.zero_point.data_ptr(), xf.data_ptr(),
                         sums.data_ptr(), m, weight.n, k, k // weight.scale.shape[0])
    out = sums.to(dtype)
    if bias is not None:
        out = out + bias.to(dtype)
    return out.to(out_dtype)


@functools.cache
def _function(dtype: torch.dtype):
    from torch._inductor import cpp_builder
    from torch._inductor.codecache import CppCodeCache

    # Inductor turns GCC's loop vectorizer off (its own code is vectorized by hand); this kernel's loops over a
    # block of columns are written for it: 8x faster on an AVX2 machine with it on
    options = {"extra_flags": ("-ftree-loop-vectorize",) if cpp_builder.is_gcc() else ()}
    # the ISA's flags (-mavx2 -mf16c ...): torch >= 2.12 adds them where asked, earlier versions always
    if "needs_vec_isa" in inspect.signature(CppCodeCache.load_async).parameters:
        options["needs_vec_isa"] = True
    library = CppCodeCache.load(SOURCE.read_text(), **options)
    function = getattr(library, _ENTRY[dtype])
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
    return function
