"""Tests for the `zentorch` kernel (qfuse/kernels/zentorch.py).

Constraints (is_supported / can_implement) on constructed Platforms and GemmKeys need no zentorch.
The rest needs zentorch (skipped without it) and names the kernel, so it runs on any x86 CPU that
zentorch runs on, Zen or not: qfuse::quant_scaled_mm and qfuse::scaled_mm against `reference_math`
in float64 (odd shapes, 3D input, bias, dtypes, weight layouts and scales), the prepared-weight
cache and ZenDNN's own weight cache, canaries for the zentorch behaviour the kernel works around,
and an end-to-end torch.compile (the platform is patched to a Zen CPU there).
"""

import dataclasses
import types

import pytest
import torch

import qfuse
from qfuse.kernels import GemmKey, choose_kernel, get_kernel, prepared, reference_math, why_not_implemented
from qfuse.kernels.zentorch import split_for_exact_requant
from qfuse.ops.verify import tolerance_for, verify_results
from qfuse.platform import Platform, current_platform
from qfuse.schemes import FP8_DTYPE, INT4_DTYPE, Granularity, QuantScheme
from tests.helpers import compile_and_run
from tests.passes.test_activation_quant import quantized_with_a_divisor_of_100
from tests.passes.test_reference_linear import int_mm_linear, operands

ops = torch.ops.qfuse
KERNEL = get_kernel("zentorch")
ZEN4 = Platform("cpu", cpu_has_avx512_vnni=True, cpu_is_amd_zen=True, libraries=frozenset({"zentorch"}))
INT8_TOKEN_CHANNEL = QuantScheme(torch.int8, torch.int8, Granularity.PER_TOKEN, Granularity.PER_CHANNEL, dynamic=True)
# Relative error of one rounding to each out dtype (both sides round the same float64 value).
ONE_ROUNDING = {torch.float32: 1e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def key(scheme=INT8_TOKEN_CHANNEL, out_dtype=torch.bfloat16, device_type="cpu", n=4096, k=4096,
        bias_dtype=torch.float32):
    return GemmKey(scheme, n=n, k=k, out_dtype=out_dtype, bias_dtype=bias_dtype, device_type=device_type)


def scheme(**changes):
    return dataclasses.replace(INT8_TOKEN_CHANNEL, **changes)


# ---------------------------------------------------------------------------------- constraints

@pytest.mark.parametrize("platform, reason", [
    (ZEN4, ""),
    (Platform("cuda", cuda_capability=(9, 0), libraries=frozenset({"zentorch"})),
     "zentorch runs on CPUs, not on CUDA GPU (capability 90)"),
    (dataclasses.replace(ZEN4, cpu_is_amd_zen=False),
     "zentorch is AMD's library for Zen CPUs; this is not one (CPU (AVX-512 VNNI))"),
    (dataclasses.replace(ZEN4, cpu_has_avx512_vnni=False),
     "zentorch's int8 GEMM is used with AVX-512 VNNI only (Zen 4 and later); this Zen CPU has none"),
    (dataclasses.replace(ZEN4, libraries=frozenset()), "zentorch is not installed (pip install 'qfuse[zentorch]')"),
], ids=["zen4", "cuda", "not-zen", "no-vnni", "not-installed"])
def test_is_supported(platform, reason):
    assert KERNEL.is_supported(platform) == (not reason, reason)


if hasattr(QuantScheme, "weight_only"):
    WEIGHT_ONLY = QuantScheme.weight_only(torch.int8, Granularity.PER_CHANNEL)
else:  # a stand-in until weight-only schemes land
    WEIGHT_ONLY = types.SimpleNamespace(is_weight_only=True, describe=lambda: "bf16 x int8 per-channel (weight-only)")


@pytest.mark.parametrize("gemm_key, reason", [
    (key(), ""),
    (key(scheme(weight_granularity=Granularity.PER_TENSOR)), ""),
    (key(out_dtype=torch.float32), ""),
    (key(out_dtype=torch.float16), ""),
    (key(n=45, k=67), ""),
    (key(n=None, k=None), ""),
    (key(bias_dtype=None), ""),
    (key(bias_dtype=torch.float16), ""),
    (key(bias_dtype=torch.int32), "zentorch_dynamic_qlinear adds a fp32 / bf16 / fp16 bias, not torch.int32"),
    (key(device_type="cuda"), "zentorch takes cpu tensors, not cuda"),
    (key(WEIGHT_ONLY), "zentorch computes int8 x int8 on cpu, not bf16 x int8 (weight-only)"),
    (key(scheme(activation_dtype=FP8_DTYPE, weight_dtype=FP8_DTYPE)),
     "zentorch computes int8 x int8 on cpu, not fp8 x fp8"),
    (key(scheme(weight_dtype=INT4_DTYPE, weight_granularity=Granularity.PER_GROUP, weight_group_size=128)),
     "zentorch computes int8 x int8 on cpu, not int8 x int4"),
    (key(scheme(activation_dtype=torch.uint8, symmetric=False)),
     "zentorch computes int8 x int8 on cpu, not uint8 x int8"),
    (key(scheme(symmetric=False)),
     "zentorch_dynamic_qlinear takes no activation zero point (asymmetric activations)"),
    (key(scheme(dynamic=False, activation_granularity=Granularity.PER_TENSOR)),
     "zentorch_dynamic_qlinear takes per-token activation scales, not per-tensor"),
    (key(scheme(activation_granularity=Granularity.PER_TENSOR)),
     "zentorch_dynamic_qlinear takes per-token activation scales, not per-tensor"),
    (key(scheme(activation_granularity=Granularity.PER_GROUP)),
     "zentorch_dynamic_qlinear takes per-token activation scales, not per-group"),
    (key(scheme(weight_granularity=Granularity.BLOCK)),
     "zentorch_dynamic_qlinear takes per-channel / per-tensor weight scales, not block"),
    (key(out_dtype=torch.float64), "zentorch_dynamic_qlinear writes fp32 / bf16 / fp16, not torch.float64"),
])
def test_capability_rows(gemm_key, reason):
    assert why_not_implemented(KERNEL, gemm_key, ZEN4) == reason


def test_registered_and_chosen_when_forced_on_zen():
    assert choose_kernel(key(), ZEN4, forced="zentorch").kernel is KERNEL
    assert KERNEL.fuses_activation_quant and KERNEL.prepares_weight


# ------------------------------------------------------------------------------------ numerics

@pytest.fixture
def zentorch():
    if torch.backends.cpu.get_cpu_capability() != "AVX512":  # its binary stops the process (SIGILL) without it
        pytest.skip(f"zentorch's kernels need AVX-512; this CPU has {torch.backends.cpu.get_cpu_capability()}")
    return pytest.importorskip("zentorch")


def expected_linear(q, b, scale_a, scale_b, bias):
    """float64 result of the already-quantized linear (`reference_math.scaled_mm`)."""
    scale_b = None if scale_b is None else scale_b.reshape(1, -1) if scale_b.numel() > 1 else scale_b.reshape(())
    return reference_math.scaled_mm(q, b, scale_a, scale_b, bias, None, None, torch.float64)


def assert_one_rounding(out, expected, out_dtype):
    assert out.dtype == out_dtype
    tolerance = ONE_ROUNDING[out_dtype] * expected.abs() + 1e-6 * expected.abs().max()
    assert ((out.double().reshape(expected.shape) - expected).abs() <= tolerance).all()


@pytest.mark.parametrize("shape", [(1, 64), (33, 64), (2, 9, 64), (5, 67)], ids=["M1", "M33", "3D", "odd-K"])
@pytest.mark.parametrize("x_dtype, out_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16), (torch.float16, torch.float16),
], ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_quant_scaled_mm_matches_reference(zentorch, shape, x_dtype, out_dtype, with_bias):
    x, w, w_scale, bias = operands(shape, n=45)
    x = x.to(x_dtype)
    bias = bias.to(x_dtype) if with_bias else None
    out = ops.quant_scaled_mm(x, w.t(), None, w_scale, bias, torch.int8, 1e-5, out_dtype, "zentorch")
    q, s = reference_math.dynamic_quant(x.float().reshape(-1, shape[-1]), torch.int8, Granularity.PER_TOKEN, 1e-5)
    assert out.shape == (*shape[:-1], 45)
    assert_one_rounding(out, expected_linear(q, w.t(), s, w_scale, bias), out_dtype)
    if out_dtype == x_dtype == torch.bfloat16:  # one rounding of the exact result, bit for bit
        assert torch.equal(out.reshape(-1, 45), expected_linear(q, w.t(), s, w_scale, bias).to(out_dtype))


def test_ties_round_to_even_and_a_zero_row_gives_zero(zentorch):
    x = torch.zeros(2, 8)
    x[0] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])  # scale 1
    identity = torch.eye(8, dtype=torch.int8)
    out = ops.quant_scaled_mm(x, identity, None, None, None, torch.int8, 0.0, torch.float32, "zentorch")
    assert out[0].tolist() == [127.0, 0.0, 2.0, 2.0, -0.0, -2.0, -2.0, 4.0]
    assert out[1].tolist() == [0.0] * 8  # the reference gives NaN here with eps=0 (0 / 0)


def activation_rows(k=67, seed=3):
    """int8 rows of every kind `apply` meets: full range with -128, max 127, short, one value, zero."""
    generator = torch.Generator().manual_seed(seed)
    full = torch.randint(-128, 128, (4, k), dtype=torch.int8, generator=generator)
    symmetric = torch.randint(-127, 128, (3, k), dtype=torch.int8, generator=generator)
    symmetric[:, 0] = torch.tensor([127, -127, 127], dtype=torch.int8)
    short = torch.randint(-5, 6, (3, k), dtype=torch.int8, generator=generator)
    single = torch.zeros(2, k, dtype=torch.int8)
    single[0, 5], single[1, 9] = -3, 100
    return torch.cat([full, symmetric, short, single, torch.zeros(1, k, dtype=torch.int8)])


def test_split_for_exact_requant():
    a = activation_rows()
    hi, lo = split_for_exact_requant(a)
    assert torch.equal(hi.to(torch.int16) + lo.to(torch.int16), a.to(torch.int16))
    assert set(hi.to(torch.int16).abs().amax(-1).tolist()) == {0, 127}
    lo_rows = lo.to(torch.int16)
    for row in lo_rows:
        assert (row.count_nonzero() <= 1) or set(row.unique().tolist()) <= {-1, 0}
    symmetric = a[4:7]
    hi, lo = split_for_exact_requant(symmetric)
    assert hi is symmetric and lo is None  # one GEMM for the rows of a symmetric dynamic quantizer


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_scaled_mm_matches_reference(zentorch, out_dtype, with_bias):
    a = activation_rows()
    _, w, w_scale, bias = operands((1, 67), n=45)
    scale_a = torch.rand(a.shape[0], 1) + 0.5
    bias = bias if with_bias else None
    out = ops.scaled_mm(a, w.t(), scale_a, w_scale, bias, None, None, out_dtype, "zentorch")
    assert_one_rounding(out, expected_linear(a, w.t(), scale_a, w_scale, bias), out_dtype)


@pytest.mark.parametrize("layout", ["transposed-nk", "contiguous-kn"])
@pytest.mark.parametrize("scale_kind", ["per-channel", "per-channel-2d", "per-tensor", "none"])
def test_weight_layouts_and_scales(zentorch, layout, scale_kind):
    x, w, w_scale, bias = operands((9, 67), n=45)
    b = w.t() if layout == "transposed-nk" else w.t().contiguous()  # zentorch itself misreads a strided weight
    scale_b = {"per-channel": w_scale, "per-channel-2d": w_scale.reshape(1, -1),
               "per-tensor": w_scale[:1].reshape(()), "none": None}[scale_kind]
    out = ops.quant_scaled_mm(x, b, None, scale_b, bias, torch.int8, 1e-5, torch.float32, "zentorch")
    q, s = reference_math.dynamic_quant(x, torch.int8, Granularity.PER_TOKEN, 1e-5)
    assert_one_rounding(out, expected_linear(q, b, s, scale_b, bias), torch.float32)


def test_empty_batch(zentorch):
    _, w, w_scale, _ = operands((1, 64))
    assert ops.quant_scaled_mm(torch.randn(0, 64), w.t(), None, w_scale, None, torch.int8, 0.0, torch.float32,
                               "zentorch").shape == (0, 48)
    assert ops.scaled_mm(torch.zeros(0, 64, dtype=torch.int8), w.t(), torch.ones(0, 1), w_scale, None, None, None,
                         torch.bfloat16, "zentorch").shape == (0, 48)


def test_weight_prepared_once_and_again_after_an_in_place_update(zentorch, monkeypatch):
    calls, prepare = [], type(KERNEL).prepare_weight

    def counting_prepare(self, *args):
        calls.append(args)
        return prepare(self, *args)

    monkeypatch.setattr(type(KERNEL), "prepare_weight", counting_prepare)
    x, w, w_scale, _ = operands((5, 64))
    first = ops.quant_scaled_mm(x, w.t(), None, w_scale, None, torch.int8, 0.0, torch.float32, "zentorch")
    again = ops.quant_scaled_mm(x, w.t(), None, w_scale, None, torch.int8, 0.0, torch.float32, "zentorch")
    assert len(calls) == 1 and torch.equal(first, again)
    prepared_weight = prepared.prepare_once(KERNEL, w.t(), w_scale.reshape(1, -1), None)
    assert prepared_weight.data.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    w.neg_()  # ZenDNN caches by address; qfuse prepares a new copy and clears that cache
    flipped = ops.quant_scaled_mm(x, w.t(), None, w_scale, None, torch.int8, 0.0, torch.float32, "zentorch")
    assert len(calls) == 2 and torch.equal(flipped, -first)


def test_new_weights_at_freed_addresses_are_not_served_stale(zentorch):
    x = torch.randn(4, 1024)
    for seed in range(6):  # same-sized weights, each freed before the next: the allocator reuses addresses
        generator = torch.Generator().manual_seed(seed)
        w = torch.randint(-127, 128, (256, 1024), dtype=torch.int8, generator=generator)
        out = ops.quant_scaled_mm(x, w.t(), None, None, None, torch.int8, 0.0, torch.float32, "zentorch")
        q, s = reference_math.dynamic_quant(x, torch.int8, Granularity.PER_TOKEN, 0.0)
        assert_one_rounding(out, expected_linear(q, w.t(), s, None, None), torch.float32)
        del w, out
        prepared.cached_weight_count()  # evicts the freed weight's entry, freeing its private copy


def test_bf16_weight_scales_would_break_the_float32_tolerance(zentorch):
    """Why prepare_weight keeps float32 scales: bfloat16 ones also round the activation's scale."""
    x, w, w_scale, _ = operands((64, 512), n=32)
    q, s = reference_math.dynamic_quant(x, torch.int8, Granularity.PER_TOKEN, 0.0)
    exact = expected_linear(q, w.t(), s, w_scale, None)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.ops.zentorch.zentorch_dynamic_qlinear(x, w.clone(), w_scale.to(dtype))
        errors[dtype] = ((out.double() - exact).norm() / exact.norm()).item()
    assert errors[torch.float32] < 1e-6
    assert errors[torch.bfloat16] > tolerance_for(INT8_TOKEN_CHANNEL, torch.float32)


def test_canary_zentorch_prepacked_path_is_wrong_for_large_k(zentorch):
    """Why the weight is not prepacked. If this fails, zentorch fixed it: prepacking may be worth it."""
    x, w, _, _ = operands((4, 4096), n=512)
    packed = torch.ops.zentorch.zentorch_weight_prepack_for_dynamic_qlinear(w, False)
    out = torch.ops.zentorch.zentorch_dynamic_qlinear(x, packed, torch.ones(512), is_weight_prepacked=True)
    q, s = reference_math.dynamic_quant(x, torch.int8, Granularity.PER_TOKEN, 0.0)
    exact = expected_linear(q, w.t(), s, None, None)
    assert ((out.double() - exact).norm() / exact.norm()).item() > 0.5


@pytest.mark.parametrize("op", ["quant_scaled_mm", "scaled_mm"])
def test_opcheck(zentorch, op):
    x, w, w_scale, bias = operands((9, 64))
    if op == "quant_scaled_mm":
        args = (x, w.t(), None, w_scale, bias, torch.int8, 1e-5, torch.bfloat16, "zentorch")
    else:
        args = (activation_rows(64), w.t(), torch.rand(13, 1), w_scale, bias, None, None, torch.float32, "zentorch")
    torch.library.opcheck(getattr(ops, op).default, args)


# ---------------------------------------------------------------------------------- end to end

@pytest.fixture
def zen_cpu(zentorch, monkeypatch):
    """The passes choose kernels for `current_platform`: make this CPU a Zen 4 one (CI may be Intel)."""
    def zen_platform(device_type):
        platform = current_platform(device_type)
        if device_type != "cpu":
            return platform
        return dataclasses.replace(platform, cpu_is_amd_zen=True, cpu_has_avx512_vnni=True)
    monkeypatch.setattr("qfuse.passes.core.fused_linear.current_platform", zen_platform)


def bf16_int_mm_linear(x, w, w_scale, bias):
    """A bfloat16 model: Inductor keeps this quantization (not folded), so zentorch runs `apply`."""
    s = x.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.clamp(torch.round(x / s), -128, 127).to(torch.int8)
    return (torch._int_mm(q, w.t()).float() * s.float() * w_scale + bias).to(torch.bfloat16)


@pytest.mark.parametrize("form, x_dtype, folded", [
    (int_mm_linear, torch.float32, True), (quantized_with_a_divisor_of_100, torch.float32, False),
    (bf16_int_mm_linear, torch.bfloat16, None),  # today not folded: activation_quant misses the bf16 casts
], ids=["folded", "rows-short-of-127", "bf16"])
def test_compiled_linear_matches_eager_and_passes_verify(zen_cpu, form, x_dtype, folded):
    x, w, w_scale, bias = operands((17, 256), n=64)
    x = x.to(x_dtype)
    out, report = compile_and_run(form, x, w, w_scale, bias, kernel="zentorch", verify=True)
    (record,) = report.records
    assert record.fused and record.kernel == "zentorch"
    fused_ops = [report.ops_after["qfuse.quant_scaled_mm.default"], report.ops_after["qfuse.scaled_mm.default"]]
    assert fused_ops == ([1, 0] if folded else [0, 1]) if folded is not None else sum(fused_ops) == 1
    eager = form(x, w, w_scale, bias)
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    else:  # eager rounds x / s and s to bfloat16, Inductor (and the torch kernel) do not: ~1% apart
        assert ((out.double() - eager.double()).norm() / eager.double().norm()).item() < 2e-2
    checked = [result for label, result in verify_results().items() if label.startswith(f"{report.graph_name}/")]
    assert checked and all(result.passed for result in checked)


def test_dynamic_batch_sizes_compile_once(zen_cpu):
    _, w, w_scale, bias = operands((4, 128))
    compiled = torch.compile(int_mm_linear, backend="qfuse", options={"kernel": "zentorch"}, dynamic=True)
    marker = qfuse.graphs_compiled()
    for rows in (2, 5, 33):
        x = torch.randn(3, rows, 128)
        expected = int_mm_linear(x, w, w_scale, bias)
        torch.testing.assert_close(compiled(x, w, w_scale, bias), expected, rtol=1e-4, atol=1e-4)
    (report,) = qfuse.reports_since(marker)
    assert report.records[0].kernel == "zentorch" and report.ops_after["qfuse.quant_scaled_mm.default"] == 1
