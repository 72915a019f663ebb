"""`aiter`: AMD AITER's a8w8 GEMM (Composable Kernel, row-wise scales) on ROCm MI300 / MI355.

    out[M, N] = (a[M, K] @ b[N, K]^T) * scale_a[M, 1] * scale_b[1, N] + bias[N]
    via aiter.gemm_a8w8_CK(XQ, WQ, x_scale, w_scale, bias, dtype=out_dtype)

What it accepts: the machine in `is_supported` (a ROCm GPU, `aiter` importable, QFUSE_AITER_LINEAR
on, an arch in FP8_DTYPE_BY_ARCH), the rest in the capability table `AiterKernel.capabilities`
(docs/kernels.md prints it): int8 / fp8, symmetric, per-tensor x per-tensor or per-token x
per-channel scales, static K and N multiples of 16, bf16 / fp16 output, a bias of the output dtype.

fp8 encoding: MI300 (gfx940-gfx942) computes in e4m3fnuz, MI355 (gfx950) in OCP e4m3fn. qfuse's ops
carry e4m3fn, so on gfx94x `prepare_weight` re-encodes the weight once (`e4m3fn_to_e4m3fnuz`: same
bits, half the value, so the scale doubles) and `apply` re-encodes the activation on every call,
doubling its scale. Quantizing the activation straight to e4m3fnuz (qmax 240) would save that pass
and is the better follow-up.

Layouts: `prepare_weight` turns the [K, N] weight into the contiguous [N, K] matrix AITER wants and
the weight scale into [1, N] float32; `apply` expands the activation scale to [M, 1] float32. AITER's
own tests pass scales in exactly these shapes (vLLM passes one-value scales as they are; expanding
them costs nothing and does not rely on the kernel broadcasting).

The switch: QFUSE_AITER_LINEAR (1/0, true/false, yes/no, on/off; unset or empty means on). vLLM
gates the same GEMM on VLLM_ROCM_USE_AITER (default off) and VLLM_ROCM_USE_AITER_LINEAR (default
on); in qfuse, installing aiter is the opt-in, so only the linear switch remains, default on.

Learned from (facts, not code): vLLM's model_executor/layers/quantization/kernels/scaled_mm/aiter.py
and _aiter_ops.py (the call, the scale-pair rule, the alignment and dtype asserts, the switches),
its normalize_e4m3fn_to_e4m3fnuz, and ROCm/aiter's op_tests/test_gemm_a8w8.py (scale shapes).

NOT RUN ON ROCm: this machine and the CI have no ROCm GPU. The constraint table is tested on
constructed platforms, and the call into AITER is tested against a stand-in op with the same
signature (tests/kernels/test_aiter.py).
"""

from __future__ import annotations

import os

import torch

from qfuse.kernels.base import OK, Kernel, Verdict
from qfuse.kernels.capabilities import SAME_AS_OUTPUT, Capability
from qfuse.kernels.prepared import PreparedWeight
from qfuse.platform import Platform, current_platform
from qfuse.schemes import FP8_DTYPE, Granularity

FNUZ_DTYPE = torch.float8_e4m3fnuz
#: The fp8 encoding each supported GPU computes in. Archs not listed are not supported.
FP8_DTYPE_BY_ARCH: dict[str, torch.dtype] = {
    "gfx940": FNUZ_DTYPE,  # MI300A / MI300X variants
    "gfx941": FNUZ_DTYPE,
    "gfx942": FNUZ_DTYPE,  # MI300X, MI325X
    "gfx950": FP8_DTYPE,  # MI350X, MI355X: OCP e4m3fn
}
#: The (activation, weight) scale granularities AITER's a8w8 GEMM takes (its row's `scale_pairs`).
SCALE_PAIRS = (
    (Granularity.PER_TENSOR, Granularity.PER_TENSOR),
    (Granularity.PER_TOKEN, Granularity.PER_CHANNEL),
)
WEIGHT_DTYPES = (torch.int8, FP8_DTYPE)
OUT_DTYPES = (torch.bfloat16, torch.float16)
ALIGNMENT = 16  # K and N
LINEAR_SWITCH = "QFUSE_AITER_LINEAR"
_ON, _OFF = {"1", "true", "yes", "on", ""}, {"0", "false", "no", "off"}

# e4m3fn bit patterns that need a new meaning in e4m3fnuz (same bits elsewhere, half the value).
_E4M3FN_NEGATIVE_ZERO = 0x80  # e4m3fn -0.0; the only NaN of e4m3fnuz
_E4M3FN_NAN_LOW_BITS = 0x7F  # e4m3fn NaN is 0x7F / 0xFF; in e4m3fnuz these are +-240
_E4M3FNUZ_NAN = 0x80
_E4M3FNUZ_ZERO = 0x00


def e4m3fn_to_e4m3fnuz(x: torch.Tensor) -> torch.Tensor:
    """Re-encode e4m3fn as e4m3fnuz with the same bits, so every finite value halves.

    0x80 (-0.0 in e4m3fn, NaN in e4m3fnuz) becomes +0.0, and the e4m3fn NaNs (0x7F, 0xFF, which
    would read as +-240) become the e4m3fnuz NaN. Multiply the scale by 2 to keep value * scale.
    """
    if x.dtype != FP8_DTYPE:
        raise ValueError(f"e4m3fn_to_e4m3fnuz takes float8_e4m3fn, got {x.dtype}")
    bits = x.contiguous().view(torch.uint8)
    bits = torch.where(bits == _E4M3FN_NEGATIVE_ZERO, _E4M3FNUZ_ZERO, bits)
    bits = torch.where((bits & _E4M3FN_NAN_LOW_BITS) == _E4M3FN_NAN_LOW_BITS, _E4M3FNUZ_NAN, bits)
    return bits.view(FNUZ_DTYPE)


def linear_switch_on() -> bool:
    """QFUSE_AITER_LINEAR, default on; a value that is neither on nor off is an error."""
    value = os.environ.get(LINEAR_SWITCH, "").strip().lower()
    if value not in _ON | _OFF:
        raise ValueError(f"{LINEAR_SWITCH}={value!r} is neither on (1, true, yes, on) nor off (0, false, no, off)")
    return value in _ON


def aiter_gemm_a8w8():
    """AITER's CK a8w8 GEMM: gemm_a8w8_CK(XQ [M, K], WQ [N, K], x_scale [M, 1], w_scale [1, N],
    bias=None, dtype=torch.bfloat16, splitK=None) -> [M, N]. The only place qfuse touches aiter."""
    import aiter

    return aiter.gemm_a8w8_CK


def gpu_arch(device: torch.device) -> str:
    """The gfx name of the GPU that holds `device`'s tensors ('' when unknown)."""
    return current_platform(device.type).gpu_arch


def _per_row_scale(scale: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    """None / one value / [M, 1] -> [M, 1] float32, the x_scale layout of gemm_a8w8_CK."""
    if scale is None:
        return torch.ones(rows, 1, device=device, dtype=torch.float32)
    if scale.numel() == 1:
        return scale.reshape(1, 1).to(torch.float32).expand(rows, 1).contiguous()
    if tuple(scale.shape) == (rows, 1):
        return scale.to(torch.float32).contiguous()
    raise ValueError(f"the aiter kernel takes a per-tensor or per-token activation scale; "
                     f"got shape {tuple(scale.shape)}")


def _per_column_scale(scale: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    """None / one value / [1, N] -> [1, N] float32, the w_scale layout of gemm_a8w8_CK."""
    if scale is None:
        return torch.ones(1, n, device=device, dtype=torch.float32)
    if scale.numel() == 1:
        return scale.reshape(1, 1).to(torch.float32).expand(1, n).contiguous()
    if tuple(scale.shape) == (1, n):
        return scale.to(torch.float32).contiguous()
    raise ValueError(f"the aiter kernel takes a per-tensor or per-channel weight scale; got shape {tuple(scale.shape)}")


class AiterKernel(Kernel):
    name = "aiter"
    prepares_weight = True  # [K, N] -> contiguous [N, K], e4m3fn -> e4m3fnuz on MI300
    capabilities = (
        Capability("gemm_a8w8_CK", ("cuda",), WEIGHT_DTYPES, WEIGHT_DTYPES, scale_pairs=SCALE_PAIRS, k_multiple=ALIGNMENT,
                   n_multiple=ALIGNMENT, out_dtypes=OUT_DTYPES, bias_dtypes=SAME_AS_OUTPUT),
    )

    def is_supported(self, platform: Platform) -> Verdict:
        if not platform.is_rocm:
            return False, f"AITER runs on ROCm GPUs only, not on {platform.describe()}"
        if not platform.has("aiter"):
            return False, "the aiter package is not installed (github.com/ROCm/aiter)"
        if not linear_switch_on():
            return False, f"AITER linear is switched off ({LINEAR_SWITCH}={os.environ[LINEAR_SWITCH]})"
        if platform.gpu_arch not in FP8_DTYPE_BY_ARCH:
            return False, (f"AITER's a8w8 GEMM is enabled for MI300 / MI355 ({', '.join(FP8_DTYPE_BY_ARCH)}), "
                           f"not for {platform.gpu_arch or 'a GPU of unknown arch'}")
        return OK

    def prepare_weight(self, b, scale_b, azp_b) -> PreparedWeight:
        """[K, N] -> contiguous [N, K] and a [1, N] float32 scale; fp8 re-encoded where the GPU needs it."""
        if azp_b is not None:
            raise ValueError("the aiter kernel is symmetric; the weight has a zero point")
        k, n = b.shape
        weight_nk = b.t().contiguous()
        scale = _per_column_scale(scale_b, n, b.device)
        if b.dtype == FP8_DTYPE and self._fp8_dtype_for(b.device) == FNUZ_DTYPE:
            weight_nk, scale = e4m3fn_to_e4m3fnuz(weight_nk), scale * 2
        return PreparedWeight(weight_nk, scale, None, k, n)

    @staticmethod
    def _fp8_dtype_for(device: torch.device) -> torch.dtype:
        arch = gpu_arch(device)
        if arch not in FP8_DTYPE_BY_ARCH:
            raise ValueError(f"the aiter kernel has no fp8 encoding for GPU arch {arch!r}; "
                             f"known: {list(FP8_DTYPE_BY_ARCH)}")
        return FP8_DTYPE_BY_ARCH[arch]

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        if azp_a is not None:
            raise ValueError("the aiter kernel is symmetric; the activation has a zero point")
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"the aiter kernel writes bfloat16 or float16, not {out_dtype}")
        if bias is not None and bias.dtype != out_dtype:
            raise ValueError(f"the aiter kernel takes a bias of the output dtype {out_dtype}, got {bias.dtype}")
        scale_a = _per_row_scale(scale_a, a.shape[0], a.device)
        if weight.data.dtype == FNUZ_DTYPE:  # the weight was re-encoded: so must the activation be
            a, scale_a = e4m3fn_to_e4m3fnuz(a), scale_a * 2
        return aiter_gemm_a8w8()(a.contiguous(), weight.data, scale_a, weight.scale, bias, dtype=out_dtype)
