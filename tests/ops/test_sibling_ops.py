"""`qfuse::<op>_siblings`: one call for the fused linears that read one activation equals its members' calls
side by side, for every kernel: run as one call on the concatenated weight where the kernel runs siblings
(the `torch` kernel's int4; on this CPU the 8-bit one-call path with the `torch` kernel declared to run them),
member by member otherwise; opcheck; bad lists named."""

import pytest
import torch

from qfuse.kernels import prepared
from qfuse.kernels.torch_native import TorchKernel
from qfuse.ops.siblings import SIBLING_ARGUMENTS
from tests.peers.weight_only_models import pack_int4_along_first, pack_int4_along_last

BF16 = torch.bfloat16
K, GROUP = 256, 64


def int4_member(n: int, zero_points: bool, seed: int):
    """GPTQ's tensors of one member: words [N, K / 8], bf16 scales [N, K / g], zero points [N / 8, K / g] or None."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, K), generator=generator, dtype=torch.int32)
    scales = ((torch.rand(n, K // GROUP, generator=generator) + 0.5) / 16).to(BF16)
    zeros = torch.randint(0, 16, (n, K // GROUP), generator=generator, dtype=torch.int32) if zero_points else None
    return pack_int4_along_last(values), scales, None if zeros is None else pack_int4_along_first(zeros)


def int4_call(x, members, kernel, bias=None):
    return SIBLING_ARGUMENTS["int4_weight_only_mm"](
        x=x, packed=[m[0] for m in members], shifts=[None] * len(members), scales=[m[1] for m in members],
        packed_zeros=[m[2] for m in members], bias=bias or [None] * len(members), group_size=GROUP,
        out_dtype=BF16, kernel=kernel, g_idx=[None] * len(members))


def each_member(call, form: str):
    from qfuse.ops.siblings import SIBLING_FORMS, members

    return torch.cat([member.op(*member.as_args()) for member in members(SIBLING_FORMS[form], call)], dim=-1)


@pytest.mark.parametrize("kernel", ["torch", "reference"])
@pytest.mark.parametrize("lead", [(0,), (1,), (5,), (2, 3)], ids=["M0", "M1", "M5", "3D"])
@pytest.mark.parametrize("zero_points", [(False, False, False), (False, True, False)], ids=["sym", "one-asym"])
def test_int4_siblings_equal_their_members(kernel, lead, zero_points):
    members = [int4_member(n, zeros, seed) for seed, (n, zeros) in enumerate(zip((128, 64, 64), zero_points))]
    generator = torch.Generator().manual_seed(len(lead))
    x = torch.randn(*lead, K, generator=generator).to(BF16)
    bias = [torch.randn(n, generator=generator).to(BF16) for n in (128, 64, 64)]
    call = int4_call(x, members, kernel, bias)
    out = call.op(*call.as_args())
    expected = each_member(call, "int4_weight_only_mm")
    assert out.shape == (*lead, 256) and out.dtype == BF16
    if out.numel():  # each within one rounding of bf16 of the exact sum (a member with zero points makes the
        scale = expected.float().abs().max()  # concatenation dense on this CPU kernel): two apart at most
        assert (out.float() - expected.float()).abs().max() <= 2 * 2**-7 * scale


def test_int4_siblings_prepare_their_concatenation_once():
    members = [int4_member(n, False, seed) for seed, n in enumerate((64, 32))]
    x = torch.randn(3, K).to(BF16)
    call = int4_call(x, members, "torch")
    call.op(*call.as_args())
    count = prepared.cached_weight_count()
    for _ in range(3):
        call.op(*call.as_args())
    assert prepared.cached_weight_count() == count


def _8bit_call(form, x, kernel, scales, zero_points=None, biases=None):
    generator = torch.Generator().manual_seed(0)
    widths = [48, 16, 32]
    b = [torch.randint(-128, 128, (K, n), generator=generator, dtype=torch.int8) for n in widths]
    biases = biases or [None] * 3
    zero_points = zero_points or [None] * 3
    if form == "scaled_mm":
        a = torch.randint(-128, 128, (*x.shape[:-1], K), generator=generator, dtype=torch.int8)
        return SIBLING_ARGUMENTS[form](a=a, b=b, scale_a=torch.rand(*x.shape[:-1], 1) / 100, scale_b=scales,
                                       bias=biases, azp_a=None, azp_b=zero_points, out_dtype=BF16, kernel=kernel)
    return SIBLING_ARGUMENTS[form](x=x, b=b, scale_b=scales, bias=biases, azp_b=zero_points, out_dtype=BF16,
                                   kernel=kernel)


SCALES = {  # per member: one value, one a column, none
    "mixed": lambda: [torch.tensor(0.01), torch.rand(16) / 100, None],
    "per column": lambda: [torch.rand(48) / 100, torch.rand(1, 16) / 100, torch.rand(32) / 100],
}


@pytest.mark.parametrize("one_call", [False, True], ids=["member-by-member", "one-call"])
@pytest.mark.parametrize("scales", list(SCALES))
@pytest.mark.parametrize("form", ["scaled_mm", "weight_only_scaled_mm"])
def test_8bit_siblings_equal_their_members(form, scales, one_call, monkeypatch):
    """The one-call path (declared for the `torch` kernel here: on this CPU no kernel runs 8-bit siblings) reads a
    one-value scale as its column of a per-column one, a missing scale as ones, missing biases and zero points as
    zeros."""
    if one_call:
        monkeypatch.setattr(TorchKernel, "runs_siblings_of", ("scaled_mm", "weight_only_scaled_mm"))
    x = torch.randn(5, K).to(BF16)
    zero_points = [None, torch.tensor(3, dtype=torch.int32), None] if form == "weight_only_scaled_mm" else None
    biases = [torch.randn(48).to(BF16), None, torch.randn(32).to(BF16)]
    call = _8bit_call(form, x, "torch", SCALES[scales](), zero_points, biases)
    out = call.op(*call.as_args())
    expected = each_member(call, form)
    assert out.shape == (5, 96)
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=2**-7 * expected.float().abs().max().item())


def test_block_scales_run_member_by_member(monkeypatch):
    """Block scales concatenate along N only on whole blocks: the op runs its members in turn."""
    monkeypatch.setattr(TorchKernel, "runs_siblings_of", ("weight_only_scaled_mm",))
    x = torch.randn(2, K).to(BF16)
    generator = torch.Generator().manual_seed(0)
    b = [torch.randint(-128, 128, (K, n), generator=generator, dtype=torch.int8) for n in (128, 256)]
    scales = [torch.rand(2, 1) / 100, torch.rand(2, 2) / 100]
    call = SIBLING_ARGUMENTS["weight_only_scaled_mm"](x=x, b=b, scale_b=scales, bias=[None, None],
                                                      azp_b=[None, None], out_dtype=BF16, kernel="reference")
    torch.testing.assert_close(call.op(*call.as_args()), each_member(call, "weight_only_scaled_mm"))


@pytest.mark.parametrize("form", list(SIBLING_ARGUMENTS))
def test_opcheck(form):
    x = torch.randn(3, K).to(BF16)
    if form == "int4_weight_only_mm":
        call = int4_call(x, [int4_member(n, False, seed) for seed, n in enumerate((64, 32))], "torch")
    else:
        call = _8bit_call(form, x, "torch", SCALES["per column"]())
    torch.library.opcheck(call.op, call.as_args())


def test_lists_of_different_lengths_are_named():
    x = torch.randn(3, K).to(BF16)
    call = int4_call(x, [int4_member(n, False, seed) for seed, n in enumerate((64, 32))], "torch")
    with pytest.raises(ValueError, match="must be lists of one length"):
        call.op(*call._replace(scales=call.scales[:1]).as_args())


def test_a_bad_member_is_named_as_its_op_names_it(monkeypatch):
    monkeypatch.setattr(TorchKernel, "runs_siblings_of", ("weight_only_scaled_mm",))
    x = torch.randn(3, K).to(BF16)
    call = _8bit_call("weight_only_scaled_mm", x, "torch", SCALES["per column"](),
                      biases=[torch.randn(47).to(BF16), None, None])
    with pytest.raises(ValueError, match=r"bias must have shape \[48\]"):
        call.op(*call.as_args())


@pytest.mark.parametrize("form", list(SIBLING_ARGUMENTS))
def test_the_cache_keeps_no_activation_and_no_weight_alive(form, monkeypatch):
    """A prepared concatenation must not hold the call's tensors: under CUDA graphs an activation kept alive is a
    pool tensor no output tracks (an error at the next recording), and a kept weight outlives its model."""
    import gc
    import weakref

    monkeypatch.setattr(TorchKernel, "runs_siblings_of", tuple(SIBLING_ARGUMENTS))
    x = torch.randn(3, K).to(BF16)
    if form == "int4_weight_only_mm":
        biases = [torch.randn(64).to(BF16), None]
        call = int4_call(x, [int4_member(n, False, seed) for seed, n in enumerate((64, 32))], "torch", biases)
    else:
        biases = [torch.randn(48).to(BF16), None, None]
        call = _8bit_call(form, x, "torch", SCALES["per column"](), biases=biases)
    call.op(*call.as_args())
    activation, bias = weakref.ref(call[0]), weakref.ref(biases[0])
    del x, call, biases
    gc.collect()
    assert activation() is None and bias() is None
