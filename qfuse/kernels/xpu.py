"""`xpu`: W4A8 on Intel GPUs, through oneDNN's int4 x int8 matmul (`_xpu_C::int4_gemm_w4a8`).

    a, scale_a = the activation quantized to symmetric int8 by the model's graph, per token or one scale
    out[m, n]  = scale_a[m] * sum_k a[m, k] * w[k, n] * scale_w[k // g, n] + bias[n]
    w: int4 values in [-8, 7], stored packed (below); the op writes float16, cast to the out dtype

What it accepts: the machine in `is_supported` (an XPU with vllm-xpu-kernels importable: it registers
torch.ops._xpu_C), the rest in the capability table `XpuKernel.capabilities` (docs/kernels.md prints
it): int4 symmetric weights per channel or in groups of a multiple of 32, int8 activations quantized
dynamically per token (or with one scale) by the graph, static K and N multiples of 8, fp16 / bf16
in and out (oneDNN writes fp16, so a bf16 model gets a one-time warning on its first call and a cast
back to bf16).

Packing (`qfuse.kernels.int4_words.pack_int4`, the layout of vLLM's XPUW4A8IntLinearKernel): the [N, K] int4 values, plus 8
(so each is a nibble in [0, 15]), eight consecutive K values per int32, the first in the lowest
four bits: packed[n, j] = sum_i (w[n, 8 j + i] + 8) << 4 i, an int32 [N, K / 8] tensor. The op gets
it as `packed.t()` ([K / 8, N], the "NT" view oneDNN reads), the scale as a contiguous [K / g, N]
matrix, and the weight zero point as the one-value int8 tensor [8] (one value = symmetric: oneDNN
subtracts 8 from every nibble). Per-channel scales are one group of K.

Learned from (facts, not code): vLLM's model_executor/kernels/linear/mixed_precision/xpu.py
(XPUW4A8IntLinearKernel: constraints, packing, the call) and _xpu_ops.py (its per-token quantizer),
and vllm-xpu-kernels' int4_gemm_w4a8 / dnnl_matmul_w4a8_int4 (scale grouping {group_size, 1}, one
zero point = symmetric, float16 output).

NOT RUN ON XPU: this machine and the CI have no Intel GPU. Constraints, packing and the call into the
op are tested on CPU, the call against a stand-in op with the same schema (tests/kernels/test_xpu.py).
"""

from __future__ import annotations

import functools
import warnings

import torch

from qfuse.kernels.base import OK, Kernel, Verdict
from qfuse.kernels.capabilities import DYNAMIC, STATIC, Capability
from qfuse.kernels.int4_words import pack_int4
from qfuse.kernels.prepared import PreparedWeight
from qfuse.platform import Platform
from qfuse.schemes import INT4_DTYPE, INT4_OFFSET, Granularity

XPU_KERNELS_LIBRARY = "vllm_xpu_kernels"
GROUP_SIZE_MULTIPLE = 32
ALIGNMENT = 8  # K and N
XPU_FLOAT_DTYPES = (torch.float16, torch.bfloat16)  # activation and output
ONEDNN_OUT_DTYPE = torch.float16
DEQUANTIZED = "dequantized float32"  # the packing of a weight whose values leave int4's range


def xpu_int4_gemm_w4a8():
    """The oneDNN W4A8 op: int4_gemm_w4a8(A int8 [M, K], A_scale [M, 1], A_zp int32 [M, 1],
    B int32 [K / 8, N] (NT view), B_scale [K / g, N], B_zp, int group_size, Tensor? g_idx,
    Tensor? bias) -> float16 [M, N]. The only place qfuse touches vllm-xpu-kernels."""
    import vllm_xpu_kernels._xpu_C  # noqa: F401  (registers torch.ops._xpu_C)

    return torch.ops._xpu_C.int4_gemm_w4a8


@functools.cache
def warn_float16_output_once() -> None:
    warnings.warn(
        "qfuse's xpu W4A8 kernel runs oneDNN's int4_gemm_w4a8, which writes float16; qfuse casts the result "
        "back to bfloat16 (a float16 model avoids the cast and float16's narrower range)",
        stacklevel=3,
    )


class XpuKernel(Kernel):
    name = "xpu"
    fuses_activation_quant = False  # the op takes the graph's int8 activation and its scale
    prepares_weight = True  # int4 values -> packed int32
    reads_group_scales = True  # oneDNN takes [K / g, N] and g
    capabilities = (
        Capability("W4A8 int4_gemm_w4a8", ("xpu",), (torch.int8,), (INT4_DTYPE,),
                   (Granularity.PER_TENSOR, Granularity.PER_TOKEN),  # one value is expanded to every token
                   (Granularity.PER_CHANNEL, Granularity.PER_GROUP), activation_scale_kinds=(DYNAMIC, STATIC),
                   weight_group_multiple=GROUP_SIZE_MULTIPLE, k_multiple=ALIGNMENT, n_multiple=ALIGNMENT,
                   out_dtypes=XPU_FLOAT_DTYPES),  # any float bias: cast to float16 for oneDNN
    )

    def is_supported(self, platform: Platform) -> Verdict:
        if platform.device_type != "xpu":
            return False, f"the xpu kernel runs on Intel GPUs (XPU) only, not on {platform.describe()}"
        if not platform.has(XPU_KERNELS_LIBRARY):
            return False, "vllm-xpu-kernels is not installed (it provides the oneDNN op _xpu_C::int4_gemm_w4a8)"
        return OK

    def prepare_weight(self, b, scale_b, azp_b) -> PreparedWeight:
        """[K, N] int4 values in int8 -> packed int32 [N, K / 8]; scale as contiguous [K / g, N]; zero point [8]."""
        if azp_b is not None:
            raise ValueError("the xpu kernel takes symmetric int4 weights; the weight has a zero point")
        if scale_b is None or scale_b.dim() != 2 or scale_b.shape[1] != b.shape[1] or b.shape[0] % scale_b.shape[0]:
            shape = None if scale_b is None else tuple(scale_b.shape)
            raise ValueError(f"the xpu kernel needs a [K / g, N] weight scale for its [K, N] = {tuple(b.shape)} "
                             f"weight, got {shape}")
        k, n = b.shape
        if b.numel() and (b.min() < -INT4_OFFSET or b.max() >= INT4_OFFSET):
            # int8 storage does not prove int4's range (torchao's intx keeps int5-int8 values alike): such a
            # weight runs dequantized, exact and slower, where oneDNN's int4 packing cannot hold it
            warnings.warn(f"qfuse's xpu W4A8 kernel: a [K, N] = {(k, n)} weight holds values outside int4's "
                          "[-8, 7]; it runs dequantized in float32 (exact, slower)", stacklevel=3)
            dense = b.float() * scale_b.float().repeat_interleave(k // scale_b.shape[0], dim=0)
            return PreparedWeight(dense, None, None, k, n, packing=DEQUANTIZED)
        zero_point = torch.tensor([INT4_OFFSET], dtype=torch.int8, device=b.device)
        return PreparedWeight(pack_int4(b.t()), scale_b.contiguous(), zero_point, k, n)

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        if a.dtype != torch.int8 or azp_a is not None:
            raise ValueError(f"the xpu kernel takes a symmetric int8 activation, "
                             f"got {a.dtype} with zero point {azp_a is not None}")
        if out_dtype not in XPU_FLOAT_DTYPES:
            raise ValueError(f"the xpu kernel returns float16 or bfloat16, not {out_dtype}")
        rows = a.shape[0]
        scale_a = _per_token_scale(scale_a, rows, a.device)
        if weight.packing == DEQUANTIZED:
            out = (a.float() * scale_a.float()) @ weight.data
            return (out if bias is None else out + bias.float()).to(out_dtype)
        if out_dtype == torch.bfloat16:
            warn_float16_output_once()
        zero_point_a = torch.zeros(rows, 1, dtype=torch.int32, device=a.device)
        group_size = weight.k // weight.scale.shape[0]
        bias = None if bias is None else bias.to(ONEDNN_OUT_DTYPE)
        out = xpu_int4_gemm_w4a8()(a.contiguous(), scale_a, zero_point_a, weight.data.t(), weight.scale,
                                   weight.zero_point, group_size, None, bias)
        return out.to(out_dtype)


def _per_token_scale(scale: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    """None / one value / [M, 1] -> a contiguous [M, 1] scale (the per-token layout oneDNN reads)."""
    if scale is None:
        return torch.ones(rows, 1, device=device, dtype=torch.float32)
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    if tuple(scale.shape) == (rows, 1):
        return scale.contiguous()
    raise ValueError(f"the xpu kernel takes a per-token activation scale [{rows}, 1], got shape {tuple(scale.shape)}")
