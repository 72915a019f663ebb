"""Tests for `qfuse::int4_weight_only_mm` (W4A16: int4 packed eight to an int32 along K, group scales).

The expected result is the peer model's own forward (tests/peers/weight_only_models.py writes the
GPTQ / compressed-tensors dequantize as model code does) and its float64 reference weight. Covered:
the `torch` kernel (ATen's `_weight_int4pack_mm_for_cpu`; in float32, and with bf16 / fp16 zero points,
qfuse's C++ kernel) against both, symmetric and with zero
points, 2D and 3D, M = 0 / 1 / odd; the op following whatever shifts it is given; the weight
unpacked and repacked once per weight; `torch.library.opcheck`; ValueErrors naming the problem;
GPTQ's act order (`g_idx`: the weight's rows sorted by group once, the activation's columns gathered;
any other `g_idx` a dense weight), zero points stored minus one (both conventions), AutoGPTQ's
[K / 8, N] tensors through their transposes and AWQ's [K, N / 8] words packed along N.
"""

import pytest
import torch

import qfuse.ops  # noqa: F401  (registers torch.ops.qfuse)
from qfuse.kernels.prepared import cached_weight_count
from qfuse.ops import int4_weight_only
from qfuse.ops.int4_weight_only import folded_zero_points, prepared_int4_weight, unpack
from tests.peers.weight_only_models import (autogptq_int4, awq_int4, gptq_packed_int4, pack_int4_along_first,
                                            torchao_intx_int4)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
OP = torch.ops.qfuse.int4_weight_only_mm


def call(model, x, kernel="torch", shifts=None):
    return OP(x, model.qweight, model.shifts if shifts is None else shifts, model.scales, model.qzeros, model.bias,
              model.group_size, x.dtype, kernel)


def float64_reference(model, x):
    out = x.double() @ model.reference_weight.t()
    return out if model.bias is None else out + model.bias.double()


@pytest.mark.parametrize("dtype, symmetric", [(BF16, True), (FP16, True), (FP32, True), (FP32, False)])
@pytest.mark.parametrize("shape", [(1, 256), (7, 256), (2, 5, 256), (0, 256)], ids=["M1", "M7", "3D", "M0"])
@pytest.mark.parametrize("group_size", [32, 128])
def test_torch_kernel_matches_the_model_and_float64(dtype, symmetric, shape, group_size):
    model = gptq_packed_int4(dtype, group_size=group_size, symmetric=symmetric)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = call(model, x)
    eager = model(x)
    assert out.dtype == dtype and out.shape == eager.shape
    if x.numel() == 0:
        return
    scale = eager.float().abs().max()
    tolerance = {BF16: 2**-7, FP16: 2**-10, FP32: 1e-5}[dtype]  # one rounding of the output
    assert (out.float() - eager.float()).abs().max() <= tolerance * scale
    assert (out.double() - float64_reference(model, x)).abs().max() <= tolerance * scale


def test_the_op_reads_the_shifts_it_is_given():
    """Nothing is assumed about the shifts: reversed nibbles give the reversed weight, as the model would."""
    model = gptq_packed_int4(FP32, group_size=32)
    reversed_shifts = model.shifts.flip(0).contiguous()
    values, _, _ = unpack(model.qweight, reversed_shifts, model.scales, None, 32)
    standard, _, _ = unpack(model.qweight, model.shifts, model.scales, None, 32)
    k = values.shape[0]
    assert torch.equal(values.reshape(k // 8, 8, -1), standard.reshape(k // 8, 8, -1).flip(1))
    x = torch.randn(3, 256)
    model_with_reversed = gptq_packed_int4(FP32, group_size=32)
    model_with_reversed.shifts = reversed_shifts
    torch.testing.assert_close(call(model, x, shifts=reversed_shifts), model_with_reversed(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed_along_n", [False, True])
def test_words_are_unpacked_a_block_of_rows_at_a_time_as_whole(monkeypatch, packed_along_n):
    """`unpack` bounds its int32 temporaries by taking UNPACK_WORDS words at a time: with 7 (blocks of two rows of
    3 words, the last of one row) the values equal the formula's on the whole matrix."""
    packed = torch.randint(-2**31, 2**31 - 1, (13, 3), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    shifts = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int32)
    scales = torch.rand(13, 1) if not packed_along_n else torch.rand(1, 24)
    monkeypatch.setattr(int4_weight_only, "UNPACK_WORDS", 7)
    values, _, _ = unpack(packed, shifts, scales, None, 24 if not packed_along_n else 13, packed_along_n=packed_along_n)
    whole = (((packed.unsqueeze(-1) >> shifts) & 0xF) - 8).reshape(13, 24).to(torch.int8)
    assert torch.equal(values, whole if packed_along_n else whole.t())


def test_the_weight_is_unpacked_and_packed_once():
    model = gptq_packed_int4(BF16, group_size=32)
    x = torch.randn(4, 256).to(BF16)
    before = cached_weight_count()
    first = call(model, x)
    assert cached_weight_count() == before + 1
    torch.testing.assert_close(call(model, x), first, rtol=0, atol=0)
    assert cached_weight_count() == before + 1
    prepared = prepared_int4_weight("torch", model.qweight, model.shifts, model.scales, model.qzeros, 32)[1]
    model.qweight.copy_(gptq_packed_int4(BF16, group_size=32, seed=1).qweight)  # a checkpoint loaded in place
    torch.testing.assert_close(call(model, x), model(x), rtol=2**-7, atol=2**-7 * model(x).abs().max().item())
    assert cached_weight_count() == before + 1  # prepared again, into the same memory
    again = prepared_int4_weight("torch", model.qweight, model.shifts, model.scales, model.qzeros, 32)[1]
    assert again.data.data_ptr() == prepared.data.data_ptr()


def test_opcheck():
    model = gptq_packed_int4(FP32, group_size=32, symmetric=False)
    x = torch.randn(3, 256)
    torch.library.opcheck(OP.default, (x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias, 32,
                                       FP32, "torch"))


@pytest.mark.parametrize("change, message", [
    (dict(x=torch.randn(2, 128)), "activation has K=128 but the packed weight [N, K / 8] holds K=256"),
    (dict(x=torch.randn(2, 256).to(torch.int8)), "activation must be one of"),
    (dict(shifts=torch.arange(8)), "shifts must be int32 [8]"),
    (dict(group_size=48), "group_size must divide K=256"),
    (dict(scales=torch.rand(128, 4)), "scales must be a float [N, K / group_size] = [128, 8]"),
    (dict(packed_zeros=torch.zeros(16, 4, dtype=torch.int32)), "packed_zeros must be int32 [N / 8, K / group_size]"),
    (dict(bias=torch.rand(64)), "bias must have shape [128]"),
    (dict(g_idx=torch.zeros(128, dtype=torch.int32)), "g_idx must be an int32 or int64 [K] = [256] vector"),
    (dict(g_idx=torch.full((256,), 8, dtype=torch.int32)), "g_idx holds groups in [8, 8], outside the 8 groups"),
    (dict(zero_convention="minus_one"), "zero_convention must be one of ['stored', 'plus_one', 'plus_one_mod_16']"),
])
def test_bad_operands_raise_naming_the_problem(change, message):
    model = gptq_packed_int4(FP32, group_size=32)
    args = dict(x=torch.randn(2, 256), packed=model.qweight, shifts=model.shifts, scales=model.scales,
                packed_zeros=None, bias=model.bias, group_size=32, out_dtype=FP32, kernel="torch") | change
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        OP(**args)


@pytest.mark.parametrize("symmetric", [True, False])
def test_reference_kernel_is_the_float64_truth(symmetric):
    model = gptq_packed_int4(FP32, group_size=64, symmetric=symmetric)
    x = torch.randn(5, 256)
    out = OP(x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias, 64, FP32, "reference")
    torch.testing.assert_close(out, float64_reference(model, x).float(), rtol=1e-6, atol=1e-6)  # float64 math, one rounding


def act_order_call(model, x, kernel, zero_convention="plus_one"):
    return OP(x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias, model.group_size, x.dtype, kernel,
              model.g_idx, zero_convention)


@pytest.mark.parametrize("kernel", ["torch", "reference"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_act_order_sorts_the_rows_once_and_gathers_the_activation(kernel, symmetric):
    model = gptq_packed_int4(FP32, group_size=64, act_order=True, symmetric=symmetric, zeros_minus_one=not symmetric)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(4))
    before = cached_weight_count()
    out = act_order_call(model, x, kernel)
    assert cached_weight_count() == before + 1
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5 * model(x).abs().max().item())
    torch.testing.assert_close(out.double(), float64_reference(model, x), rtol=1e-5, atol=1e-5 * out.abs().max().item())


def test_a_g_idx_that_sorts_into_no_groups_gets_a_dense_weight():
    """Group sizes 1, 2, ... instead of 64 each: no order of the rows makes groups of 64; the op
    still computes the model's formula (a float [K, N] weight made once)."""
    model = gptq_packed_int4(FP32, group_size=64, symmetric=False, zeros_minus_one=True)
    model.g_idx = torch.randint(0, 4, (256,), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    x = torch.randn(5, 256)
    eager = model(x)
    for kernel in ("torch", "reference"):
        torch.testing.assert_close(act_order_call(model, x, kernel), eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())


def test_zero_conventions_follow_the_model():
    """A stored 15 is a zero point of 16 after the mask ("plus_one"), of 0 before it ("plus_one_mod_16")."""
    model = gptq_packed_int4(FP32, group_size=64, act_order=True, symmetric=False, zeros_minus_one=True)
    model.qzeros[0, 0] |= 0xF
    x = torch.randn(3, 256)
    eager = model(x)  # "plus_one": mask, then add one
    torch.testing.assert_close(act_order_call(model, x, "torch"), eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())
    wrapped = act_order_call(model, x, "reference", zero_convention="plus_one_mod_16")
    assert not torch.allclose(wrapped, eager)  # channel 0 of group 0 reads another zero point


@pytest.mark.parametrize("kernel", ["torch", "reference"])
def test_autogptq_tensors_through_their_transposes(kernel):
    model = autogptq_int4(FP32, group_size=64, act_order=True)
    x = torch.randn(7, 256)
    out = OP(x, model.qweight.t(), model.wf.reshape(8), model.scales.t(), model.qzeros.t(), model.bias, 64, FP32, kernel,
             model.g_idx, "plus_one_mod_16")
    eager = model(x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())


def test_opcheck_with_g_idx():
    model = gptq_packed_int4(FP32, group_size=32, act_order=True, symmetric=False, zeros_minus_one=True)
    torch.library.opcheck(OP.default, (torch.randn(3, 256), model.qweight, model.shifts, model.scales, model.qzeros,
                                       model.bias, 32, FP32, "torch", model.g_idx, "plus_one"))


@pytest.mark.parametrize("kernel", ["torch", "reference"])
def test_awq_words_packed_along_n(kernel):
    model = awq_int4(FP32, group_size=64, unpack_order="shifts")
    x = torch.randn(2, 3, 256)
    out = OP(x, model.qweight, model.shifts, model.scales.t(), model.qzeros.t(), model.bias, 64, FP32, kernel, None,
             "stored", True)
    eager = model(x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())
    torch.testing.assert_close(out.double(), float64_reference(model, x), rtol=1e-5, atol=1e-5 * eager.abs().max().item())


def test_awq_activation_of_the_wrong_k_names_the_layout():
    model = awq_int4(FP32, group_size=64)
    with pytest.raises(ValueError, match=r"the packed weight \[K, N / 8\] holds K=256"):
        OP(torch.randn(2, 128), model.qweight, model.shifts, model.scales.t(), model.qzeros.t(), None, 64, FP32, "torch",
           None, "stored", True)


# int8 storage: torchao's intx int4 (one value per int8, int8 zero points [N, K / g]).

def call_intx(model, x, kernel="torch"):
    return OP(x, model.qdata, None, model.scale, model.zero_point, model.bias, model.group_size, x.dtype, kernel)


@pytest.mark.parametrize("kernel", ["torch", "reference"])
@pytest.mark.parametrize("dtype, zero_points, values, packing", [
    (FP32, "int4", "int4", "int4_zero_points_fp32"),  # float32: qfuse's own kernel, eager's product
    (BF16, "zero", "int4", "int4pack_cpu"),  # zeros fold into the values: symmetric
    (BF16, "int4", "int4", "int4_zero_points_bf16"),  # bf16 would round ATen's float zero: qfuse's own kernel
    (FP16, "int4", "int4", "int4_zero_points_fp16"),
    (FP32, "wide", "int4", "dense"),  # zero points outside int4's range
    (FP16, "none", "int8", "dense"),  # values outside int4's range
])
def test_int8_storage_runs_int4_kernels_where_the_values_fit_and_a_dense_weight_elsewhere(
        kernel, dtype, zero_points, values, packing):
    model = torchao_intx_int4(dtype, group_size=32, zero_points=zero_points, values=values)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(3)).to(dtype)
    out, eager = call_intx(model, x, kernel), model(x)
    scale = eager.float().abs().max()
    tolerance = {BF16: 2**-7, FP16: 2**-10, FP32: 1e-5}[dtype]
    assert out.shape == eager.shape and (out.float() - eager.float()).abs().max() <= tolerance * scale
    assert (out.double() - x.double() @ model.reference_weight.t() - model.bias.double()).abs().max() <= tolerance * scale
    _, prepared = prepared_int4_weight(kernel, model.qdata, None, model.scale, model.zero_point, 32)
    if kernel == "torch":
        assert prepared.packing == packing
    elif zero_points == "zero":  # folded: the reference kernel got no zero points
        assert prepared.zero_point is None


def test_folded_zero_points_are_the_same_weight():
    values = torch.tensor([[3], [-8], [7], [0]], dtype=torch.int8)  # [K = 4, N = 1], groups of 2
    folded, zeros = folded_zero_points(values, torch.tensor([[-1], [1]], dtype=torch.int8), 2)
    assert zeros is None and folded.flatten().tolist() == [4, -7, 6, -1]
    folded, zeros = folded_zero_points(values, torch.tensor([[0], [0]], dtype=torch.int8), 2)
    assert zeros is None and torch.equal(folded, values)
    kept, zeros = folded_zero_points(values, torch.tensor([[1], [-1]], dtype=torch.int8), 2)  # -8 - 1 leaves int4
    assert torch.equal(kept, values) and zeros is not None


def test_opcheck_int8_storage():
    model = torchao_intx_int4(FP32, group_size=32, zero_points="int4")
    torch.library.opcheck(OP.default, (torch.randn(3, 256), model.qdata, None, model.scale, model.zero_point,
                                       model.bias, 32, FP32, "torch"))


@pytest.mark.parametrize("change, message", [
    (dict(shifts=torch.arange(0, 32, 4, dtype=torch.int32)), "an int8 [N, K] weight holds its values unpacked"),
    (dict(packed_zeros=torch.zeros(16, 8, dtype=torch.int32)), "packed_zeros must be int8 [N, K / group_size] = [128, 8]"),
    (dict(x=torch.randn(2, 128)), "activation has K=128 but the packed weight [N, K] holds K=256"),
])
def test_bad_int8_storage_operands_raise_naming_the_problem(change, message):
    model = torchao_intx_int4(FP32, group_size=32, zero_points="int4")
    args = dict(x=torch.randn(2, 256), packed=model.qdata, shifts=None, scales=model.scale,
                packed_zeros=model.zero_point, bias=model.bias, group_size=32, out_dtype=FP32, kernel="torch") | change
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        OP(**args)


def test_sorted_rows_with_zero_points_gather_the_activation():
    """Act order with zero points in bf16 (which ATen's CPU kernel cannot hold): qfuse's own CPU kernel takes the
    group-sorted rows, and the op gathers the activation's columns in their order."""
    model = gptq_packed_int4(BF16, group_size=64, symmetric=False, act_order=True)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(BF16)
    out = OP(x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias, 64, BF16, "torch", model.g_idx)
    _, prepared = prepared_int4_weight("torch", model.qweight, model.shifts, model.scales, model.qzeros, 64, model.g_idx)
    assert prepared.packing == "int4_zero_points_bf16" and prepared.input_order is not None
    reference = x.double() @ model.reference_weight.t() + model.bias.double()
    assert (out.double() - reference).abs().max() <= 2**-7 * reference.abs().max()


@pytest.mark.parametrize("kernel", ["torch", "reference"])
def test_gptq_zero_points_of_eight_fold_into_a_symmetric_weight(kernel):
    """Words whose zero points are all 8 (z - 8 = 0): the prepared weight has no zero points, and the
    result is the model's."""
    model = gptq_packed_int4(BF16, group_size=32, symmetric=False)
    model.qzeros = pack_int4_along_first(torch.full((128, 8), 8, dtype=torch.int32))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6)).to(BF16)
    _, prepared = prepared_int4_weight(kernel, model.qweight, model.shifts, model.scales, model.qzeros, 32)
    assert prepared.zero_point is None and prepared.packing != "dense"
    if kernel == "torch":  # ATen's float zero is 0: the layout of a symmetric weight
        assert torch.equal(prepared.scale[..., 1], torch.zeros_like(prepared.scale[..., 1]))
    eager = model(x)
    out = OP(x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias, 32, BF16, kernel)
    assert (out.float() - eager.float()).abs().max() <= 2**-7 * eager.float().abs().max()
