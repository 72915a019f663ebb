"""Tests for the `onednn` kernel (oneDNN qlinear int8 W8A8, fp8 block W8A16).

Covered: every rule of is_supported / can_implement on constructed platforms and keys (machine,
oneDNN build, scheme dtypes and granularities, out dtypes, the W8A16 block shape, weight-only keys
rejected by the torch and Triton kernels); int8 numerics against qfuse's float64 reference on odd
shapes (M = 1 and 33, K and N not multiples of 16) for static per-tensor and dynamic per-token
activation scales, per-channel / per-tensor weight scales, activation zero points (one value and
one per row), bias or none, fp32 / bf16 / fp16 outputs, through the kernel and through
`qfuse::scaled_mm` (weight prepared once); W8A16 numerics through `qfuse::weight_only_scaled_mm`
against float64 (the op itself: tests/ops/test_weight_only_ops.py); and the contract of the call
into vLLM's fp8_scaled_mm_cpu through a stand-in (vLLM is not installed here and this CPU has no
AMX: that path was not run on real vLLM).
"""

import math
import types

import pytest
import torch

import qfuse.ops  # noqa: F401  (registers torch.ops.qfuse)
from qfuse.kernels import (
    GemmKey,
    KernelRequest,
    KernelUnavailableError,
    choose_kernel,
    get_kernel,
    prepared,
    reference_math,
    why_not_implemented,
)
from qfuse.kernels import onednn as onednn_module
from qfuse.kernels.onednn import FP8_W8A8_REASON, OneDnnKernel, OneDnnWeight
from qfuse.platform import Platform, current_platform
from qfuse.schemes import FP8_DTYPE, INT4_DTYPE, Granularity, QuantScheme
from tests.ops.test_weight_only_ops import expected_weight_only, w8a16_operands

G = Granularity
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
VNNI = Platform("cpu", cpu_has_avx512_vnni=True, cpu_is_amd_zen=True)
AMX = Platform("cpu", cpu_has_avx512_vnni=True, cpu_has_amx=True)
AMX_VLLM = Platform("cpu", cpu_has_avx512_vnni=True, cpu_has_amx=True, libraries=frozenset({"vllm"}))
OLD_CPU = Platform("cpu")
H100 = Platform("cuda", cuda_capability=(9, 0), libraries=frozenset({"triton"}))
ONEDNN = get_kernel("onednn")
# numerics: oneDNN's int8 GEMM without VNNI saturates 16-bit sums, and its bf16 reorder needs AVX-512 (the kernel's
# is_supported says so); tests that run the kernel run where it would be chosen
RUNS_ONEDNN_HERE = pytest.mark.skipif(not ONEDNN.is_supported(current_platform("cpu"))[0],
                                      reason=ONEDNN.is_supported(current_platform("cpu"))[1] or "")
W8A16 = QuantScheme.weight_only(FP8_DTYPE, G.BLOCK)
# Relative tolerance of one rounding to each out dtype.
ONE_ROUNDING = {FP32: 1e-5, BF16: 2.0**-7, FP16: 2.0**-10}


def key(scheme, n=45, k=77, out_dtype=BF16, bias_dtype=FP32, device_type="cpu", m=None):
    return GemmKey(scheme, m=m, n=n, k=k, out_dtype=out_dtype, bias_dtype=bias_dtype, device_type=device_type)


def int8_scheme(activation=G.PER_TOKEN, weight=G.PER_CHANNEL, dynamic=True, symmetric=True, dtype=torch.int8):
    return QuantScheme(dtype, torch.int8, activation, weight, dynamic=dynamic, symmetric=symmetric)


# --- is_supported / describe ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "platform, reason",
    [
        (VNNI, ""),
        (AMX, ""),
        (Platform("cpu", cpu_has_amx=True), ""),
        (OLD_CPU, "oneDNN's int8 GEMM needs AMX or AVX-512 VNNI; this CPU has neither"),
        (H100, "onednn runs on x86 CPUs, not on CUDA GPU (capability 90)"),
        (Platform("xpu"), "onednn runs on x86 CPUs, not on XPU"),
    ],
)
def test_is_supported(platform, reason):
    assert ONEDNN.is_supported(platform) == (not reason, reason)


def test_is_supported_needs_a_torch_built_with_onednn(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert ONEDNN.is_supported(AMX) == (False, "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)")


def test_describe_names_amx_or_vnni():
    assert ONEDNN.describe(AMX) == "oneDNN int8 GEMM on AMX"
    assert ONEDNN.describe(VNNI) == "oneDNN int8 GEMM on AVX-512 VNNI"


# --- can_implement: int8 W8A8 ---------------------------------------------------------------------

@pytest.mark.parametrize(
    "scheme",
    [
        int8_scheme(G.PER_TENSOR, G.PER_TENSOR, dynamic=False),
        int8_scheme(G.PER_TENSOR, G.PER_CHANNEL, dynamic=True),
        int8_scheme(G.PER_TOKEN, G.PER_CHANNEL, dynamic=True),
        int8_scheme(G.PER_TOKEN, G.PER_TENSOR, dynamic=True),
        int8_scheme(G.PER_TENSOR, G.PER_CHANNEL, dynamic=False, symmetric=False),
        int8_scheme(G.PER_TOKEN, G.PER_CHANNEL, symmetric=False, dtype=torch.uint8),
    ],
    ids=lambda scheme: scheme.describe(),
)
@pytest.mark.parametrize("out_dtype", [FP32, BF16, FP16])
@pytest.mark.parametrize("k, n", [(77, 45), (4096, 4096), (None, None)])
def test_int8_schemes_are_implemented_at_any_size(scheme, out_dtype, k, n):
    assert why_not_implemented(ONEDNN, key(scheme, n=n, k=k, out_dtype=out_dtype), AMX) == ""


@pytest.mark.parametrize(
    "gemm_key, reason",
    [
        (key(QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TENSOR, G.PER_TENSOR, dynamic=False)), FP8_W8A8_REASON),
        (key(QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_GROUP, G.BLOCK, dynamic=True)), FP8_W8A8_REASON),
        (key(QuantScheme(torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, True, weight_group_size=128)),
         "onednn computes int8 / uint8 x int8, bf16 x fp8 (weight-only) on cpu, not int8 x int4"),
        (key(int8_scheme(G.PER_GROUP)),
         "int8 W8A8 qlinear takes per-tensor / per-token activation scales, not per-group"),
        (key(int8_scheme(weight=G.BLOCK)),
         "int8 W8A8 qlinear takes per-tensor / per-channel weight scales, not block"),
        (key(int8_scheme(), out_dtype=torch.float64), "int8 W8A8 qlinear writes fp32 / bf16 / fp16, not torch.float64"),
        (key(int8_scheme(), device_type="cuda"), "onednn takes cpu tensors, not cuda"),
    ],
)
def test_int8_rejections(gemm_key, reason):
    assert why_not_implemented(ONEDNN, gemm_key, AMX) == reason


# --- can_implement: fp8 W8A16 ---------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype", [BF16, FP32])
@pytest.mark.parametrize("platform", [VNNI, AMX_VLLM])
def test_w8a16_fp8_block_is_implemented(out_dtype, platform):
    assert why_not_implemented(ONEDNN, key(W8A16, n=200, k=300, out_dtype=out_dtype), platform) == ""


@pytest.mark.parametrize(
    "gemm_key, reason",
    [
        (key(QuantScheme.weight_only(torch.int8, G.PER_CHANNEL)),
         "onednn computes int8 / uint8 x int8, bf16 x fp8 (weight-only) on cpu, not bf16 x int8 (weight-only)"),
        (key(QuantScheme.weight_only(FP8_DTYPE, G.PER_CHANNEL)), "fp8 W8A16 takes block weight scales, not per-channel"),
        (key(QuantScheme.weight_only(FP8_DTYPE, G.BLOCK, FP16)),
         "onednn computes int8 / uint8 x int8, bf16 x fp8 (weight-only) on cpu, not fp16 x fp8 (weight-only)"),
        (key(QuantScheme.weight_only(FP8_DTYPE, G.BLOCK, FP32)),
         "onednn computes int8 / uint8 x int8, bf16 x fp8 (weight-only) on cpu, not fp32 x fp8 (weight-only)"),
        (key(W8A16, out_dtype=FP16), "fp8 W8A16 writes bf16 / fp32, not fp16"),
    ],
)
def test_w8a16_rejections(gemm_key, reason):
    assert why_not_implemented(ONEDNN, gemm_key, AMX) == reason


def test_fp8_weight_only_keys_are_rejected_by_the_torch_kernel_and_taken_by_triton_on_gpus():
    choice = choose_kernel(key(W8A16), VNNI, preference=("torch", "onednn"))
    assert choice.kernel is ONEDNN
    assert choice.rejected == {"torch": "torch computes int8 / uint8 x int8, fp8 x fp8, bf16 x int8 (weight-only), "
                                        "bf16 / fp16 / fp32 x int4 (weight-only) on cpu, not bf16 x fp8 (weight-only)"}
    assert why_not_implemented(get_kernel("triton"), key(W8A16, device_type="cuda"), H100) == ""


def test_registry_runs_onednn_when_preferred_and_raises_its_reason_when_forced():
    assert choose_kernel(key(int8_scheme(), n=2048, k=4096), VNNI, preference=("onednn", "torch")).kernel is ONEDNN
    fp8 = QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TENSOR, G.PER_TENSOR, dynamic=False)
    with pytest.raises(KernelUnavailableError, match="fp8 W8A8 is not onednn's"):
        choose_kernel(key(fp8), VNNI, forced="onednn")


@pytest.mark.parametrize("n, k, expected", [(1024, 1024, "torch"), (4096, 1024, "torch"), (2048, 4096, "onednn"),
                                             (4096, 4096, "onednn"), (None, 4096, "onednn")])
def test_small_weights_go_to_inductors_own_gemm(n, k, expected):
    """Below its engine's crossover (`CROSSOVERS`: a weight's elements) the opaque op's per-call cost outweighs
    oneDNN's faster GEMM (measured); an unknown size keeps the platform's order."""
    choice = choose_kernel(key(int8_scheme(), n=n, k=k), VNNI, preference=("onednn", "torch"))
    assert choice.kernel.name == expected
    if expected == "torch":
        assert "per-call cost outweighs its faster GEMM" in choice.rejected["onednn"]


@pytest.mark.parametrize("m, k, n, expected", [
    (64, 2048, 8192, "torch"), (64, 4096, 4096, "torch"), (1, 4096, 4096, "torch"),  # the demo's MLP; decode
    (256, 2048, 8192, "onednn"), (256, 4096, 4096, "onednn"), (256, 8192, 2048, "torch"),
    (None, 4096, 4096, "onednn"),  # a dynamic M: chosen for again per bucket
])
def test_on_amx_onednn_is_taken_only_where_it_was_measured_faster(m, k, n, expected):
    """On AMX `_int_mm` is oneDNN's AMX GEMM in Inductor's own code: the op wins only above 64 rows with N >= 4096
    (`CROSSOVERS`, measured on a 2-core AMX Xeon); the AVX-512 VNNI crossover looks at the weight alone."""
    choice = choose_kernel(key(int8_scheme(), n=n, k=k, m=m), AMX, preference=("onednn", "torch"))
    assert choice.kernel.name == expected
    if expected == "torch":
        assert choice.rejected["onednn"].startswith("on AMX its per-call cost outweighs its faster GEMM")
    assert choose_kernel(key(int8_scheme(), n=n, k=k, m=m), VNNI, preference=("onednn", "torch")).kernel is ONEDNN


def test_a_dynamic_m_on_amx_is_guarded_at_the_crossovers_rows():
    request = KernelRequest(key(int8_scheme(), n=8192, k=2048), preference=("onednn", "torch"))
    assert request.row_bounds(AMX) == (64,) and request.row_bounds(VNNI) == ()
    assert request.choose(AMX, m=64).kernel.name == "torch" and request.choose(AMX, m=65).kernel is ONEDNN


def test_a_small_weight_no_other_kernel_takes_still_runs_on_onednn():
    choice = choose_kernel(key(W8A16), VNNI, preference=("torch", "onednn"))
    assert choice.kernel is ONEDNN and "onednn" not in choice.rejected


# --- int8 numerics ----------------------------------------------------------------------------------

def int8_operands(m, k, n, activation, weight, zero_point, with_bias, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=generator)
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator).t()  # w.t() of a stored [N, K]
    scale_a = {"static-tensor": torch.tensor(0.02), "dynamic-token": torch.rand(m, 1, generator=generator) + 0.5}[activation]
    scale_b = {"per-channel": torch.rand(1, n, generator=generator) * 0.01 + 1e-3, "per-tensor": torch.tensor(3e-3)}[weight]
    azp_a = {"none": None, "one": torch.tensor(-7, dtype=torch.int32),
             "per-row": torch.randint(-128, 128, (m, 1), dtype=torch.int32, generator=generator)}[zero_point]
    bias = torch.randn(n, generator=generator) * 10 if with_bias else None
    return a, b, scale_a, scale_b, azp_a, bias


def assert_matches(out, expected64, out_dtype):
    rel = ONE_ROUNDING[out_dtype]
    assert out.dtype == out_dtype and out.shape == expected64.shape
    magnitude = expected64.abs().max().item() if expected64.numel() else 0.0
    torch.testing.assert_close(out.to(torch.float64), expected64.to(out_dtype).to(torch.float64),
                               rtol=rel, atol=rel * magnitude)


@RUNS_ONEDNN_HERE
@pytest.mark.parametrize("m, k, n", [(0, 77, 45), (1, 77, 45), (33, 200, 130)])  # M = 0: a per-token scale of no rows
@pytest.mark.parametrize("activation", ["static-tensor", "dynamic-token"])
@pytest.mark.parametrize("weight", ["per-channel", "per-tensor"])
@pytest.mark.parametrize("zero_point", ["none", "one", "per-row"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("out_dtype", [FP32, BF16])
def test_int8_apply_matches_reference(m, k, n, activation, weight, zero_point, with_bias, out_dtype):
    a, b, scale_a, scale_b, azp_a, bias = int8_operands(m, k, n, activation, weight, zero_point, with_bias)
    out = ONEDNN.apply(a, ONEDNN.prepare_weight(b, scale_b, None), scale_a, bias, azp_a, out_dtype)
    expected = reference_math.scaled_mm(a, b, scale_a, scale_b, bias, azp_a, None, torch.float64)
    assert_matches(out, expected, out_dtype)


@RUNS_ONEDNN_HERE
@pytest.mark.parametrize("zero_point", ["none", "per-row"])
def test_int8_fp16_output_and_no_weight_scale(zero_point):
    a, b, scale_a, _, azp_a, bias = int8_operands(33, 200, 130, "dynamic-token", "per-tensor", zero_point, True)
    out = ONEDNN.apply(a, ONEDNN.prepare_weight(b, None, None), scale_a * 1e-3, bias, azp_a, FP16)
    assert_matches(out, reference_math.scaled_mm(a, b, scale_a * 1e-3, None, bias, azp_a, None, torch.float64), FP16)


@RUNS_ONEDNN_HERE
def test_scaled_mm_op_runs_onednn_and_prepares_the_weight_once(monkeypatch):
    calls = []
    prepare = OneDnnKernel.prepare_weight
    monkeypatch.setattr(OneDnnKernel, "prepare_weight", lambda self, *args: calls.append(1) or prepare(self, *args))
    a, b, scale_a, scale_b, azp_a, bias = int8_operands(6, 77, 45, "dynamic-token", "per-channel", "per-row", True)
    a3d = a.reshape(2, 3, 77)
    before = prepared.cached_weight_count()
    for _ in range(2):
        out = torch.ops.qfuse.scaled_mm(a3d, b, scale_a.reshape(2, 3, 1), scale_b.reshape(45), bias,
                                        azp_a.reshape(2, 3, 1), None, BF16, "onednn")
    assert len(calls) == 1 and prepared.cached_weight_count() == before + 1
    expected = reference_math.scaled_mm(a, b, scale_a, scale_b, bias, azp_a, None, torch.float64)
    assert_matches(out, expected.reshape(2, 3, 45), BF16)


@RUNS_ONEDNN_HERE
def test_quant_scaled_mm_op_quantizes_then_runs_onednn():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(33, 77, generator=generator, dtype=BF16)
    b = torch.randint(-128, 128, (45, 77), dtype=torch.int8, generator=generator).t()
    scale_b = torch.rand(45, generator=generator) * 0.01
    args = (x, b, None, scale_b, None, torch.int8, 1e-6, FP32)
    out = torch.ops.qfuse.quant_scaled_mm(*args, "onednn")
    torch.testing.assert_close(out, torch.ops.qfuse.quant_scaled_mm(*args, "reference"), rtol=1e-5, atol=1e-4)


@RUNS_ONEDNN_HERE
@pytest.mark.parametrize("zero_point", [0, 3], ids=["all_zero", "nonzero"])
def test_weight_zero_points_are_exact(zero_point):
    """PT2E stores symmetric weights' zero points as tensors of zeros: oneDNN's packed path takes
    them; other zero points run the torch kernel's zero-point algebra (qlinear would ignore them)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (5, 40), dtype=torch.int8, generator=generator)
    b = torch.randint(-128, 128, (40, 24), dtype=torch.int8, generator=generator)
    scale_a, scale_b = torch.rand(5, 1) + 0.1, (torch.rand(24) + 0.1).reshape(1, 24)
    azp_b = torch.full((1, 24), zero_point, dtype=torch.int64)
    weight = ONEDNN.prepare_weight(b, scale_b, azp_b)
    assert isinstance(weight, OneDnnWeight) == (zero_point == 0)
    out = ONEDNN.apply(a, weight, scale_a, None, None, FP32)
    expected = (a.double() * scale_a.double()) @ ((b.double() - zero_point) * scale_b.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-3)


@RUNS_ONEDNN_HERE
def test_int8_errors_name_the_problem():
    b = torch.randint(-128, 128, (8, 4), dtype=torch.int8)
    with pytest.raises(ValueError, match=r"qlinear takes one weight scale or one per channel \(4\), got \(2, 1\)"):
        ONEDNN.prepare_weight(b, torch.ones(2, 1), None)  # a 128x128 block scale
    with pytest.raises(ValueError, match="onednn takes int8 \\(W8A8\\) or fp8 \\(W8A16\\) weights, got torch.uint8"):
        ONEDNN.prepare_weight(b.to(torch.uint8), None, None)
    fp8_weight = ONEDNN.prepare_weight(b.to(FP8_DTYPE), None, None)
    with pytest.raises(ValueError, match="fp8 W8A8 is not onednn's"):
        ONEDNN.apply(torch.ones(2, 8).to(FP8_DTYPE), fp8_weight, None, None, None, FP32)


# --- fp8 W8A16 ----------------------------------------------------------------------------------------

def assert_w8a16_close(out, expected64, out_dtype):
    # The weight is dequantized to bf16 once and the GEMM writes bf16: two bf16 roundings.
    assert out.dtype == out_dtype and out.shape == expected64.shape
    magnitude = expected64.abs().max().item() if expected64.numel() else 0.0
    torch.testing.assert_close(out.to(torch.float64), expected64, rtol=2.0**-7, atol=2.0**-7 * magnitude)


@RUNS_ONEDNN_HERE
@pytest.mark.parametrize("m, k, n", [(1, 300, 200), (33, 256, 130), (5, 77, 45), (2, 100, 200)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("out_dtype", [BF16, FP32])
def test_w8a16_matches_float64(m, k, n, with_bias, out_dtype):
    x, b, scale_b, bias = w8a16_operands(m, k, n, with_bias)
    out = torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, bias, None, out_dtype, "onednn")
    assert_w8a16_close(out, expected_weight_only(x, b, scale_b, bias), out_dtype)


@RUNS_ONEDNN_HERE
def test_w8a16_weight_is_prepared_once_as_packed_bf16():
    x, b, scale_b, bias = w8a16_operands(4, 256, 64, True)
    before = prepared.cached_weight_count()
    first = torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, bias, None, BF16, "onednn")
    second = torch.ops.qfuse.weight_only_scaled_mm(x, b, scale_b, bias, None, BF16, "onednn")
    assert prepared.cached_weight_count() == before + 1
    assert torch.equal(first, second)
    weight = ONEDNN.prepare_weight(b, scale_b, None)
    assert weight.packed.dtype == BF16 and weight.packed.is_mkldnn and (weight.k, weight.n) == (256, 64)
    with pytest.raises(ValueError, match="W8A16 takes .* activations, got torch.float32"):
        ONEDNN.weight_only_apply(x.float(), weight, bias, BF16)
    int8_weight = ONEDNN.prepare_weight(torch.ones(256, 64, dtype=torch.int8), None, None)
    with pytest.raises(ValueError, match="this one was prepared for int8 W8A8"):
        ONEDNN.weight_only_apply(x, int8_weight, bias, BF16)


# --- vLLM's fp8_scaled_mm_cpu, through a stand-in ----------------------------------------------------

def vllm_stand_in(received):
    """torch.ops._C.convert_weight_packed / fp8_scaled_mm_cpu with the checks of vLLM's (sgl-kernel's) C++."""

    def convert_weight_packed(weight):
        assert weight.dtype == FP8_DTYPE and weight.is_contiguous()
        received["packed_shape"] = tuple(weight.shape)
        return weight.clone()  # the real op re-lays it for AMX; this one keeps [N, K]

    def fp8_scaled_mm_cpu(mat1, mat2, scales2, block_size, bias, out_dtype, is_vnni):
        n, k = mat2.shape
        assert mat1.dtype in (BF16, FP16) and out_dtype == mat1.dtype and mat1.stride(-1) == 1
        assert is_vnni and block_size == [128, 128] and scales2.dtype == FP32
        assert tuple(scales2.shape) == (math.ceil(n / 128), math.ceil(k / 128))
        assert bias is None or bias.dtype == FP32
        received.update(block_size=block_size, bias_dtype=None if bias is None else bias.dtype)
        weight = mat2.to(torch.float64) * scales2.to(torch.float64)[torch.arange(n) // 128][:, torch.arange(k) // 128]
        out = mat1.to(torch.float64) @ weight.t()
        return (out if bias is None else out + bias.to(torch.float64)).to(out_dtype)

    return types.SimpleNamespace(convert_weight_packed=convert_weight_packed, fp8_scaled_mm_cpu=fp8_scaled_mm_cpu)


@pytest.fixture
def vllm_received(monkeypatch):
    received = {}
    monkeypatch.setattr(onednn_module, "vllm_cpu_ops", lambda: vllm_stand_in(received))
    monkeypatch.setattr(onednn_module, "current_platform", lambda device_type: AMX_VLLM)
    return received


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("out_dtype", [BF16, FP32])
def test_vllm_fp8_scaled_mm_contract(vllm_received, with_bias, out_dtype):
    x, b, scale_b, bias = w8a16_operands(5, 300, 160, with_bias)
    weight = ONEDNN.prepare_weight(b, scale_b, None)
    assert weight.data.dtype == FP8_DTYPE and vllm_received["packed_shape"] == (160, 300)
    out = ONEDNN.weight_only_apply(x, weight, bias, out_dtype)
    assert vllm_received["block_size"] == [128, 128]
    assert vllm_received["bias_dtype"] == (FP32 if with_bias else None)
    expected = expected_weight_only(x, b, scale_b, bias)
    assert out.dtype == out_dtype  # vLLM writes bf16: an fp32 output is that, widened
    assert_matches(out.to(BF16), expected, BF16)


@RUNS_ONEDNN_HERE
@pytest.mark.parametrize(
    "platform, k, n",
    [(AMX, 300, 160), (Platform("cpu", cpu_has_avx512_vnni=True, libraries=frozenset({"vllm"})), 300, 160),
     (AMX_VLLM, 300, 120), (AMX_VLLM, 301, 160)],
    ids=["no-vllm", "no-amx", "n-not-multiple-of-16", "odd-k"],
)
def test_vllm_path_needs_vllm_amx_and_its_packing_sizes(monkeypatch, vllm_received, platform, k, n):
    monkeypatch.setattr(onednn_module, "current_platform", lambda device_type: platform)
    _, b, scale_b, _ = w8a16_operands(1, k, n, False)
    assert ONEDNN.prepare_weight(b, scale_b, None).packed.dtype == BF16  # oneDNN's bf16 path
    assert vllm_received == {}
