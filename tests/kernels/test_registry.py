"""Tests for `qfuse.kernels.registry.choose_kernel` and `get_kernel`.

Platforms are built here (CPU, fake NVIDIA CUDA GPUs, ROCm, XPU), so no GPU is needed: the registry
only reads the `Platform` facts and the `GemmKey`. Covered: the default pick per platform, forced
kernels (and their error with the reason), disabled kernels, preference lists, block scales,
CUDA K/N alignment, unknown kernel names, and `KernelChoice.explain()`.
"""

import re

import pytest
import torch

from qfuse.kernels import GemmKey, KernelUnavailableError, choose_kernel, get_kernel
from qfuse.platform import Platform
from qfuse.schemes import FP8_DTYPE, Granularity, QuantScheme

CPU = Platform("cpu", cpu_has_avx512_vnni=True)
H100 = Platform("cuda", cuda_capability=(9, 0), libraries=frozenset({"triton"}))
A100 = Platform("cuda", cuda_capability=(8, 0), libraries=frozenset({"triton"}))
MI300 = Platform("cuda", is_rocm=True, cuda_capability=(9, 4), libraries=frozenset({"triton"}))
XPU = Platform("xpu")

INT8_TOKEN_CHANNEL = QuantScheme(torch.int8, torch.int8, Granularity.PER_TOKEN, Granularity.PER_CHANNEL, dynamic=True)
FP8_TENSOR = QuantScheme(FP8_DTYPE, FP8_DTYPE, Granularity.PER_TENSOR, Granularity.PER_TENSOR, dynamic=False)
FP8_BLOCK = QuantScheme(FP8_DTYPE, FP8_DTYPE, Granularity.PER_GROUP, Granularity.BLOCK, dynamic=True)
INT8_BLOCK_WEIGHT = QuantScheme(torch.int8, torch.int8, Granularity.PER_TOKEN, Granularity.BLOCK, dynamic=True)
INT8_GROUP_ACTIVATION = QuantScheme(torch.int8, torch.int8, Granularity.PER_GROUP, Granularity.PER_CHANNEL, True)
UINT8_ASYMMETRIC = QuantScheme(torch.uint8, torch.int8, Granularity.PER_TOKEN, Granularity.PER_CHANNEL, True, False)
BLOCK_REASON = "torch has no block-scaled GEMM (per-group activation / 128x128 weight scales)"


def key(scheme=INT8_TOKEN_CHANNEL, n=256, k=512, device_type="cpu", out_dtype=torch.bfloat16):
    return GemmKey(scheme, n=n, k=k, out_dtype=out_dtype, bias_dtype=out_dtype, device_type=device_type)


@pytest.mark.parametrize("scheme", [INT8_TOKEN_CHANNEL, FP8_TENSOR, UINT8_ASYMMETRIC])
def test_torch_is_chosen_on_cpu(scheme):
    choice = choose_kernel(key(scheme, n=33, k=200), CPU)  # CPU has no alignment constraint
    assert choice.kernel is get_kernel("torch")
    assert choice.rejected == {}
    assert choice.explain() == "torch"


@pytest.mark.parametrize("scheme", [INT8_TOKEN_CHANNEL, FP8_TENSOR])
def test_torch_is_chosen_on_an_aligned_cuda_gpu(scheme):
    choice = choose_kernel(key(scheme, device_type="cuda"), H100)
    assert choice.kernel.name == "torch" and choice.rejected == {}


@pytest.mark.parametrize("forced", ["reference", "torch"])
def test_forced_kernel_is_returned(forced):
    choice = choose_kernel(key(), CPU, forced=forced)
    assert choice.kernel is get_kernel(forced)
    assert choice.rejected == {}


def test_forced_reference_implements_block_scales():
    assert choose_kernel(key(FP8_BLOCK), CPU, forced="reference").kernel.name == "reference"


def test_forced_kernel_that_cannot_implement_raises_with_its_reason():
    with pytest.raises(KernelUnavailableError) as raised:
        choose_kernel(key(FP8_BLOCK), CPU, forced="torch")
    assert str(raised.value) == f"forced kernel 'torch' cannot run fp8 dyn-group x block: {BLOCK_REASON}"


@pytest.mark.parametrize(
    "platform, where",
    [(MI300, "ROCm GPU (capability 94)"), (XPU, "XPU")],
)
def test_forced_kernel_on_unsupported_platform_raises(platform, where):
    with pytest.raises(KernelUnavailableError, match=re.escape(f"runs on CPU and NVIDIA CUDA only, not on {where}")):
        choose_kernel(key(device_type=platform.device_type), platform, forced="torch")


def test_disabled_kernel_is_skipped_with_reason():
    choice = choose_kernel(key(), CPU, disabled=["torch"])
    assert choice.kernel is None
    assert choice.rejected == {"torch": "disabled by configuration"}
    assert choice.explain() == "none (rejected torch: disabled by configuration)"


@pytest.mark.parametrize(
    "preference, expected",
    [(("reference",), "reference"), (("reference", "torch"), "reference"), (("torch", "reference"), "torch")],
)
def test_preference_list_is_honoured(preference, expected):
    choice = choose_kernel(key(), CPU, preference=preference)
    assert choice.kernel.name == expected
    assert choice.rejected == {}


def test_preference_moves_on_past_disabled_and_unable_kernels():
    choice = choose_kernel(key(), CPU, preference=("torch", "reference"), disabled=("torch",))
    assert choice.kernel.name == "reference"
    assert choice.rejected == {"torch": "disabled by configuration"}
    block_choice = choose_kernel(key(FP8_BLOCK), CPU, preference=("torch", "reference"))
    assert block_choice.kernel.name == "reference"
    assert block_choice.rejected == {"torch": BLOCK_REASON}


@pytest.mark.parametrize("scheme", [FP8_BLOCK, INT8_BLOCK_WEIGHT, INT8_GROUP_ACTIVATION])
def test_block_scales_rejected_by_torch_and_reference_never_auto_chosen(scheme):
    choice = choose_kernel(key(scheme, device_type="cpu"), CPU)
    assert choice.kernel is None
    assert choice.rejected == {"torch": BLOCK_REASON}
    assert "reference" not in choice.explain()


@pytest.mark.parametrize("scheme", [FP8_BLOCK, INT8_BLOCK_WEIGHT, INT8_GROUP_ACTIVATION])
def test_block_scales_go_to_triton_on_a_gpu(scheme):
    choice = choose_kernel(key(scheme, device_type="cuda"), H100)
    assert choice.kernel.name == "triton"
    assert choice.rejected == {"torch": BLOCK_REASON}


@pytest.mark.parametrize(
    "scheme, k, n, factor",
    [
        (INT8_TOKEN_CHANNEL, 196, 256, 8),
        (INT8_TOKEN_CHANNEL, 512, 33, 8),
        (FP8_TENSOR, 136, 256, 16),  # a multiple of 8 is not enough for fp8
        (FP8_TENSOR, 512, 264, 16),
        (INT8_TOKEN_CHANNEL, None, 256, 8),  # symbolic K
        (FP8_TENSOR, 512, None, 16),  # symbolic N
    ],
)
def test_cuda_alignment_reasons(scheme, k, n, factor):
    choice = choose_kernel(key(scheme, n=n, k=k, device_type="cuda"), H100)
    assert choice.kernel.name == "triton"  # masked loads: any K and N
    assert choice.rejected == {"torch": f"cuBLAS needs static K and N that are multiples of {factor} (K={k}, N={n})"}


@pytest.mark.parametrize("scheme, k, n", [(INT8_TOKEN_CHANNEL, 136, 264), (FP8_TENSOR, 144, 272)])
def test_cuda_aligned_sizes_are_accepted(scheme, k, n):
    assert choose_kernel(key(scheme, n=n, k=k, device_type="cuda"), H100).kernel.name == "torch"


def test_rocm_runs_int8_on_triton_and_no_fp8():
    assert choose_kernel(key(device_type="cuda"), MI300).kernel.name == "triton"
    choice = choose_kernel(key(FP8_TENSOR, device_type="cuda"), MI300)
    assert choice.kernel is None
    assert choice.rejected == {"triton": "ROCm fp8 is e4m3fnuz; the Triton kernel takes e4m3fn"}


@pytest.mark.parametrize("platform", [XPU])
def test_platforms_without_a_priority_list_choose_nothing(platform):
    choice = choose_kernel(key(device_type=platform.device_type), platform)
    assert choice.kernel is None and choice.rejected == {}
    assert choice.explain() == "none"


def test_torch_rejected_on_rocm_when_preferred():
    choice = choose_kernel(key(device_type="cuda"), MI300, preference=("torch",))
    assert choice.rejected == {"torch": "torch kernel runs on CPU and NVIDIA CUDA only, not on ROCm GPU (capability 94)"}


@pytest.mark.parametrize(
    "call",
    [
        lambda: get_kernel("cutlass"),
        lambda: choose_kernel(key(), CPU, forced="cutlass"),
        lambda: choose_kernel(key(), CPU, preference=("cutlass",)),
    ],
    ids=["get_kernel", "forced", "preference"],
)
def test_unknown_kernel_name_lists_known_kernels(call):
    with pytest.raises(KeyError, match=r"unknown qfuse kernel 'cutlass'; known kernels: \['reference', 'torch', 'triton'\]"):
        call()


def test_fp8_not_chosen_for_torch_on_a_gpu_without_fp8():
    choice = choose_kernel(key(FP8_TENSOR, device_type="cuda"), A100)
    assert choice.kernel is None
    assert "89" in choice.rejected["torch"] and "89" in choice.rejected["triton"]
