"""Tests for the `cutlass` kernel: its constraint table, the padding in prepare_weight and apply,
and the call into vLLM's op (a stand-in registered here: vLLM is not installed).

The ATen backend's call, torch._scaled_mm with row-wise scales, also runs on CPU (torch >= 2.13),
so the padding and slicing are checked numerically against the float64 reference on the GPU when
there is one, else on the CPU; tests/test_cuda.py runs the kernel end to end on the GPU machine.
"""

import pytest
import torch

from qfuse.kernels import GemmKey, get_kernel, reference_math, why_not_implemented
from qfuse.kernels import cutlass as cutlass_module
from qfuse.kernels.prepared import prepare_once
from qfuse.platform import Platform
from qfuse.schemes import FP8_DTYPE, INT4_DTYPE, Granularity, QuantScheme

G = Granularity
H100 = Platform("cuda", cuda_capability=(9, 0), libraries=frozenset({"triton"}))
H100_VLLM = Platform("cuda", cuda_capability=(9, 0), libraries=frozenset({"triton", "vllm"}))
T4_VLLM = Platform("cuda", cuda_capability=(7, 5), libraries=frozenset({"vllm"}))
V100_VLLM = Platform("cuda", cuda_capability=(7, 0), libraries=frozenset({"vllm"}))
A100_VLLM = Platform("cuda", cuda_capability=(8, 0), libraries=frozenset({"vllm"}))
MI300 = Platform("cuda", is_rocm=True, cuda_capability=(9, 4), gpu_arch="gfx942")

FP8 = QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True)
FP8_TENSOR = QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TENSOR, G.PER_TENSOR, dynamic=False)
FP8_BLOCK = QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_GROUP, G.BLOCK, dynamic=True)
INT8 = QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True)
W4A8 = QuantScheme(torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, dynamic=True, weight_group_size=128)
INT8_ASYMMETRIC = QuantScheme(torch.uint8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True, symmetric=False)
BF16 = torch.bfloat16
CUTLASS = get_kernel("cutlass")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def key(scheme=FP8, out_dtype=BF16, bias_dtype=BF16):
    return GemmKey(scheme, n=4096, k=4096, out_dtype=out_dtype, bias_dtype=bias_dtype, device_type="cuda")


@pytest.mark.parametrize(
    "platform, gemm, reason",
    [
        (H100, key(), ""),
        (H100, key(FP8_TENSOR), ""),
        (H100, key(bias_dtype=None), ""),
        (H100_VLLM, key(INT8), ""),
        (H100_VLLM, key(out_dtype=torch.float16, bias_dtype=torch.float16), ""),
        (T4_VLLM, key(INT8), ""),
        (H100, key(INT8), "int8 via vLLM needs vllm (not importable)"),
        (H100_VLLM, key(W4A8), "cutlass computes int8 x int8, fp8 x fp8 on cuda, not int8 x int4"),
        (V100_VLLM, key(INT8), "int8 via vLLM needs compute capability >= 75 (this GPU: 70)"),
        (A100_VLLM, key(), "fp8 via vLLM and fp8 via ATen (f8f8bf16_rowwise): needs compute capability >= 89 (this GPU: 80)"),
        (H100_VLLM, key(INT8_ASYMMETRIC), "cutlass computes int8 x int8, fp8 x fp8 on cuda, not uint8 x int8"),
        (H100, key(FP8_BLOCK), "fp8 via ATen (f8f8bf16_rowwise) takes per-tensor / per-token activation scales, not per-group"),
        (H100, key(out_dtype=torch.float16, bias_dtype=None), "fp8 via ATen (f8f8bf16_rowwise) writes bf16, not fp16"),
        (H100_VLLM, key(out_dtype=torch.float32, bias_dtype=None), "fp8 via vLLM writes bf16 / fp16, not fp32; fp8 via ATen (f8f8bf16_rowwise) writes bf16, not fp32"),
        (H100, key(bias_dtype=torch.float32),
         "fp8 via ATen (f8f8bf16_rowwise) adds a bias of the output dtype only (bias fp32, output bf16)"),
    ],
)
def test_capability_rows(platform, gemm, reason):
    assert why_not_implemented(CUTLASS, gemm, platform) == reason


@pytest.mark.parametrize("platform, where", [(MI300, "ROCm GPU (capability 94)"), (Platform("cpu"), "CPU")])
def test_runs_on_nvidia_gpus_only(platform, where):
    assert CUTLASS.is_supported(platform) == (False, f"CUTLASS runs on NVIDIA GPUs, not on {where}")
    assert CUTLASS.is_supported(H100) == (True, "")


def test_backend_is_named_by_what_is_importable():
    assert cutlass_module.cutlass_backend(H100) == "aten"
    assert cutlass_module.cutlass_backend(H100_VLLM) == "vllm"


def fp8_operands(m, k, n, per_tensor=False, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=generator).mul(40).clamp(-448, 448).to(FP8_DTYPE)
    weight = torch.randn(n, k, generator=generator).mul(40).clamp(-448, 448).to(FP8_DTYPE)
    if per_tensor:
        scale_a, scale_b = torch.tensor(0.02), torch.tensor(0.03)
    else:
        scale_a = torch.rand(m, 1, generator=generator) / 50 + 1e-3
        scale_b = torch.rand(1, n, generator=generator) / 50 + 1e-3
    bias = torch.randn(n, generator=generator).to(BF16)
    return [tensor.to(DEVICE) for tensor in (a, weight.t(), scale_a, scale_b, bias)]


def test_prepare_weight_pads_to_16_column_major_with_unit_scales():
    _, b, _, scale_b, _ = fp8_operands(3, 40, 20)
    prepared = CUTLASS.prepare_weight(b, scale_b, None)
    assert (prepared.k, prepared.n) == (40, 20)
    assert prepared.data.shape == (48, 32) and prepared.data.stride() == (1, 48)  # column-major
    assert torch.equal(prepared.data[:40, :20].float(), b.float())
    assert prepared.data[40:].float().abs().sum() == 0 and prepared.data[:, 20:].float().abs().sum() == 0
    assert prepared.scale.shape == (1, 32)
    assert torch.equal(prepared.scale[:, :20], scale_b) and torch.all(prepared.scale[:, 20:] == 1.0)


def test_prepare_weight_keeps_aligned_weights_and_per_tensor_scales():
    _, b, _, _, _ = fp8_operands(3, 64, 32)
    prepared = CUTLASS.prepare_weight(b, torch.tensor(0.5), None)
    assert prepared.data.shape == (64, 32) and prepared.scale.reshape(()) == 0.5


@pytest.mark.parametrize("m, k, n", [(1, 64, 32), (33, 40, 20), (7, 136, 264), (5, 17, 3)])
@pytest.mark.parametrize("per_tensor", [False, True], ids=["rowwise", "tensorwise"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_apply_matches_reference_on_odd_sizes(m, k, n, per_tensor, with_bias):
    a, b, scale_a, scale_b, bias = fp8_operands(m, k, n, per_tensor)
    bias = bias if with_bias else None
    out = CUTLASS.apply(a, prepare_once(CUTLASS, b, scale_b, None), scale_a, bias, None, BF16)
    expected = reference_math.scaled_mm(a, b, scale_a, scale_b, bias, None, None, torch.float64)
    assert out.shape == (m, n) and out.dtype == BF16
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)


def test_the_op_runs_the_cutlass_kernel():
    a, b, scale_a, scale_b, bias = fp8_operands(9, 40, 20)
    out = torch.ops.qfuse.scaled_mm(a.reshape(3, 3, 40), b, scale_a, scale_b, bias, None, None, BF16, "cutlass")
    expected = reference_math.scaled_mm(a, b, scale_a, scale_b, bias, None, None, torch.float64)
    torch.testing.assert_close(out.reshape(9, 20).double(), expected, rtol=1e-2, atol=1e-2)


def test_vllm_op_gets_padded_column_major_operands(monkeypatch):
    """Contract with vLLM's cutlass_scaled_mm(out, a, b, scale_a, scale_b, bias), through a stand-in."""
    calls = []

    def stand_in(out, a, b, scale_a, scale_b, bias):
        calls.append((a.shape, b.shape, b.stride(), scale_a.shape, scale_b.shape, out.dtype))
        result = (a.double() @ b.double()) * scale_a.double() * scale_b.double()
        out.copy_(result + (0 if bias is None else bias.double()))

    monkeypatch.setattr(cutlass_module, "cutlass_backend", lambda platform: "vllm")
    monkeypatch.setattr(cutlass_module, "vllm_cutlass_scaled_mm", lambda: stand_in)
    a, b, scale_a, scale_b, bias = fp8_operands(5, 40, 20)
    out = CUTLASS.apply(a, CUTLASS.prepare_weight(b, scale_b, None), scale_a, bias, None, BF16)
    assert calls == [((5, 48), (48, 32), (1, 48), (5, 1), (1, 32), BF16)]
    expected = reference_math.scaled_mm(a, b, scale_a, scale_b, bias, None, None, torch.float64)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)


def test_zero_points_are_refused():
    a, b, scale_a, scale_b, _ = fp8_operands(2, 32, 16)
    with pytest.raises(ValueError, match="the cutlass kernel has no zero points"):
        CUTLASS.apply(a, CUTLASS.prepare_weight(b, scale_b, None), scale_a, None, torch.tensor(3), BF16)
