"""Tests for the `xpu` kernel (W4A8 through oneDNN's int4_gemm_w4a8) and the `qfuse::w4a8_scaled_mm`
op. No Intel GPU or vllm-xpu-kernels exists here.

Covered: every rule of is_supported / can_implement on constructed platforms and keys (and the
one-time float16-output warning for bfloat16); int4 packing against a bit-by-bit Python model,
exact round trips and the error cases; prepare_weight's layouts; and the contract of the call into
oneDNN: a stand-in op with the schema of _xpu_C::int4_gemm_w4a8 (oneDNN's semantics, written here)
receives the call through qfuse::w4a8_scaled_mm, and the test checks the layouts, dtypes and zero
points it gets and the result against the reference kernel. The op's own tests (reference path vs
float64, opcheck, errors) are in tests/ops/test_w4a8_ops.py.
"""

import warnings

import pytest
import torch

import qfuse.ops  # noqa: F401  (registers torch.ops.qfuse)
from qfuse.kernels import GemmKey, choose_kernel, get_kernel, reference_math, why_not_implemented
from qfuse.kernels import xpu as xpu_module
from qfuse.kernels.int4_words import pack_int4, unpack_int4
from qfuse.platform import Platform
from qfuse.schemes import FP8_DTYPE, INT4_DTYPE, Granularity, QuantScheme

G = Granularity
BF16, FP16 = torch.bfloat16, torch.float16
XPU = Platform("xpu", libraries=frozenset({"vllm_xpu_kernels"}))
XPU_WITHOUT_KERNELS = Platform("xpu", libraries=frozenset({"vllm"}))
CPU = Platform("cpu", cpu_has_avx512_vnni=True, libraries=frozenset({"vllm_xpu_kernels"}))
H100 = Platform("cuda", cuda_capability=(9, 0), libraries=frozenset({"triton"}))
XPU_KERNEL = get_kernel("xpu")


def w4a8(group_size=128, **changes):
    fields = {"activation_dtype": torch.int8, "weight_dtype": INT4_DTYPE, "activation_granularity": G.PER_TOKEN,
              "weight_granularity": G.PER_GROUP, "dynamic": True, "symmetric": True, "weight_group_size": group_size}
    if group_size is None:
        fields["weight_granularity"] = G.PER_CHANNEL
    return QuantScheme(**(fields | changes))


def key(scheme=None, n=4096, k=4096, out_dtype=FP16, device_type="xpu"):
    scheme = w4a8() if scheme is None else scheme
    return GemmKey(scheme, n=n, k=k, out_dtype=out_dtype, bias_dtype=out_dtype, device_type=device_type)


@pytest.fixture(autouse=True)
def fresh_warning():
    xpu_module.warn_float16_output_once.cache_clear()
    yield
    xpu_module.warn_float16_output_once.cache_clear()


# --- is_supported / can_implement ------------------------------------------------------------------

@pytest.mark.parametrize(
    "platform, reason",
    [
        (XPU, ""),
        (XPU_WITHOUT_KERNELS, "vllm-xpu-kernels is not installed (it provides the oneDNN op _xpu_C::int4_gemm_w4a8)"),
        (CPU, "the xpu kernel runs on Intel GPUs (XPU) only, not on CPU (AVX-512 VNNI)"),
        (H100, "the xpu kernel runs on Intel GPUs (XPU) only, not on CUDA GPU (capability 90)"),
    ],
)
def test_is_supported(platform, reason):
    assert XPU_KERNEL.is_supported(platform) == (not reason, reason)


ROW = "W4A8 int4_gemm_w4a8"


@pytest.mark.parametrize(
    "gemm, reason",
    [
        (key(), ""),
        (key(w4a8(32)), ""),
        (key(w4a8(64), k=64, n=8), ""),
        (key(w4a8(None)), ""),
        (key(w4a8(None), k=8, n=8), ""),
        (key(QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, True)),
         "xpu computes int8 x int4 on xpu, not int8 x int8"),
        (key(QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, True)),
         "xpu computes int8 x int4 on xpu, not fp8 x fp8"),
        (key(w4a8(activation_dtype=torch.uint8, symmetric=False)),
         "xpu computes int8 x int4 on xpu, not uint8 x int4"),
        (key(w4a8(symmetric=False)), f"{ROW} takes no activation zero point (asymmetric activations)"),
        (key(w4a8(dynamic=False)), ""),  # the op takes the graph's scale, computed or stored
        (key(w4a8(activation_granularity=G.PER_TENSOR)), ""),  # one scale, expanded to every token
        (key(w4a8(activation_granularity=G.PER_GROUP)),
         f"{ROW} takes per-tensor / per-token activation scales, not per-group"),
        (key(w4a8(None, weight_granularity=G.PER_TENSOR)),
         "W4A8 int4_gemm_w4a8 takes per-channel / per-group weight scales, not per-tensor"),
        (key(w4a8(None, weight_granularity=G.BLOCK)), "W4A8 int4_gemm_w4a8 takes per-channel / per-group weight scales, not block"),
        (key(w4a8(48)), "W4A8 int4_gemm_w4a8 needs a weight group size that is a multiple of 32, got 48"),
        (key(w4a8(16)), "W4A8 int4_gemm_w4a8 needs a weight group size that is a multiple of 32, got 16"),
        (key(w4a8(96), k=4096), "W4A8 int4_gemm_w4a8 needs a weight group size that divides K (group 96, K=4096)"),
        (key(k=4100), "W4A8 int4_gemm_w4a8 needs a weight group size that divides K (group 128, K=4100)"),
        (key(w4a8(None), k=4100), "W4A8 int4_gemm_w4a8 needs static K and N that are multiples of 8 (K=4100, N=4096)"),
        (key(n=4100), "W4A8 int4_gemm_w4a8 needs static K and N that are multiples of 8 (K=4096, N=4100)"),
        (key(k=None), "W4A8 int4_gemm_w4a8 needs static K and N that are multiples of 8 (K=None, N=4096)"),
        (key(n=None), "W4A8 int4_gemm_w4a8 needs static K and N that are multiples of 8 (K=4096, N=None)"),
        (key(out_dtype=torch.float32), "W4A8 int4_gemm_w4a8 writes fp16 / bf16, not fp32"),
    ],
)
def test_capability_rows(gemm, reason):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no float16-output warning for float16
        assert why_not_implemented(XPU_KERNEL, gemm, XPU) == reason


def test_weight_only_keys_are_rejected():
    weight_only = QuantScheme.weight_only(torch.int8, G.PER_CHANNEL, torch.float16)
    assert why_not_implemented(XPU_KERNEL, key(weight_only), XPU) == "xpu computes int8 x int4 on xpu, not fp16 x int8 (weight-only)"


def test_bfloat16_and_a_float32_bias_are_accepted_without_a_warning_at_choice():
    """The float16-output warning comes on the first call (see the op test), not when the kernel is chosen."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert why_not_implemented(XPU_KERNEL, key(out_dtype=BF16), XPU) == ""
        float32_bias = GemmKey(w4a8(), n=4096, k=4096, out_dtype=BF16, bias_dtype=torch.float32, device_type="xpu")
        assert why_not_implemented(XPU_KERNEL, float32_bias, XPU) == ""


def test_forced_xpu_is_chosen_and_int4_keys_are_rejected_elsewhere_with_a_reason():
    assert choose_kernel(key(), XPU, forced="xpu").kernel is XPU_KERNEL
    assert choose_kernel(key(device_type="cpu"), CPU, preference=("torch",)).rejected == {
        "torch": "torch computes int8 / uint8 x int8, fp8 x fp8, bf16 x int8 (weight-only), "
                 "bf16 / fp16 / fp32 x int4 (weight-only) on cpu, not int8 x int4"}
    assert choose_kernel(key(device_type="cuda"), H100, preference=("triton",)).rejected == {
        "triton": "triton computes int8 x int8, fp8 x fp8, bf16 / fp16 / fp32 x int4 (weight-only), "
                  "bf16 / fp16 / fp32 x int8 (weight-only), bf16 / fp16 / fp32 x fp8 (weight-only) on cuda, "
                  "not int8 x int4"}


# --- packing ---------------------------------------------------------------------------------------

def pack_bit_by_bit(values):
    """The packing rule in plain Python: word j of row n holds w[n, 8j + i] + 8 in bits 4i..4i+3."""
    rows = []
    for row in values.tolist():
        words = []
        for start in range(0, len(row), 8):
            word = sum((value + 8) << (4 * i) for i, value in enumerate(row[start:start + 8]))
            words.append(word - 2**32 if word >= 2**31 else word)
        rows.append(words)
    return torch.tensor(rows, dtype=torch.int32)


def test_pack_int4_matches_the_bit_by_bit_rule():
    values = torch.randint(-8, 8, (6, 40), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (6, 5)
    assert torch.equal(packed, pack_bit_by_bit(values))


@pytest.mark.parametrize(
    "row, word",
    [([-8] * 8, 0), ([7] * 8, -1), ([-7] + [-8] * 7, 1), ([-8] * 7 + [0], -(2**31)), ([0] * 8, 0x88888888 - 2**32)],
)
def test_pack_int4_known_words(row, word):
    assert pack_int4(torch.tensor([row], dtype=torch.int8)).item() == word


def test_unpack_int4_round_trips_every_value_at_every_position():
    every_value_everywhere = ((torch.arange(16)[:, None] + torch.arange(64)[None, :]) % 16 - 8).to(torch.int8)
    random_values = torch.randint(-8, 8, (33, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    for values in (every_value_everywhere, random_values, random_values.t().contiguous()[:, :32].t()):
        assert torch.equal(unpack_int4(pack_int4(values)), values)
    words = torch.randint(-(2**31), 2**31, (5, 7), dtype=torch.int64).to(torch.int32)
    assert torch.equal(pack_int4(unpack_int4(words)), words)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pack_int4(torch.zeros(2, 8, dtype=torch.int32)), r"takes an int8 \[N, K\] matrix, got torch.int32"),
        (lambda: pack_int4(torch.zeros(8, dtype=torch.int8)), r"takes an int8 \[N, K\] matrix, got torch.int8 of shape \(8,\)"),
        (lambda: pack_int4(torch.zeros(2, 12, dtype=torch.int8)), "needs K to be a multiple of 8, got 12"),
        (lambda: pack_int4(torch.full((1, 8), 8, dtype=torch.int8)), r"must lie in \[-8, 7\], got \[8, 8\]"),
        (lambda: pack_int4(torch.full((1, 8), -9, dtype=torch.int8)), r"must lie in \[-8, 7\], got \[-9, -9\]"),
        (lambda: unpack_int4(torch.zeros(2, 1, dtype=torch.int64)), r"takes an int32 \[N, K / 8\] matrix, got torch.int64"),
    ],
)
def test_packing_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- prepare_weight --------------------------------------------------------------------------------

def int4_weight(n=24, k=64, group_size=32, seed=0):
    """(int4 values [N, K] in int8, scale [K / g, N]); group_size None: per channel, scale [1, N]."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=generator)
    groups = 1 if group_size is None else k // group_size
    return values, torch.rand(groups, n, generator=generator) * 0.02 + 0.001


def test_prepare_weight_packs_and_keeps_the_group_scale():
    values, scale = int4_weight()
    prepared = XPU_KERNEL.prepare_weight(values.t(), scale.t().contiguous().t(), None)  # a non-contiguous scale view
    assert torch.equal(prepared.data, pack_int4(values)) and prepared.data.shape == (24, 8)
    assert prepared.scale.is_contiguous() and torch.equal(prepared.scale, scale)
    assert prepared.zero_point.dtype == torch.int8 and prepared.zero_point.tolist() == [8]
    assert (prepared.k, prepared.n) == (64, 24)


@pytest.mark.parametrize(
    "scale, zero_point, message",
    [
        (torch.ones(2, 24), torch.tensor(1), "symmetric int4 weights; the weight has a zero point"),
        (None, None, r"needs a \[K / g, N\] weight scale for its \[K, N\] = \(64, 24\) weight, got None"),
        (torch.ones(24), None, r"got \(24,\)"),
        (torch.ones(3, 24), None, r"got \(3, 24\)"),
        (torch.ones(2, 12), None, r"got \(2, 12\)"),
    ],
)
def test_prepare_weight_errors(scale, zero_point, message):
    values, _ = int4_weight()
    with pytest.raises(ValueError, match=message):
        XPU_KERNEL.prepare_weight(values.t(), scale, zero_point)


# --- the op and the call into oneDNN, against a stand-in ------------------------------------------

CALLS = []


@torch.library.custom_op("qfuse_test_xpu::int4_gemm_w4a8", mutates_args=())
def standin_int4_gemm_w4a8(
    A_: torch.Tensor,
    A_scale: torch.Tensor,
    A_zp: torch.Tensor,
    B: torch.Tensor,
    B_scale: torch.Tensor,
    B_zp: torch.Tensor,
    group_size: int,
    g_idx: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """_xpu_C::int4_gemm_w4a8's schema with oneDNN's semantics, in float64: B is the [K / 8, N] NT
    view of int32 words, nibble i of word j in column n is weight row 8 j + i; one B_zp value is
    subtracted from every nibble; B_scale[k // group_size, n]; the result is float16."""
    CALLS.append({"A": A_.clone(), "A_contiguous": A_.is_contiguous(), "A_scale": A_scale.clone(), "A_zp": A_zp.clone(),
                  "B": B, "B_stride": B.stride(), "B_scale": B_scale.clone(), "B_scale_contiguous": B_scale.is_contiguous(),
                  "B_zp": B_zp.clone(), "group_size": group_size, "g_idx": g_idx, "bias": bias})
    words = B.t().to(torch.int64)  # [N, K / 8]
    nibbles = (words.unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF
    weight_nk = nibbles.flatten(-2) - B_zp.to(torch.int64)
    weight = weight_nk.t().to(torch.float64) * B_scale.to(torch.float64).repeat_interleave(group_size, dim=0)
    out = ((A_.to(torch.float64) - A_zp.to(torch.float64)) * A_scale.to(torch.float64)) @ weight
    if bias is not None:
        out = out + bias.to(torch.float64)
    return out.to(torch.float16)


@pytest.fixture
def standin(monkeypatch):
    CALLS.clear()
    monkeypatch.setattr(xpu_module, "xpu_int4_gemm_w4a8", lambda: torch.ops.qfuse_test_xpu.int4_gemm_w4a8)
    yield CALLS
    CALLS.clear()


def w4a8_operands(group_size, dtype, m=(2, 3), n=24, k=64, seed=0):
    """The op's operands: the activation quantized per token (q int8 [*m, K], its float32 scale
    [*m, 1]), int4 values [N, K], scale_b, bias, group_size."""
    values, scale = int4_weight(n, k, group_size, seed)
    generator = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(*m, k, generator=generator).to(dtype)
    q, token_scale = reference_math.dynamic_quant(x.reshape(-1, k), torch.int8, G.PER_TOKEN, 1e-5)
    bias = torch.randn(n, generator=generator).to(dtype)
    scale_arg = scale.reshape(n) if group_size is None else scale
    return (q.reshape(*m, k), token_scale.float().reshape(*m, 1), values, scale_arg, bias,
            -1 if group_size is None else group_size)


@pytest.mark.parametrize("group_size", [32, 64, None])
@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_the_op_calls_onednn_with_packed_weights_and_matches_the_reference(standin, group_size, dtype):
    q, token_scale, values, scale, bias, group_arg = w4a8_operands(group_size, dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.ops.qfuse.w4a8_scaled_mm(q, token_scale, values.t(), scale, bias, group_arg, dtype, "xpu")
    assert [str(w.message).startswith("qfuse's xpu W4A8 kernel") for w in caught] == ([True] if dtype == BF16 else [])
    (call,) = standin
    assert torch.equal(call["A"], q.reshape(6, 64)) and call["A_contiguous"]
    assert call["A_scale"].shape == (6, 1) and torch.equal(call["A_scale"], token_scale.reshape(6, 1))
    assert call["A_zp"].dtype == torch.int32 and call["A_zp"].shape == (6, 1) and not call["A_zp"].any()
    assert call["B"].dtype == torch.int32 and call["B"].shape == (8, 24) and call["B_stride"] == (1, 8)  # NT view
    assert torch.equal(call["B"].t(), pack_int4(values))
    assert call["B_scale_contiguous"] and torch.equal(call["B_scale"], scale.reshape(-1, 24))
    assert call["B_zp"].dtype == torch.int8 and call["B_zp"].tolist() == [8]
    assert call["group_size"] == (64 if group_size is None else group_size) and call["g_idx"] is None
    assert call["bias"].dtype == FP16 and torch.equal(call["bias"], bias.to(FP16))
    assert out.dtype == dtype and out.shape == (2, 3, 24)
    reference = torch.ops.qfuse.w4a8_scaled_mm(q, token_scale, values.t(), scale, bias, group_arg, dtype, "reference")
    torch.testing.assert_close(out, reference)


def test_the_packed_weight_is_made_once_per_weight(standin):
    q, token_scale, values, scale, bias, group_arg = w4a8_operands(32, FP16, seed=3)
    weight = values.t()
    for _ in range(2):
        torch.ops.qfuse.w4a8_scaled_mm(q, token_scale, weight, scale, bias, group_arg, FP16, "xpu")
    first, second = standin
    assert first["B"].data_ptr() == second["B"].data_ptr()


@pytest.mark.parametrize("group_size", [32, None])
def test_opcheck_through_the_stand_in(standin, group_size):
    q, token_scale, values, scale, bias, group_arg = w4a8_operands(group_size, FP16, seed=7)
    for args in ((q, token_scale, values.t(), scale, bias), (q[0], token_scale[0], values.t(), scale, None)):
        torch.library.opcheck(torch.ops.qfuse.w4a8_scaled_mm.default, (*args, group_arg, FP16, "xpu"))


def test_apply_rejects_what_onednn_cannot_compute(standin):
    values, scale = int4_weight()
    weight = XPU_KERNEL.prepare_weight(values.t(), scale, None)
    a, scale_a = torch.zeros(3, 64, dtype=torch.int8), torch.ones(3, 1)
    with pytest.raises(ValueError, match="takes a symmetric int8 activation, got torch.uint8"):
        XPU_KERNEL.apply(a.to(torch.uint8), weight, scale_a, None, None, FP16)
    with pytest.raises(ValueError, match="with zero point True"):
        XPU_KERNEL.apply(a, weight, scale_a, None, torch.zeros(3, 1, dtype=torch.int32), FP16)
    with pytest.raises(ValueError, match="returns float16 or bfloat16, not torch.float32"):
        XPU_KERNEL.apply(a, weight, scale_a, None, None, torch.float32)
    with pytest.raises(ValueError, match=r"per-token activation scale \[3, 1\], got shape \(3, 2\)"):
        XPU_KERNEL.apply(a, weight, torch.ones(3, 2), None, None, FP16)
    assert standin == []


def test_values_outside_int4_run_dequantized_without_onednn(standin):
    """int8 storage does not prove int4's range (torchao's int5-int8 intx): such a weight is not packed
    for oneDNN (which cannot hold it) but runs dequantized, and matches the reference kernel."""
    q, token_scale, values, scale, bias, group_arg = w4a8_operands(32, FP16, seed=5)
    wide = values.clone()
    wide[0, :3] = torch.tensor([-100, 9, 127], dtype=torch.int8)
    with pytest.warns(UserWarning, match="holds values outside int4's"):
        out = torch.ops.qfuse.w4a8_scaled_mm(q, token_scale, wide.t(), scale, bias, group_arg, FP16, "xpu")
    assert standin == []
    reference = torch.ops.qfuse.w4a8_scaled_mm(q, token_scale, wide.t(), scale, bias, group_arg, FP16, "reference")
    torch.testing.assert_close(out, reference, rtol=1e-3, atol=1e-3)
