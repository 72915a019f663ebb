"""`triton`: qfuse's portable GPU kernels (scaled matmul, quantizers), fast on Hopper.

The kernels live beside this file and import Triton; this module does not, so the registry works
where Triton is missing: `scaled_mm.py` (every scale granularity, any M; tiles per M bucket),
`persistent_mm.py` (Hopper TMA, one program per multiprocessor: fp8 with row-wise scales at large M)
and `quant.py` (one-pass quantizers, for `qfuse::quant_scaled_mm` when asked for by name). Under
torch.compile the scaled-mm's main loop enters Inductor's generated code as a Triton template
(`qfuse.lowerings.triton_template`), where Inductor fuses the epilogue into it; the eager launchers
here serve the op's extern call (K not a multiple of 16) and eager use. Limits (`can_implement`):

    device       CUDA GPUs (ROCm: int8 only, its fp8 is e4m3fnuz), with Triton installed
    int8         capability >= 8.0 (int8 tensor-core dot)
    fp8 e4m3     capability >= 8.9
    scales       every granularity: per-tensor, per-token / per-channel, 1x128 / 128x128 blocks
    zero points  none (asymmetric activations run on the torch kernel)
    sizes        any M >= 1, N, K (masked; K padded to a multiple of 16 for aligned loads); int64 offsets
"""

from __future__ import annotations

import torch

from qfuse.kernels.base import OK, GemmKey, Kernel, Verdict
from qfuse.kernels.prepared import PreparedWeight, padded_activation, padded_weight
from qfuse.platform import Platform
from qfuse.schemes import INT4_DTYPE, Granularity


#: K is padded to this multiple (weights once, activations per call): with K = 4100 the unaligned
#: rows cost 40-60x on an H200 (benchmarks/gpu_kernels.py, docs/benchmarks.md).
K_ALIGNMENT = 16


class TritonKernel(Kernel):
    name = "triton"
    # The activation quant stays in Inductor's code, where it fuses with the op that produced the
    # activation (RMSNorm, SiLU * mul); the GEMM enters that code as a template (qfuse.lowerings).
    fuses_activation_quant = False
    prepares_weight = True

    def is_supported(self, platform: Platform) -> Verdict:
        if platform.device_type != "cuda":
            return False, f"triton kernels run on CUDA / ROCm GPUs, not on {platform.describe()}"
        if not platform.has("triton"):
            return False, "Triton is not installed (pip install triton)"
        return OK

    def can_implement(self, key: GemmKey, platform: Platform) -> Verdict:
        scheme = key.scheme
        if scheme.is_weight_only:
            return False, "weight-only schemes (float activation) are not implemented in the Triton kernel"
        if scheme.weight_dtype == INT4_DTYPE:
            return False, "int4 weights (W4A8) are not implemented in the Triton kernel"
        if not scheme.symmetric:
            return False, "zero points (asymmetric activations) are not implemented in the Triton kernel"
        if scheme.is_fp8 and platform.is_rocm:
            return False, "ROCm fp8 is e4m3fnuz; the Triton kernel takes e4m3fn"
        needed = 89 if scheme.is_fp8 else 80
        if not platform.is_rocm and platform.capability < needed:
            return False, f"needs capability >= {needed} for {'fp8' if scheme.is_fp8 else 'int8'} dot (this GPU: {platform.capability})"
        return OK

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

    def dynamic_quant(self, x, quant_dtype: torch.dtype, granularity: Granularity, eps: float):
        if granularity == Granularity.PER_TENSOR:
            return super().dynamic_quant(x, quant_dtype, granularity, eps)
        from qfuse.kernels.triton.quant import triton_dynamic_quant

        return triton_dynamic_quant(x, quant_dtype, granularity, eps)

    def static_quant(self, x, scale, zero_point, quant_dtype: torch.dtype):
        if zero_point is not None or scale.numel() != 1:
            return super().static_quant(x, scale, zero_point, quant_dtype)
        from qfuse.kernels.triton.quant import triton_static_quant

        return triton_static_quant(x, scale, quant_dtype)
