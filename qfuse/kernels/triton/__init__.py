"""`triton`: qfuse's portable GPU kernels (scaled matmul, quantizers), fast on Hopper.

The kernels live beside this file and import Triton; this module does not, so the registry works
where Triton is missing: `scaled_mm.py` (every scale granularity, any M; tiles per M bucket),
`persistent_mm.py` (Hopper TMA, one program per multiprocessor: fp8 and int8 with per-tensor / row-wise
scales at large M),
`quant.py` (one-pass quantizers, for `qfuse::quant_scaled_mm` when asked for by name), and the
weight-only kernels on `weight_stream.py`'s main loop: `int4_mm.py` (W4A16) and `w8a16_mm.py` (int8 /
fp8 weights, bf16 / fp16 / fp32 activations). Under
torch.compile the scaled-mm's main loop enters Inductor's generated code as a Triton template
(`qfuse.lowerings.triton.template`), where Inductor fuses the epilogue into it; the eager launchers
here serve the op's extern call (K not a multiple of 16) and eager use. What it takes is the
capability table `TritonKernel.capabilities`: int8 from capability 8.0 (also on ROCm), fp8 e4m3fn
from 8.9 (not on ROCm, whose fp8 is e4m3fnuz), every scale granularity (per-tensor, per-token /
per-channel, 1x128 / 128x128 blocks), no zero points (asymmetric activations run on the torch
kernel), any M >= 1, N, K (masked; K padded to a multiple of 16 for aligned loads; int64 offsets).

Inside Inductor's code the template's fp8 main loop (pointer loads, no TMA) is slower than cuBLAS
on Hopper above a decode M; `why_slower_here` then leaves row-wise and per-tensor fp8 linears to the
`torch` kernel's cuBLAS `_scaled_mm` (block scales stay here), as the lowering does for a dynamic M
above 16 rows. int4 at M = 1 under CUDA graphs goes to the `torch` kernel's ATen tinygemm.
"""

from __future__ import annotations

import torch

from qfuse.kernels import int4_tinygemm
from qfuse.kernels.base import DECODE_ROWS, OK, GemmKey, Kernel, Verdict
from qfuse.kernels.capabilities import Capability
from qfuse.kernels.int4_words import pack_int4
from qfuse.kernels.prepared import Packing, PreparedWeight, padded_activation, padded_weight
from qfuse.platform import Platform
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, FP8_DTYPE, INT4_DTYPE, INT4_OFFSET, Granularity


#: K is padded to this multiple (weights once, activations per call): rows that are not 16-byte aligned
#: lose vectorised loads, and an unaligned K made the kernel many times slower
#: (measured: docs/benchmarks.md, "gpu_kernels: the registry's GEMM kernels on an H200").
K_ALIGNMENT = 16
#: Above this M cuBLAS beats the fp8 template on Hopper (kernel choice for a static M, the lowering for
#: a dynamic one's bucket); at M <= 16 the decode template is as fast or faster
#: (measured: docs/benchmarks.md, "Small M and the activation quant").
FP8_TEMPLATE_MAX_ROWS = DECODE_ROWS


def fp8_template_yields_to_cublas(blocked: bool, platform: Platform) -> str:
    """Why an fp8 linear above FP8_TEMPLATE_MAX_ROWS rows runs faster on cuBLAS's `_scaled_mm` than on
    the template on this GPU, or '' (block scales: cuBLAS has none here; not Hopper: not measured).
    Kernel choice asks it for a static M, the lowering (`qfuse.lowerings.dispatch`) for each bucket of a dynamic one."""
    if blocked or platform.capability < 90 or platform.is_rocm:
        return ""
    return ("on Hopper the template's fp8 main loop (no TMA) is slower than cuBLAS's _scaled_mm, which the "
            "torch kernel calls (measured on an H100 and an H200: docs/benchmarks.md, \"gpu_linear: qfuse inside "
            "Inductor's generated code, as a user sees it\" and \"Small M and the activation quant\")")


def _fp8_yields_to_cublas(key: GemmKey, platform: Platform) -> str:
    """`fp8_template_yields_to_cublas` for an fp8 W8A8 key ('' for any other)."""
    scheme = key.scheme
    if scheme.activation_dtype != FP8_DTYPE:
        return ""
    blocked = Granularity.BLOCK == scheme.weight_granularity or Granularity.PER_GROUP == scheme.activation_granularity
    return fp8_template_yields_to_cublas(blocked, platform)


_ALL_ACTIVATION_SCALES = (Granularity.PER_TENSOR, Granularity.PER_TOKEN, Granularity.PER_GROUP)
_ALL_WEIGHT_SCALES = (Granularity.PER_TENSOR, Granularity.PER_CHANNEL, Granularity.BLOCK)


class TritonKernel(Kernel):
    name = "triton"
    # The activation quant stays in Inductor's code, where it fuses with the op that produced the
    # activation (RMSNorm, SiLU * mul); the GEMM enters that code as a template (qfuse.lowerings).
    fuses_activation_quant = False
    #: values of a row (or group) its one-pass quantizers hold in registers (`quant.py`); wider rows are
    #: left to Inductor's reduction
    quant_max_row = 32768
    prepares_weight = True
    reads_weight_scale_per_call = True  # `prepare_weight` pads the weight and keeps the scale as it is
    capabilities = (
        Capability("int8 W8A8 dot", ("cuda",), (torch.int8,), (torch.int8,), _ALL_ACTIVATION_SCALES,
                   _ALL_WEIGHT_SCALES, min_capability=80),
        Capability("fp8 e4m3fn W8A8 dot", ("cuda",), (FP8_DTYPE,), (FP8_DTYPE,), _ALL_ACTIVATION_SCALES,
                   _ALL_WEIGHT_SCALES, min_capability=89, rocm=False, sums_below_float32=True),
        Capability("int4 weight-only dot, dequantized in registers (W4A16)", ("cuda",), FLOAT_ACTIVATION_DTYPES,
                   (INT4_DTYPE,), weight_scales=(Granularity.PER_GROUP,), weight_zero_point=True,
                   weight_group_multiple=16, min_capability=80),
        Capability("int8 weight-only dot, converted in registers (W8A16)", ("cuda",), FLOAT_ACTIVATION_DTYPES,
                   (torch.int8,), weight_scales=_ALL_WEIGHT_SCALES, min_capability=80),
        Capability("fp8 e4m3fn weight-only dot, converted in registers (W8A16: Marlin's fp8 row)", ("cuda",),
                   FLOAT_ACTIVATION_DTYPES, (FP8_DTYPE,), weight_scales=_ALL_WEIGHT_SCALES, min_capability=89,
                   rocm=False),
    )

    def is_supported(self, platform: Platform) -> Verdict:
        if platform.device_type != "cuda":
            return False, f"triton kernels run on CUDA / ROCm GPUs, not on {platform.describe()}"
        if not platform.has("triton"):
            return False, "Triton is not installed (pip install triton)"
        return OK

    def why_slower_here(self, key: GemmKey, platform: Platform) -> str:
        scheme = key.scheme
        if scheme.weight_dtype == INT4_DTYPE and int4_tinygemm.wins_here(key, platform):
            return ("at M = 1 under CUDA graphs ATen's tinygemm, which the torch kernel calls, is faster than the "
                    "plane template (measured on an H100: docs/benchmarks.md, \"Batched decode: the plane template "
                    "up to 256 rows\")")
        if key.m is not None and key.m > FP8_TEMPLATE_MAX_ROWS and (reason := _fp8_yields_to_cublas(key, platform)):
            return f"at M = {key.m} {reason}"
        return super().why_slower_here(key, platform)

    def speed_row_bounds(self, key: GemmKey, platform: Platform) -> tuple[int, ...]:
        if key.scheme.weight_dtype == INT4_DTYPE:
            return int4_tinygemm.row_bounds(key, platform)
        return (FP8_TEMPLATE_MAX_ROWS,) if _fp8_yields_to_cublas(key, platform) else ()

    def prepare_weight(self, b, scale_b, azp_b) -> PreparedWeight:
        """K padded to a multiple of 16 (zeros), so rows are 16-byte aligned for vector loads.

        Block scales keep their shape: padding K to 16 never adds a 128-group."""
        return PreparedWeight(padded_weight(b, K_ALIGNMENT), scale_b, azp_b, *b.shape)

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        if azp_a is not None or weight.zero_point is not None:
            raise ValueError("the triton kernel has no zero points; use kernel='torch' for asymmetric int8")
        from qfuse.kernels.triton.persistent_mm import persistent_scaled_mm, should_run_persistent
        from qfuse.kernels.triton.scaled_mm import triton_scaled_mm

        a = padded_activation(a, weight.data.shape[0])
        launch = persistent_scaled_mm if should_run_persistent(a, weight.data, scale_a, weight.scale) else triton_scaled_mm
        return launch(a, weight.data, scale_a, weight.scale, bias, out_dtype)

    def prepare_int4_weight(self, values, scale, zero_point) -> PreparedWeight:
        """The layout the template reads from a model (`int4_mm`): words [N, K / 8], scales [N, K / g],
        zero points packed along N, [N / 8, K / g]."""
        if zero_point is None:
            return PreparedWeight(pack_int4(values.t()), scale.t(), None, *values.shape, packing=Packing.INT4_WORDS_NK)
        plus_one = bool(zero_point.max() > INT4_OFFSET - 1)  # a zero point of 16 ("plus_one"): stored minus one
        zeros = pack_int4(zero_point - int(plus_one)).t()
        return PreparedWeight(pack_int4(values.t()), scale.t(), zeros, *values.shape,
                              packing=Packing.INT4_WORDS_NK_ZEROS_MINUS_ONE if plus_one else Packing.INT4_WORDS_NK)

    def weight_only_apply(self, x, weight, bias, out_dtype):
        if weight.packing not in (Packing.INT4_WORDS_NK, Packing.INT4_WORDS_NK_ZEROS_MINUS_ONE):
            if weight.zero_point is not None:
                raise ValueError("the triton kernel's W8A16 takes symmetric weights; use kernel='torch' for a weight "
                                 "zero point")
            from qfuse.kernels.triton.w8a16_mm import triton_w8a16_mm

            return triton_w8a16_mm(x, weight.data, weight.scale, bias, out_dtype)
        from qfuse.kernels.triton.int4_mm import triton_int4_mm

        group_size = weight.k // weight.scale.shape[1]
        return triton_int4_mm(x, weight.data, None, weight.scale, weight.zero_point, bias, group_size, out_dtype,
                              zero_convention="plus_one" if weight.packing == Packing.INT4_WORDS_NK_ZEROS_MINUS_ONE else "stored")

    def dynamic_quant(self, x, quant_dtype: torch.dtype, granularity: Granularity, eps: float):
        if granularity == Granularity.PER_TENSOR:
            return super().dynamic_quant(x, quant_dtype, granularity, eps)
        from qfuse.kernels.triton.quant import triton_dynamic_quant

        return triton_dynamic_quant(x, quant_dtype, granularity, eps)

    def silu_mul_quant(self, gate, up, quant_dtype: torch.dtype, eps: float, scale_dtype: torch.dtype):
        from qfuse.kernels.triton.quant import triton_silu_mul_quant

        return triton_silu_mul_quant(gate, up, quant_dtype, eps, scale_dtype)

    def static_quant(self, x, scale, zero_point, quant_dtype: torch.dtype):
        if zero_point is not None or scale.numel() != 1:
            return super().static_quant(x, scale, zero_point, quant_dtype)
        from qfuse.kernels.triton.quant import triton_static_quant

        return triton_static_quant(x, scale, quant_dtype)
