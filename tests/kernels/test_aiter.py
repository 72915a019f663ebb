"""Tests for the `aiter` kernel (AMD AITER's a8w8 GEMM). No ROCm GPU or aiter package exists here.

Covered: every rule of is_supported (machine, package, QFUSE_AITER_LINEAR, arch) and can_implement
(dtypes, symmetry, scale pairs, K/N alignment, output and bias dtypes, weight-only keys) on
constructed platforms; the e4m3fn -> e4m3fnuz re-encoding on all 256 bit patterns against float64;
prepare_weight's layouts per arch; and the contract of the call into AITER: a stand-in op with the
signature of aiter.gemm_a8w8_CK is registered here, qfuse's ops run the kernel on CPU through it,
and the test checks what AITER would receive (layouts, dtypes, doubled scales) and the result
against qfuse's float64 reference.
"""


import pytest
import torch

import qfuse.ops  # noqa: F401  (registers torch.ops.qfuse)
from qfuse.kernels import GemmKey, choose_kernel, get_kernel, reference_math, why_not_implemented
from qfuse.kernels import aiter as aiter_module
from qfuse.platform import Platform
from qfuse.schemes import FP8_DTYPE, INT4_DTYPE, Granularity, QuantScheme

G = Granularity
FNUZ = torch.float8_e4m3fnuz
BF16, FP16 = torch.bfloat16, torch.float16
MI300 = Platform("cuda", is_rocm=True, cuda_capability=(9, 4), gpu_arch="gfx942", libraries=frozenset({"triton", "aiter"}))
MI355 = Platform("cuda", is_rocm=True, cuda_capability=(9, 5), gpu_arch="gfx950", libraries=frozenset({"aiter"}))
MI300_NO_AITER = Platform("cuda", is_rocm=True, cuda_capability=(9, 4), gpu_arch="gfx942", libraries=frozenset({"triton"}))
MI250 = Platform("cuda", is_rocm=True, cuda_capability=(9, 0), gpu_arch="gfx90a", libraries=frozenset({"aiter"}))
ROCM_UNKNOWN_ARCH = Platform("cuda", is_rocm=True, cuda_capability=(9, 4), libraries=frozenset({"aiter"}))
H100 = Platform("cuda", cuda_capability=(9, 0), libraries=frozenset({"triton", "aiter"}))
CPU = Platform("cpu", libraries=frozenset({"aiter"}))

INT8_TOKEN_CHANNEL = QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True)
INT8_TENSOR = QuantScheme(torch.int8, torch.int8, G.PER_TENSOR, G.PER_TENSOR, dynamic=False)
FP8_TOKEN_CHANNEL = QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True)
FP8_TENSOR = QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TENSOR, G.PER_TENSOR, dynamic=False)
AITER = get_kernel("aiter")
PAIRS = "gemm_a8w8_CK takes per-tensor x per-tensor or per-token x per-channel scales, not "


def key(scheme=FP8_TOKEN_CHANNEL, n=4096, k=1024, out_dtype=BF16, bias_dtype=BF16):
    return GemmKey(scheme, n=n, k=k, out_dtype=out_dtype, bias_dtype=bias_dtype, device_type="cuda")


@pytest.fixture(autouse=True)
def linear_switch_unset(monkeypatch):
    monkeypatch.delenv(aiter_module.LINEAR_SWITCH, raising=False)


# --- is_supported -------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "platform, reason",
    [
        (MI300, ""),
        (MI355, ""),
        (H100, "AITER runs on ROCm GPUs only, not on CUDA GPU (capability 90)"),
        (CPU, "AITER runs on ROCm GPUs only, not on CPU"),
        (MI300_NO_AITER, "the aiter package is not installed (github.com/ROCm/aiter)"),
        (MI250, "AITER's a8w8 GEMM is enabled for MI300 / MI355 (gfx940, gfx941, gfx942, gfx950), not for gfx90a"),
        (ROCM_UNKNOWN_ARCH, "AITER's a8w8 GEMM is enabled for MI300 / MI355 (gfx940, gfx941, gfx942, gfx950), "
                            "not for a GPU of unknown arch"),
    ],
)
def test_is_supported(platform, reason):
    assert AITER.is_supported(platform) == (not reason, reason)


@pytest.mark.parametrize("value", ["1", "true", "Yes", " on ", ""])
def test_linear_switch_on(monkeypatch, value):
    monkeypatch.setenv("QFUSE_AITER_LINEAR", value)
    assert AITER.is_supported(MI300) == (True, "")


@pytest.mark.parametrize("value", ["0", "false", "NO", "off"])
def test_linear_switch_off(monkeypatch, value):
    monkeypatch.setenv("QFUSE_AITER_LINEAR", value)
    assert AITER.is_supported(MI300) == (False, f"AITER linear is switched off (QFUSE_AITER_LINEAR={value})")


def test_linear_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("QFUSE_AITER_LINEAR", "maybe")
    with pytest.raises(ValueError, match=r"QFUSE_AITER_LINEAR='maybe' is neither on .* nor off"):
        AITER.is_supported(MI300)


# --- can_implement --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "gemm, reason",
    [
        (key(), ""),
        (key(FP8_TENSOR), ""),
        (key(INT8_TOKEN_CHANNEL), ""),
        (key(INT8_TENSOR, out_dtype=FP16, bias_dtype=FP16), ""),
        (key(bias_dtype=None), ""),
        (key(QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TOKEN, G.PER_TENSOR, True)), PAIRS + "per-token x per-tensor"),
        (key(QuantScheme(torch.int8, torch.int8, G.PER_TENSOR, G.PER_CHANNEL, False)),
         PAIRS + "per-tensor x per-channel"),
        (key(QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_GROUP, G.BLOCK, True)), "gemm_a8w8_CK takes per-tensor / per-token activation scales, not per-group"),
        (key(QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TOKEN, G.BLOCK, True)), "gemm_a8w8_CK takes per-tensor / per-channel weight scales, not block"),
        (key(QuantScheme(torch.uint8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, True, symmetric=False)),
         "aiter computes int8 / fp8 x int8 / fp8 on cuda, not uint8 x int8"),
        (key(QuantScheme(torch.int8, torch.int8, G.PER_TENSOR, G.PER_TENSOR, False, symmetric=False)),
         "gemm_a8w8_CK takes no activation zero point (asymmetric activations)"),
        (key(QuantScheme(torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, True, weight_group_size=128)),
         "aiter computes int8 / fp8 x int8 / fp8 on cuda, not int8 x int4"),
        (key(k=1032), "gemm_a8w8_CK needs static K and N that are multiples of 16 (K=1032, N=4096)"),
        (key(n=4104), "gemm_a8w8_CK needs static K and N that are multiples of 16 (K=1024, N=4104)"),
        (key(k=None), "gemm_a8w8_CK needs static K and N that are multiples of 16 (K=None, N=4096)"),
        (key(n=None), "gemm_a8w8_CK needs static K and N that are multiples of 16 (K=1024, N=None)"),
        (key(out_dtype=torch.float32, bias_dtype=None), "gemm_a8w8_CK writes bf16 / fp16, not fp32"),
        (key(bias_dtype=torch.float32),
         "gemm_a8w8_CK adds a bias of the output dtype only (bias fp32, output bf16)"),
    ],
)
def test_capability_rows(gemm, reason):
    assert why_not_implemented(AITER, gemm, MI300) == reason


def test_weight_only_keys_are_rejected():
    weight_only = QuantScheme.weight_only(FP8_DTYPE, G.PER_CHANNEL)
    assert why_not_implemented(AITER, key(weight_only), MI300) == (
        "aiter computes int8 / fp8 x int8 / fp8 on cuda, not bf16 x fp8 (weight-only)")


@pytest.mark.parametrize("platform", [MI300, MI355])
def test_forced_aiter_is_chosen_on_mi300_and_mi355(platform):
    assert choose_kernel(key(), platform, forced="aiter").kernel is AITER


# --- e4m3fn -> e4m3fnuz ------------------------------------------------------------------------------

def test_e4m3fn_to_e4m3fnuz_on_all_256_bit_patterns():
    bits = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    e4m3fn = bits.view(FP8_DTYPE)
    e4m3fnuz = aiter_module.e4m3fn_to_e4m3fnuz(e4m3fn)
    assert e4m3fnuz.dtype == FNUZ and e4m3fnuz.shape == (256,)
    new_bits = e4m3fnuz.view(torch.uint8)
    before, after = e4m3fn.to(torch.float64), e4m3fnuz.to(torch.float64)
    scale = torch.tensor(0.0123, dtype=torch.float64)
    for pattern in range(256):
        if pattern == 0x80:  # -0.0 in e4m3fn, NaN in e4m3fnuz: becomes +0.0
            assert new_bits[pattern] == 0x00 and after[pattern] == 0
        elif pattern in (0x7F, 0xFF):  # e4m3fn NaN (would read +-240 in e4m3fnuz): stays NaN
            assert torch.isnan(before[pattern]) and new_bits[pattern] == 0x80 and torch.isnan(after[pattern])
        else:  # same bits, half the value: value * (2 * scale) is unchanged, exactly
            assert new_bits[pattern] == pattern
            assert after[pattern] * 2 == before[pattern]
            assert after[pattern] * (2 * scale) == before[pattern] * scale
    assert torch.isnan(after).sum() == 2  # only the two e4m3fn NaNs


def test_e4m3fn_to_e4m3fnuz_keeps_shape_handles_views_and_rejects_other_dtypes():
    x = torch.randn(6, 16).to(FP8_DTYPE)
    converted = aiter_module.e4m3fn_to_e4m3fnuz(x.t())
    assert converted.shape == (16, 6)
    torch.testing.assert_close(converted.to(torch.float64) * 2, x.t().to(torch.float64), rtol=0, atol=0)
    with pytest.raises(ValueError, match="takes float8_e4m3fn, got torch.int8"):
        aiter_module.e4m3fn_to_e4m3fnuz(torch.zeros(2, dtype=torch.int8))


# --- prepare_weight -------------------------------------------------------------------------------------

@pytest.fixture
def arch(monkeypatch):
    """Pretend the GPU holding the tensors is the given arch (the tensors are on CPU here)."""
    def use(gpu_arch):
        monkeypatch.setattr(aiter_module, "gpu_arch", lambda device: gpu_arch)
    return use


def test_prepare_weight_fp8_on_mi300_is_fnuz_with_doubled_scale(arch):
    arch("gfx942")
    weight_nk = torch.randn(32, 48).to(FP8_DTYPE)  # stored [N, K]
    scale = torch.rand(32, dtype=torch.float32) + 0.5
    prepared = AITER.prepare_weight(weight_nk.t(), scale.reshape(1, 32), None)
    assert prepared.data.dtype == FNUZ and prepared.data.shape == (32, 48) and prepared.data.is_contiguous()
    assert (prepared.k, prepared.n) == (48, 32) and prepared.zero_point is None
    torch.testing.assert_close(prepared.scale, 2 * scale.reshape(1, 32), rtol=0, atol=0)
    dequantized = prepared.data.to(torch.float64) * prepared.scale.to(torch.float64).t()
    torch.testing.assert_close(dequantized, weight_nk.to(torch.float64) * scale.to(torch.float64)[:, None], rtol=0, atol=0)


def test_prepare_weight_fp8_on_mi355_stays_e4m3fn(arch):
    arch("gfx950")
    weight_nk = torch.randn(16, 32).to(FP8_DTYPE)
    prepared = AITER.prepare_weight(weight_nk.t(), torch.tensor(0.25), None)
    assert prepared.data.dtype == FP8_DTYPE
    assert torch.equal(prepared.data.view(torch.uint8), weight_nk.view(torch.uint8))
    torch.testing.assert_close(prepared.scale, torch.full((1, 16), 0.25), rtol=0, atol=0)  # per-tensor -> [1, N]


def test_prepare_weight_int8_keeps_values_and_never_asks_the_arch(arch):
    arch("not consulted for int8")
    weight_nk = torch.randint(-128, 128, (16, 32), dtype=torch.int8)
    prepared = AITER.prepare_weight(weight_nk.t(), None, None)
    assert prepared.data.dtype == torch.int8 and torch.equal(prepared.data, weight_nk)
    torch.testing.assert_close(prepared.scale, torch.ones(1, 16), rtol=0, atol=0)


def test_prepare_weight_rejects_zero_points_unknown_archs_and_block_scales(arch):
    int8_weight = torch.zeros(32, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="symmetric; the weight has a zero point"):
        AITER.prepare_weight(int8_weight, None, torch.tensor(3))
    with pytest.raises(ValueError, match=r"per-tensor or per-channel weight scale; got shape \(2, 16\)"):
        AITER.prepare_weight(int8_weight, torch.ones(2, 16), None)
    arch("gfx90a")
    with pytest.raises(ValueError, match=r"no fp8 encoding for GPU arch 'gfx90a'"):
        AITER.prepare_weight(torch.randn(32, 16).to(FP8_DTYPE), None, None)


# --- the call into AITER, against a stand-in -----------------------------------------------------------

CALLS = []


@torch.library.custom_op("qfuse_test_aiter::gemm_a8w8_CK", mutates_args=())
def standin_gemm_a8w8_ck(
    XQ: torch.Tensor,
    WQ: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    splitK: int | None = None,
) -> torch.Tensor:
    """aiter.gemm_a8w8_CK's signature, and the math of AITER's own torch reference for it
    (op_tests/test_gemm_a8w8.py): (XQ @ WQ^T) * (x_scale @ w_scale) + bias, in float64 here."""
    CALLS.append({"XQ": XQ.clone(), "WQ": WQ, "x_scale": x_scale.clone(), "w_scale": w_scale.clone(),
                  "bias": bias, "dtype": dtype, "contiguous": (XQ.is_contiguous(), WQ.is_contiguous())})
    out = (XQ.to(torch.float64) @ WQ.to(torch.float64).t()) * (x_scale.to(torch.float64) @ w_scale.to(torch.float64))
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(dtype)


@pytest.fixture
def standin(monkeypatch):
    CALLS.clear()
    monkeypatch.setattr(aiter_module, "aiter_gemm_a8w8", lambda: torch.ops.qfuse_test_aiter.gemm_a8w8_CK)
    yield CALLS
    CALLS.clear()


def fp8_operands(m=5, k=64, n=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=generator) * 40).to(FP8_DTYPE)
    a[0, :3] = torch.tensor([-0.0, 448.0, -448.0]).to(FP8_DTYPE)  # -0.0 is 0x80: NaN in e4m3fnuz
    weight_nk = (torch.randn(n, k, generator=generator) * 40).to(FP8_DTYPE)
    scale_a = torch.rand(m, 1, generator=generator) + 0.1
    scale_b = torch.rand(n, generator=generator) * 0.01 + 0.001
    bias = torch.randn(n, generator=generator).to(BF16)
    return a, weight_nk, scale_a, scale_b, bias


def test_fp8_per_token_per_channel_on_mi300_calls_aiter_with_fnuz_and_doubled_scales(arch, standin):
    arch("gfx942")
    a, weight_nk, scale_a, scale_b, bias = fp8_operands()
    out = torch.ops.qfuse.scaled_mm(a, weight_nk.t(), scale_a, scale_b, bias, None, None, BF16, "aiter")
    (call,) = standin
    assert call["XQ"].dtype == FNUZ and call["XQ"].shape == (5, 64)
    assert call["WQ"].dtype == FNUZ and call["WQ"].shape == (32, 64)  # [N, K]
    assert call["contiguous"] == (True, True)
    assert call["XQ"].view(torch.uint8)[0, 0] == 0x00  # -0.0 became +0.0, not the e4m3fnuz NaN
    torch.testing.assert_close(call["XQ"].to(torch.float64) * 2, a.to(torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(call["x_scale"], 2 * scale_a, rtol=0, atol=0)
    torch.testing.assert_close(call["w_scale"], 2 * scale_b.reshape(1, 32), rtol=0, atol=0)
    assert call["x_scale"].dtype == call["w_scale"].dtype == torch.float32
    assert call["bias"] is bias and call["dtype"] == BF16
    expected = reference_math.scaled_mm(a, weight_nk.t(), scale_a, scale_b.reshape(1, 32), bias, None, None, BF16)
    assert out.dtype == BF16 and out.shape == (5, 32)
    torch.testing.assert_close(out, expected)


def test_fp8_on_mi355_passes_e4m3fn_and_scales_unchanged(arch, standin):
    arch("gfx950")
    a, weight_nk, scale_a, scale_b, _ = fp8_operands(seed=1)
    out = torch.ops.qfuse.scaled_mm(a, weight_nk.t(), scale_a, scale_b, None, None, None, FP16, "aiter")
    (call,) = standin
    assert call["XQ"].dtype == call["WQ"].dtype == FP8_DTYPE
    torch.testing.assert_close(call["x_scale"], scale_a, rtol=0, atol=0)
    torch.testing.assert_close(call["w_scale"], scale_b.reshape(1, 32), rtol=0, atol=0)
    assert call["bias"] is None and call["dtype"] == FP16
    expected = reference_math.scaled_mm(a, weight_nk.t(), scale_a, scale_b.reshape(1, 32), None, None, None, FP16)
    torch.testing.assert_close(out, expected)


def test_int8_per_tensor_scales_are_expanded_to_rows_and_columns(arch, standin):
    arch("gfx942")
    a = torch.randint(-128, 128, (2, 3, 48), dtype=torch.int8)
    weight_nk = torch.randint(-128, 128, (16, 48), dtype=torch.int8)
    scale_a, scale_b, bias = torch.tensor(0.02), torch.tensor([0.003]), torch.randn(16).to(FP16)
    out = torch.ops.qfuse.scaled_mm(a, weight_nk.t(), scale_a, scale_b, bias, None, None, FP16, "aiter")
    (call,) = standin
    assert call["XQ"].dtype == call["WQ"].dtype == torch.int8 and call["XQ"].shape == (6, 48)
    assert torch.equal(call["WQ"], weight_nk)
    torch.testing.assert_close(call["x_scale"], torch.full((6, 1), 0.02), rtol=0, atol=0)
    torch.testing.assert_close(call["w_scale"], torch.full((1, 16), 0.003), rtol=0, atol=0)
    expected = reference_math.scaled_mm(a.reshape(6, 48), weight_nk.t(), scale_a, scale_b, bias, None, None, FP16)
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out.reshape(6, 16), expected)


def test_dynamic_fp8_quant_scaled_mm_matches_the_reference_kernel(arch, standin):
    arch("gfx942")
    x = torch.randn(7, 64, dtype=BF16)
    weight_nk = (torch.randn(32, 64) * 40).to(FP8_DTYPE)
    scale_b, bias = torch.rand(32) * 0.01 + 0.001, torch.randn(32).to(BF16)
    args = (x, weight_nk.t(), None, scale_b, bias, FP8_DTYPE, 1e-10, BF16)
    out = torch.ops.qfuse.quant_scaled_mm(*args, "aiter")
    (call,) = standin
    assert call["XQ"].dtype == FNUZ and call["x_scale"].shape == (7, 1)
    torch.testing.assert_close(out, torch.ops.qfuse.quant_scaled_mm(*args, "reference"))


def test_the_weight_is_prepared_once_per_weight(arch, standin):
    arch("gfx942")
    a, weight_nk, scale_a, scale_b, bias = fp8_operands(seed=2)
    for _ in range(2):
        torch.ops.qfuse.scaled_mm(a, weight_nk.t(), scale_a, scale_b, bias, None, None, BF16, "aiter")
    first, second = standin
    assert first["WQ"] is second["WQ"]  # the e4m3fnuz copy is made on the first call only


@pytest.mark.parametrize(
    "change, message",
    [
        ({"bias": torch.zeros(32, dtype=torch.float32)}, "takes a bias of the output dtype torch.bfloat16, got torch.float32"),
        ({"azp_a": torch.tensor(1)}, "symmetric; the activation has a zero point"),
        ({"out_dtype": torch.float32}, "writes bfloat16 or float16, not torch.float32"),
        ({"scale_a": torch.ones(5, 2)}, r"per-tensor or per-token activation scale; got shape \(5, 2\)"),
    ],
)
def test_apply_rejects_what_aiter_cannot_compute(arch, standin, change, message):
    arch("gfx950")
    a, weight_nk, scale_a, scale_b, bias = fp8_operands()
    weight = AITER.prepare_weight(weight_nk.t(), scale_b.reshape(1, 32), None)
    arguments = {"scale_a": scale_a, "bias": bias, "azp_a": None, "out_dtype": BF16} | change
    with pytest.raises(ValueError, match=message):
        AITER.apply(a, weight, arguments["scale_a"], arguments["bias"], arguments["azp_a"], arguments["out_dtype"])
    assert standin == []
