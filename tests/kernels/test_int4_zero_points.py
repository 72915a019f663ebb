"""qfuse's CPU int4 kernel with zero points (`qfuse.kernels.cpu.int4_zero_points`): each weight value computed as
eager's (q - z) * s in bf16 / fp16 / float32, summed in float32; odd shapes, inf / nan, and the weights it cannot
hold."""

import pytest
import torch

from qfuse.kernels import get_kernel
from qfuse.kernels.cpu import int4_zero_points
from qfuse.kernels.prepared import Packing
from qfuse.ops.int4_weight_only import int4_product

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ROUNDING = {BF16: 2**-8, FP16: 2**-11, FP32: 2**-20}
PACK = int4_zero_points.pack  # the module's own, before a test counts its calls


def weight(k: int, n: int, group: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-8, 8, (k, n), generator=generator, dtype=torch.int8)
    scale = (torch.rand(k // group, n, generator=generator) / 16).to(dtype)
    zero = torch.randint(-8, 8, (k // group, n), generator=generator, dtype=torch.int8)
    return values, scale, zero


def eager_weight(values, scale, zero):
    """[K, N] as eager computes it: (q - z) in integers, then times the scale in its dtype (one rounding)."""
    group = torch.arange(values.shape[0]) // (values.shape[0] // scale.shape[0])
    return (values.to(torch.int32) - zero.to(torch.int32)[group]).to(scale.dtype) * scale[group]


@pytest.mark.parametrize("dtype, zero_points", [(BF16, True), (FP16, True), (FP32, True), (FP32, False)])
@pytest.mark.parametrize("m, k, n, group", [(0, 64, 32, 32), (1, 2, 16, 2), (1, 256, 48, 32), (5, 256, 80, 64),
                                            (17, 512, 272, 128), (3, 384, 64, 384)])
def test_the_sums_are_of_eagers_rounded_weight(dtype, zero_points, m, k, n, group):
    """Its float32 sums equal float32 products of eager's rounded weight (to float32 summation order): a bf16 / fp16
    weight left unrounded would differ by 2^-9 of a value, far above that. It takes float32 weights without zero
    points too (symmetric bf16 / fp16 ones are ATen's kernel's: kernels/int4_cpu.py)."""
    values, scale, zero = weight(k, n, group, dtype)
    zero = zero if zero_points else torch.zeros_like(zero)
    prepared = get_kernel("torch").prepare_int4_weight(values, scale, zero if zero_points else None)
    assert prepared.packing == int4_zero_points.PACKINGS[dtype]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    sums, x32 = torch.empty(m, n), x.float().contiguous()
    if m:
        int4_zero_points._function(dtype)(prepared.data.data_ptr(), prepared.scale.data_ptr(),
                                          prepared.zero_point.data_ptr(), x32.data_ptr(), sums.data_ptr(), m, n, k,
                                          group)
    expected = x.double() @ eager_weight(values, scale, zero).double()
    out = get_kernel("torch").weight_only_apply(x, prepared, None, dtype)
    assert out.dtype == dtype and out.shape == (m, n)
    if m:
        largest = expected.abs().max()
        assert (sums.double() - expected).abs().max() <= 1e-5 * largest
        assert (out.double() - expected).abs().max() <= ROUNDING[dtype] * largest


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_bias_and_a_float32_output_as_a_float_linear(dtype):
    values, scale, zero = weight(128, 32, 64, dtype)
    prepared = get_kernel("torch").prepare_int4_weight(values, scale, zero)
    x, bias = torch.randn(4, 128).to(dtype), torch.randn(32).to(dtype)
    out = get_kernel("torch").weight_only_apply(x, prepared, bias, torch.float32)
    eager = torch.nn.functional.linear(x, eager_weight(values, scale, zero).t(), bias).float()
    assert out.dtype == torch.float32 and (out - eager).abs().max() <= 2 * ROUNDING[dtype] * eager.abs().max()


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_inf_and_nan_follow_eager(dtype):
    """A scale of inf (its group's values inf or nan, as (q - z) * inf is), a nan scale, an inf in x; in fp16 a
    scale whose products overflow to inf when rounded (60000 * 8)."""
    values, scale, zero = weight(128, 32, 32, dtype)
    scale[1, 3], scale[2, 5] = float("inf"), float("nan")
    if dtype == FP16:
        scale[3, 9] = 60000.0
    x = torch.randn(3, 128).to(dtype)
    x[2, 7] = float("inf")
    prepared = get_kernel("torch").prepare_int4_weight(values, scale, zero)
    out = get_kernel("torch").weight_only_apply(x, prepared, None, dtype)
    eager = x @ eager_weight(values, scale, zero)
    assert torch.equal(out.isnan(), eager.isnan()) and torch.equal(out.isinf(), eager.isinf())
    finite = eager.isfinite()
    assert (out[finite].float() - eager[finite].float()).abs().max() <= ROUNDING[dtype] * eager[finite].float().abs().max()


def test_a_weight_it_cannot_hold_is_dequantized_once_and_says_why():
    """Values outside [-8, 7] (torchao's int8 storage can hold them) or an odd K: the exact dense weight instead."""
    values, scale, zero = weight(64, 16, 32, BF16)
    assert int4_zero_points.why_not(values, 32) == ""
    assert int4_zero_points.why_not(values.clone().fill_(9), 32) == "values outside int4's range [-8, 7]"
    assert "both even" in int4_zero_points.why_not(values[:63], 63)
    prepared = get_kernel("torch").prepare_int4_weight(values.clone().fill_(9), scale, zero)
    assert prepared.packing == Packing.DENSE


def test_a_kernel_that_did_not_build_leaves_the_exact_dense_weight(monkeypatch):
    """No working C++ compiler (or a torch whose code cache the kernel does not know): the weight is prepared
    dense, with the reason, and the linear still gives eager's result."""
    def fail(dtype):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(int4_zero_points, "_function", fail)
    int4_zero_points.why_not_built.cache_clear()
    try:
        assert int4_zero_points.why_not_built(BF16) == "its C++ did not build here (RuntimeError: no compiler)"
        values, scale, zero = weight(64, 16, 32, BF16)
        prepared = get_kernel("torch").prepare_int4_weight(values, scale, zero)
        assert prepared.packing == Packing.DENSE
        x = torch.randn(3, 64).to(BF16)
        out = int4_product(get_kernel("torch"), x, prepared, None, BF16)
        torch.testing.assert_close(out, x @ eager_weight(values, scale, zero))
    finally:
        int4_zero_points.why_not_built.cache_clear()


def test_float32_without_the_kernel_is_atens_layout_and_eagers_result(monkeypatch):
    """Where the C++ kernel did not build, a float32 weight (zero points held exactly in float32) is ATen's."""
    monkeypatch.setattr(int4_zero_points, "why_not_built", lambda dtype: "its C++ did not build here (no compiler)")
    values, scale, zero = weight(64, 16, 32, FP32)
    prepared = get_kernel("torch").prepare_int4_weight(values, scale, zero)
    assert prepared.packing == Packing.INT4PACK_CPU
    x = torch.randn(3, 64)
    out = int4_product(get_kernel("torch"), x, prepared, None, FP32)
    torch.testing.assert_close(out, x @ eager_weight(values, scale, zero), rtol=1e-5, atol=1e-5)


def test_an_activation_of_another_dtype_is_named():
    values, scale, zero = weight(64, 16, 32, BF16)
    prepared = get_kernel("torch").prepare_int4_weight(values, scale, zero)
    with pytest.raises(ValueError, match="prepared for torch.bfloat16 activations"):
        get_kernel("torch").weight_only_apply(torch.randn(1, 64, dtype=FP16), prepared, None, FP16)


def test_a_compiled_awq_linear_prepares_its_weight_once(monkeypatch):
    """AWQ's shifts reach the op as a new tensor every call (Inductor inlines a CPU constant of 8 values); the
    prepared weight is still found, not made again, on the calls after the first."""
    from tests.peers.weight_only_models import awq_int4, example_input

    packs = []
    monkeypatch.setattr(int4_zero_points, "pack", lambda *args: packs.append(1) or PACK(*args))
    model, x = awq_int4(BF16), example_input(256, BF16)
    compiled = torch.compile(model, backend="qfuse")
    with torch.no_grad():
        outs = [compiled(x) for _ in range(3)]
        eager = model(x)
    assert len(packs) == 1
    assert all((out.float() - eager.float()).abs().max() <= 2**-7 * eager.float().abs().max() for out in outs)

