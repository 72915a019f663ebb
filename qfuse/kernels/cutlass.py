"""`cutlass`: CUTLASS scaled GEMMs on NVIDIA GPUs, from vLLM or from ATen.

Two implementations, named by `cutlass_backend(platform)`:

    vllm  torch.ops._C.cutlass_scaled_mm(out, a, b, scale_a, scale_b, bias), when vLLM is
          importable: int8 (capability >= 75) and fp8 e4m3 (>= 89), per-tensor or per-token
          activation scales x per-tensor or per-channel weight scales, bf16 / fp16 output.
    aten  torch._scaled_mm with row-wise scales, which ATen runs on its own CUTLASS kernel
          (f8f8bf16_rowwise) on sm89 / sm90: fp8 only, bf16 output only. Per-tensor scales are
          expanded to row-wise so the call takes that CUTLASS path (tensor-wise scaling would
          go to cuBLASLt, which is the `torch` kernel's business). ATen's int8 GEMM
          (torch._int_mm) is cuBLASLt, not CUTLASS, so without vLLM int8 goes to another kernel.

Both want K and N multiples of 16 (16-byte aligned rows of fp8/int8). Other sizes are padded:
the weight once in `prepare_weight` (zeros, column-major [K16, N16], per-channel scales padded
with 1.0), the activation's K with zeros on every call, and the output is sliced back to N.
Zero padding is exact: the extra products are zero, so the table has no K / N alignment.
What each backend takes is the capability table `CutlassKernel.capabilities`.

At a small M known at compile time ATen's row-wise fp8 GEMM runs a prefill tile and is slower than
the Triton decode template (M <= 16) and, on Hopper, cuBLAS (16 < M <= 128) (`why_slower_here`),
which the registry takes then.
"""

from __future__ import annotations

import torch

from qfuse.kernels.base import DECODE_ROWS, OK, GemmKey, Kernel, Verdict
from qfuse.kernels.capabilities import SAME_AS_OUTPUT, Capability
from qfuse.kernels.prepared import PreparedWeight, padded_activation, padded_weight
from qfuse.platform import Platform, current_platform
from qfuse.schemes import FP8_DTYPE

ALIGNMENT = 16
_CUDA = ("cuda",)
_BF16, _FP16, _INT8 = torch.bfloat16, torch.float16, torch.int8


def cutlass_backend(platform: Platform) -> str:
    """Which CUTLASS runs: vLLM's kernels when importable, else ATen's row-wise fp8 GEMM."""
    return "vllm" if platform.has("vllm") else "aten"


#: On Hopper, up to this M ATen's row-wise fp8 GEMM is slower than the kernels after it.
ROWWISE_SLOW_MAX_ROWS = 128


def aten_rowwise_slow_max_rows(platform: Platform) -> int:
    """Up to how many rows ATen's row-wise fp8 GEMM is slower than cuBLAS with unit scales and the
    scales applied after: ROWWISE_SLOW_MAX_ROWS on Hopper (measured), 0 elsewhere (not measured)."""
    return ROWWISE_SLOW_MAX_ROWS if platform.capability >= 90 else 0


def rowwise_slow_max_rows(platform: Platform) -> int:
    """Up to how many rows an fp8 linear runs faster on a later kernel than here (0: none): the
    decode rows, 16, where the Triton decode template is faster, and on Hopper up to 128, where
    cuBLAS is (`aten_rowwise_slow_max_rows`). Kernel choice asks it for a static M, the lowering
    (`qfuse.lowerings.dispatch`) for each bucket of a dynamic one."""
    if cutlass_backend(platform) != "aten":
        return 0
    return max(DECODE_ROWS, aten_rowwise_slow_max_rows(platform))


def fp8_small_m_yields(platform: Platform) -> str:
    """Why an fp8 linear of at most `rowwise_slow_max_rows` rows runs faster on a later kernel."""
    return ("ATen's row-wise fp8 GEMM runs a 128x128 tile, slower than the Triton template's decode tiles and "
            "than cuBLAS (measured on an H200: docs/benchmarks.md, \"Small M and the activation quant\")")


class CutlassKernel(Kernel):
    name = "cutlass"
    prepares_weight = True
    # Per-tensor / per-token x per-tensor / per-channel scales, no zero points (the defaults).
    capabilities = (
        Capability("int8 via vLLM", _CUDA, (_INT8,), (_INT8,), out_dtypes=(_BF16, _FP16),
                   bias_dtypes=SAME_AS_OUTPUT, min_capability=75, rocm=False, requires=("vllm",)),
        Capability("fp8 via vLLM", _CUDA, (FP8_DTYPE,), (FP8_DTYPE,), out_dtypes=(_BF16, _FP16),
                   bias_dtypes=SAME_AS_OUTPUT, min_capability=89, rocm=False, requires=("vllm",)),
        Capability("fp8 via ATen (f8f8bf16_rowwise)", _CUDA, (FP8_DTYPE,), (FP8_DTYPE,), out_dtypes=(_BF16,),
                   bias_dtypes=SAME_AS_OUTPUT, min_capability=89, rocm=False),
    )

    def is_supported(self, platform: Platform) -> Verdict:
        if platform.device_type != "cuda" or platform.is_rocm:
            return False, f"CUTLASS runs on NVIDIA GPUs, not on {platform.describe()}"
        return OK

    def why_slower_here(self, key: GemmKey, platform: Platform) -> str:
        if key.m is not None and key.m <= rowwise_slow_max_rows(platform) and key.scheme.activation_dtype == FP8_DTYPE:
            return f"at M = {key.m} {fp8_small_m_yields(platform)}"
        return super().why_slower_here(key, platform)

    def speed_row_bounds(self, key: GemmKey, platform: Platform) -> tuple[int, ...]:
        bound = rowwise_slow_max_rows(platform)
        return (bound,) if bound and key.scheme.activation_dtype == FP8_DTYPE else ()

    def prepare_weight(self, b, scale_b, azp_b) -> PreparedWeight:
        """Column-major [K16, N16] weight (zero padded) and a float32 [1, N16] or [] scale."""
        k, n = b.shape
        data = padded_weight(b, ALIGNMENT, ALIGNMENT)
        n_padded = data.shape[1]
        scale = None if scale_b is None else scale_b.to(torch.float32)
        if scale is not None and scale.numel() != 1 and n_padded != n:
            scale = torch.nn.functional.pad(scale.reshape(1, n), (0, n_padded - n), value=1.0)
        return PreparedWeight(data, scale, azp_b, k, n)

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        if azp_a is not None or weight.zero_point is not None:
            raise ValueError("the cutlass kernel has no zero points; use kernel='torch' for asymmetric int8")
        k_padded, n_padded = weight.data.shape
        a = padded_activation(a, k_padded)
        rows = a.shape[0]
        unit = torch.ones((), device=a.device, dtype=torch.float32)
        scale_a = (unit if scale_a is None else scale_a.to(torch.float32)).reshape(-1, 1).expand(rows, 1).contiguous()
        scale_b = (unit if weight.scale is None else weight.scale).reshape(1, -1).expand(1, n_padded).contiguous()
        if bias is not None and n_padded != weight.n:
            bias = torch.nn.functional.pad(bias, (0, n_padded - weight.n))
        if bias is not None and bias.dtype != out_dtype:
            raise ValueError(f"the cutlass kernel takes a bias of the output dtype {out_dtype}, got {bias.dtype}")
        if cutlass_backend(current_platform("cuda")) == "vllm":
            out = torch.empty((rows, n_padded), dtype=out_dtype, device=a.device)
            vllm_cutlass_scaled_mm()(out, a, weight.data, scale_a, scale_b, bias)
        else:
            out = torch._scaled_mm(a, weight.data, scale_a, scale_b, bias=bias, out_dtype=out_dtype)
        return out[:, : weight.n] if n_padded != weight.n else out


def vllm_cutlass_scaled_mm():
    """vLLM's CUTLASS op (importing vLLM registers it); one lookup so tests can stand one in."""
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C.*)

    return torch.ops._C.cutlass_scaled_mm
