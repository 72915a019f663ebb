"""The Triton W4A16 kernel (`qfuse.kernels.triton.int4_mm`) against the peer GPTQ model and float64.

Without a GPU it runs in Triton's interpreter. Covered: bf16 / fp16 / fp32, symmetric and with zero
points, groups of 32 and 128 and per channel, groups narrower than the K step, K not a multiple of
the step, M = 0 / 1 / 17 and 3D through the op, stored shifts in another order, bias, the tile choice;
GPTQ's act order through the op (rows sorted by group once), zero points stored minus one (plus one
after the mask, a zero point of 16 included, or before it, AutoGPTQ's), AutoGPTQ's [K / 8, N]
tensors read transposed, AWQ's [K, N / 8] words packed along N (masked K steps included); torchao's int8
storage read value by value; the decode loop on nibble planes (`int4_planes`: K a multiple of 128,
groups of a multiple of 128 or per channel), on a GPU also its two-values-a-register dequantize.
"""

import pytest
import torch

pytest.importorskip("triton")

import qfuse.ops  # noqa: F401, E402  (registers torch.ops.qfuse)
from qfuse.kernels.triton.int4_mm import (BATCHED_PROGRAMS_PER_SM, BATCHED_TILES, DECODE_ROWS,  # noqa: E402
                                          pick_int4_config, triton_int4_mm)
from qfuse.kernels.triton.int4_planes import (PLANE_STEP, paired, permute_planes, plane_splits, plane_tile,  # noqa: E402
                                              takes_planes, triton_int4_planes_mm)
from qfuse.kernels.triton.weight_stream import batched_split_k, fit_block_k, split_k, step_meta  # noqa: E402
from tests.helpers import slow_when_interpreted  # noqa: E402
from tests.peers.weight_only_models import autogptq_int4, awq_int4, gptq_packed_int4, torchao_intx_int4  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOLERANCE = {BF16: 2**-7, FP16: 2**-10, FP32: 1e-5}  # one rounding of the output
# Triton's interpreter (3.9) computes bf16 dots wrong (garbage of 1e10 on a plain 16x16 bf16 tl.dot), so
# bf16 runs on a GPU only; fp16 takes its place elsewhere, the kernel's code being the same for both.
HALF = BF16 if DEVICE == "cuda" else FP16
DTYPES = [FP16, FP32, *([BF16] if DEVICE == "cuda" else [])]


def model_on_device(dtype, **kwargs):
    model = gptq_packed_int4(dtype, **kwargs).to(DEVICE)
    model.reference_weight = model.reference_weight.to(DEVICE)
    return model


def assert_matches(out, model, x):
    eager = model(x)
    assert out.dtype == eager.dtype and out.shape == eager.shape
    if x.numel() == 0:
        return
    reference = x.double() @ model.reference_weight.t()
    if model.bias is not None:
        reference = reference + model.bias.double()
    scale = reference.abs().max()
    assert (out.double() - reference).abs().max() <= TOLERANCE[x.dtype] * scale
    assert (out.double() - eager.double()).abs().max() <= 2 * TOLERANCE[x.dtype] * scale


def kernel_call(model, x, config=None, shifts="model", splits=None):
    shifts = model.shifts if shifts == "model" else shifts
    return triton_int4_mm(x.reshape(-1, x.shape[-1]), model.qweight, shifts, model.scales, model.qzeros, model.bias,
                          model.group_size, x.dtype, config=config, splits=splits).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 128, None], ids=["g32", "g128", "per_channel"])
def test_matches_the_model_and_float64(dtype, symmetric, group_size):
    model = model_on_device(dtype, group_size=group_size, symmetric=symmetric)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    assert_matches(kernel_call(model, x), model, x)


@slow_when_interpreted
@pytest.mark.parametrize("config", [(16, 32, 64, 1, 4, 2), (32, 64, 128, 8, 4, 2), (16, 16, 16, 1, 2, 1)],
                         ids=["two_groups_a_step", "four_groups_a_step", "step_in_group"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("m", [1, 17])
def test_tiles_and_k_splits(config, splits, m):
    model = model_on_device(HALF, group_size=32, symmetric=False, out_features=72)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(2)).to(HALF).to(DEVICE)
    assert_matches(kernel_call(model, x, config=config, splits=splits), model, x)


def test_k_not_a_multiple_of_the_step_per_channel():
    model = model_on_device(FP32, group_size=None, in_features=72, out_features=40)
    x = torch.randn(3, 72, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert not step_meta(64, 72, 72)["EVEN_K"]
    assert_matches(kernel_call(model, x, config=(16, 32, 64, 1, 4, 2)), model, x)


def test_stored_shifts_in_another_order_are_read():
    model = model_on_device(FP32, group_size=32, symmetric=False)
    model.shifts = model.shifts.flip(0).contiguous()  # the model now reads other nibbles: so must the kernel
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    eager = model(x)
    torch.testing.assert_close(kernel_call(model, x), eager, rtol=1e-5, atol=1e-5 * eager.abs().max().item())


@pytest.mark.parametrize("shape", [(0, 256), (1, 256), (2, 3, 256)], ids=["M0", "M1", "3D"])
def test_the_op_on_the_triton_kernel(shape):
    model = model_on_device(HALF, group_size=128, symmetric=False)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(6)).to(HALF).to(DEVICE)
    out = torch.ops.qfuse.int4_weight_only_mm(x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias,
                                              model.group_size, HALF, "triton")
    assert_matches(out, model, x)


def test_decode_tiles_and_k_splits_fill_the_gpu():
    block_m, block_n, block_k, *_ = pick_int4_config(1)
    assert block_m == DECODE_ROWS and pick_int4_config(4096)[0] >= 64
    splits = split_k(1, 4096, 4096, block_n, block_k, 132)
    assert splits == 4 and (4096 // block_n) * splits >= 132  # 64 column blocks alone leave half the GPU idle
    assert split_k(1, 4096, 256, 32, 256, 132) == 1  # one K step: nothing to split
    assert split_k(4096, 4096, 4096, 128, 128, 132) == 1


def test_the_step_never_straddles_groups_it_could_avoid():
    assert fit_block_k(128, 32, 4096) == 128  # four whole groups a step
    assert fit_block_k(64, 128, 4096) == 64  # a step inside one group
    assert fit_block_k(256, 4096, 4096) == 256  # per channel: one group, any step
    assert fit_block_k(64, 48, 4096) == 16  # groups of 48: steps of 16 (the capability takes multiples of 16)


def test_groups_of_48_take_steps_of_16():
    model = model_on_device(FP32, group_size=48, symmetric=False, in_features=192, out_features=24)
    x = torch.randn(2, 192, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    assert_matches(kernel_call(model, x, config=(16, 16, 64, 1, 2, 1)), model, x)


@pytest.mark.parametrize("symmetric", [True, False])
def test_act_order_through_the_op_sorts_the_rows_once(symmetric):
    """The kernel takes no g_idx: the op hands it the weight's rows sorted by group and the
    activation's columns in that order."""
    model = model_on_device(FP32, group_size=32, act_order=True, symmetric=symmetric, zeros_minus_one=not symmetric)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    out = torch.ops.qfuse.int4_weight_only_mm(x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias, 32,
                                              FP32, "triton", model.g_idx, "plus_one")
    assert_matches(out, model, x)


def test_a_zero_point_of_sixteen_plus_one_after_the_mask():
    """A stored 15 under "plus_one" is a zero point of 16, outside int4: the kernel and the op follow eager."""
    model = model_on_device(FP32, group_size=32, symmetric=False, zeros_minus_one=True)
    model.qzeros[0, 0] |= 0xF  # channel 0 of group 0 now has a zero point of 16
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    eager = model(x)
    tolerance = dict(rtol=1e-5, atol=1e-5 * eager.abs().max().item())
    kernel = triton_int4_mm(x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias, 32, FP32,
                            config=(16, 16, 16, 1, 2, 1), splits=2, zero_convention="plus_one")
    torch.testing.assert_close(kernel, eager, **tolerance)
    op = torch.ops.qfuse.int4_weight_only_mm(x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias, 32,
                                             FP32, "triton", None, "plus_one")
    torch.testing.assert_close(op, eager, **tolerance)


def test_autogptq_tensors_are_read_through_their_transposes():
    """Words [K / 8, N], zero points [K / g, N / 8] plus one before the mask, scales [K / g, N]."""
    model = autogptq_int4(HALF, group_size=64).to(DEVICE)  # g_idx = k // 64: groups in K order
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(10)).to(HALF).to(DEVICE)
    out = triton_int4_mm(x, model.qweight.t(), model.wf.reshape(8), model.scales.t(), model.qzeros.t(), model.bias, 64,
                         HALF, zero_convention="plus_one_mod_16")
    eager = model(x)
    reference = x.double() @ model.reference_weight.to(DEVICE).t() + model.bias.double()
    scale = reference.abs().max()
    assert (out.double() - reference).abs().max() <= TOLERANCE[HALF] * scale
    assert (out.double() - eager.double()).abs().max() <= 2 * TOLERANCE[HALF] * scale


@pytest.mark.parametrize("in_features, config", [(256, (16, 32, 64, 1, 4, 2)), (96, (16, 16, 64, 1, 2, 1))],
                         ids=["even_k", "k_not_a_multiple_of_the_step"])
@pytest.mark.parametrize("splits", [1, 2])
def test_awq_words_packed_along_n(in_features, config, splits):
    """AWQ's words at a forced tile; `test_awq_batched_decode_takes_its_bucket_tile` runs the default ones."""
    model = awq_int4(HALF, group_size=32, unpack_order="shifts", in_features=in_features).to(DEVICE)
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(11)).to(HALF).to(DEVICE)
    out = triton_int4_mm(x, model.qweight, model.shifts, model.scales.t(), model.qzeros.t(), model.bias, 32, HALF,
                         config=config, splits=splits, packed_along_n=True)
    eager = model(x)
    reference = x.double() @ model.reference_weight.to(DEVICE).t() + model.bias.double()
    scale = reference.abs().max()
    assert (out.double() - reference).abs().max() <= TOLERANCE[HALF] * scale
    assert (out.double() - eager.double()).abs().max() <= 2 * TOLERANCE[HALF] * scale


@pytest.mark.parametrize("rows", [17, 40, 128])
def test_awq_batched_decode_takes_its_bucket_tile(rows):
    """16 < M <= 128 on AWQ's words: the bucket's tile of `BATCHED_TILES` and its split rule."""
    model = awq_int4(HALF, group_size=64, unpack_order="shifts", in_features=256).to(DEVICE)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(12)).to(HALF).to(DEVICE)
    out = triton_int4_mm(x, model.qweight, model.shifts, model.scales.t(), model.qzeros.t(), model.bias, 64, HALF,
                         packed_along_n=True)
    reference = x.double() @ model.reference_weight.to(DEVICE).t() + model.bias.double()
    assert (out.double() - reference).abs().max() <= TOLERANCE[HALF] * reference.abs().max()
    assert [batched_split_k(rows_bound, 4096, 4096, BATCHED_TILES[rows_bound], BATCHED_PROGRAMS_PER_SM, 132)
            for rows_bound in BATCHED_TILES] == [4, 4, 4]  # 64 column blocks: four splits make 2 programs an SM


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_points, values", [("none", "int4"), ("int4", "int4"), ("wide", "int8")])
@pytest.mark.parametrize("in_features, config, splits", [(256, (16, 32, 64, 1, 4, 2), 1), (96, (16, 16, 64, 1, 2, 1), 2)],
                         ids=["even_k", "masked_k_split"])
def test_int8_storage_is_read_value_by_value(dtype, zero_points, values, in_features, config, splits):
    """torchao's intx storage (int8 [N, K] values, int8 zero points [N, K / g]): the kernel reads the
    values as they are, out of int4's range included, and matches the model and float64."""
    model = torchao_intx_int4(dtype, group_size=32, zero_points=zero_points, values=values, in_features=in_features,
                              out_features=48).to(DEVICE)
    model.reference_weight = model.reference_weight.to(DEVICE)
    x = torch.randn(3, in_features, generator=torch.Generator().manual_seed(5)).to(device=DEVICE, dtype=dtype)
    out = triton_int4_mm(x, model.qdata, None, model.scale, model.zero_point, model.bias, 32, dtype, config=config,
                         splits=splits)
    assert_matches(out, model, x)


@pytest.mark.parametrize("zero_points", ["none", "int4"])
def test_int8_storage_takes_the_batched_tiles(zero_points):
    """intx at 17-128 rows: the batched bucket's tile (its own launch, no config given), as eager."""
    model = torchao_intx_int4(FP16, group_size=32, zero_points=zero_points, values="int4", in_features=256,
                              out_features=64).to(DEVICE)
    model.reference_weight = model.reference_weight.to(DEVICE)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(6)).to(device=DEVICE, dtype=FP16)
    assert_matches(triton_int4_mm(x, model.qdata, None, model.scale, model.zero_point, model.bias, 32, FP16), model, x)


@pytest.mark.parametrize("dtype", DTYPES)
@slow_when_interpreted
@pytest.mark.parametrize("symmetric, zeros_minus_one", [(True, False), (False, False), (False, True)],
                         ids=["symmetric", "zero_points", "zero_points_minus_one"])
@pytest.mark.parametrize("group_size", [128, 256, None], ids=["g128", "g256", "per_channel"])
@pytest.mark.parametrize("m, splits", [(1, 1), (16, 2), (7, 4)])
def test_nibble_planes_match_the_model_and_float64(dtype, symmetric, zeros_minus_one, group_size, m, splits):
    model = model_on_device(dtype, group_size=group_size, symmetric=symmetric, zeros_minus_one=zeros_minus_one,
                            in_features=512, out_features=72)  # 72 columns: a masked column block
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(12)).to(dtype).to(DEVICE)
    convention = "plus_one" if zeros_minus_one else "stored"
    out = triton_int4_planes_mm(x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias,
                                model.group_size, dtype, 132, splits=splits, zero_convention=convention)
    assert_matches(out, model, x)
    auto = triton_int4_mm(x, model.qweight, model.shifts, model.scales, model.qzeros, model.bias, model.group_size,
                          dtype, splits=splits, zero_convention=convention)
    assert torch.equal(auto, out)  # the kernel's own choice at decode


@pytest.mark.parametrize("dtype", [FP16, *([BF16] if DEVICE == "cuda" else [])])
@pytest.mark.parametrize("shifts", ["stored", "stored_in_another_order", "computed"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_points"])
def test_nibble_planes_dequantize_exactly_as_eager(dtype, shifts, symmetric):
    """One-hot rows read single weights back: each is eager's (q - z).to(dtype) * s bit for bit (on a GPU
    the paired dequantize: the nibble-order asm for computed shifts and a stored table in that order,
    the shifted one for a table in another order)."""
    model = model_on_device(dtype, group_size=128, symmetric=symmetric, bias=False, out_features=72)
    if shifts == "stored_in_another_order":
        model.shifts = model.shifts.flip(0).contiguous()
    columns = torch.randperm(256, generator=torch.Generator().manual_seed(14))[:16]
    one_hot = torch.zeros(16, 256, dtype=dtype)
    one_hot[torch.arange(16), columns] = 1
    one_hot = one_hot.to(DEVICE)
    out = triton_int4_planes_mm(one_hot, model.qweight, None if shifts == "computed" else model.shifts, model.scales,
                                model.qzeros, None, model.group_size, dtype, 132, splits=1)
    assert torch.equal(out, model(one_hot))


def test_nibble_planes_read_stored_shifts_in_another_order_and_computed_ones():
    model = model_on_device(HALF, group_size=128, symmetric=False)
    model.shifts = model.shifts.flip(0).contiguous()
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(13)).to(HALF).to(DEVICE)
    eager = model(x)
    torch.testing.assert_close(kernel_call(model, x), eager, rtol=2**-9, atol=2**-9 * eager.abs().max().item())
    model.shifts = model.shifts.flip(0).contiguous()
    assert torch.equal(kernel_call(model, x, shifts=None), kernel_call(model, x))


def test_nibble_planes_take_whole_steps_in_one_group():
    assert takes_planes(4096, 128, False, False) and takes_planes(4096, 4096, False, False)
    assert not takes_planes(4096, 32, False, False)  # four groups a step: `int4_dot`
    assert not takes_planes(4160, 4160, False, False)  # K not whole steps
    assert not takes_planes(4096, 128, True, False) and not takes_planes(4096, 128, False, True)  # AWQ, int8 storage
    assert all(plane_tile(rows).block_k == PLANE_STEP == 128 for rows in (1, 16, 32, 256))  # one step a tile
    # splits until the grid holds 4 programs a multiprocessor at decode (H100: 132), 1 at 128 rows, each
    # split at least 8 steps deep
    shapes = ((4096, 4096), (14336, 4096), (4096, 14336))
    assert [plane_splits(16, n, k, 16, 64, 132) for n, k in shapes] == [4, 2, 8]
    assert [plane_splits(128, n, k, 128, 128, 132) for n, k in shapes] == [4, 1, 4]
    assert [plane_splits(256, n, k, 128, 128, 132) for n, k in shapes] == [2, 1, 2]  # two row blocks
    assert plane_splits(1, 4096, 128, 16, 64, 132) == 1  # one step: nothing to split
    assert [plane_tile(m)[0] for m in (1, 16, 17, 33, 128, 129, 256)] == [16, 16, 32, 64, 128, 128, 128]
    assert not paired(torch.float32, torch.float32, torch.device(DEVICE))
    assert not paired(torch.bfloat16, torch.float32, torch.device(DEVICE))  # the scale's rounding would differ


def test_permute_planes_puts_nibble_i_of_word_j_at_16_i_plus_j():
    x = torch.arange(256.0).reshape(1, 256)
    xp = permute_planes(x)
    assert xp[0, 16 * 3 + 5].item() == 8 * 5 + 3 and xp[0, 128 + 16 * 7 + 15].item() == 128 + 8 * 15 + 7
