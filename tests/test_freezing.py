"""Under freezing (`torch._inductor.config.freezing`, Inductor's recipe for CPU inference) qfuse
fuses what it fuses without it: the peer forms compiled both ways give the same records (fused or
not, family, scheme, the reason of a near miss) and eager's numbers.

Freezing folds every computation on constants into new constants before Inductor's post-grad
passes; a weight-only linear's dequantize (int4 words unpacked, an fp8 weight cast up, times its
scales) would reach a post-grad pass as a float weight with nothing left to fuse (and four times
the int4 memory), so qfuse runs in the joint-graph stage there (`qfuse.passes.core.manager`), except for
PT2E's linears, which freezing lowers to oneDNN itself (tests/peers/test_torchao.py)."""

import pytest
import torch

import qfuse
from qfuse.config import pass_skipping_caches_off
from qfuse.kernels import get_kernel
from qfuse.platform import current_platform
from tests.passes.test_reference_linear import int_mm_linear, operands
from tests.peers import weight_only_models as wo
from tests.peers.vllm_fallbacks import VllmFp8Linear

BF16 = torch.bfloat16


class ReferenceW8A8(torch.nn.Module):
    """The hand-written int8 W8A8 form, its int8 weight and scales held by the module."""

    def __init__(self) -> None:
        super().__init__()
        _, w, w_scale, bias = operands((4, 64))
        self.register_buffer("w", w)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("bias", bias)

    def forward(self, x):
        return int_mm_linear(x, self.w, self.w_scale, self.bias)


FORMS = {  # name -> (model builder, input)
    "reference_w8a8": (ReferenceW8A8, lambda: torch.randn(5, 64)),
    "vllm_fp8_row_wise": (lambda: VllmFp8Linear(64, 48, "row_wise", dynamic=True), lambda: torch.randn(5, 64)),
    "hand_written_int8": (lambda: wo.hand_written_int8(BF16, scale_after_matmul=False), lambda: wo.example_input(64, BF16)),
    "gptq": (lambda: wo.gptq_packed_int4(BF16), lambda: wo.example_input(256, BF16)),
    "gptq_act_order": (lambda: wo.gptq_packed_int4(BF16, act_order=True), lambda: wo.example_input(256, BF16)),
    "compressed_tensors_w4a16": (lambda: wo.compressed_tensors_w4a16(BF16), lambda: wo.example_input(256, BF16)),
    "awq": (lambda: wo.awq_int4(BF16), lambda: wo.example_input(256, BF16)),
    # (8 rows: above, on an AMX CPU, Inductor's dequantize + mm of int4 stored a byte a value is faster)
    "torchao_intx": (lambda: wo.torchao_intx_int4(BF16), lambda: wo.example_input(256, BF16, tokens=8)),
    "fp8_weight_only": (lambda: wo.fp8_weight_only(BF16), lambda: wo.example_input(256, BF16)),
}


#: the forms no CPU kernel of this machine takes: fp8 block weights where oneDNN does not run (it needs AVX-512
#: VNNI or AMX)
_NO_KERNEL_HERE = set() if get_kernel("onednn").is_supported(current_platform("cpu"))[0] else {"fp8_weight_only"}


def compiled_records(model, x, freezing: bool):
    torch._dynamo.reset()
    with torch._inductor.config.patch(freezing=freezing), pass_skipping_caches_off(), torch.no_grad():
        marker = qfuse.graphs_compiled()
        out = torch.compile(model, backend="qfuse")(x)
        reports = qfuse.reports_since(marker)
    assert len(reports) == 1, "one report per graph: qfuse ran in one stage"
    return out, [(r.fused, r.family, r.scheme, r.reason) for r in reports[0].records]


@pytest.mark.parametrize("form", list(FORMS))
def test_freezing_fuses_what_qfuse_fuses_without_it(form):
    build, example = FORMS[form]
    try:
        model, x = build(), example()
    except ImportError as error:  # a peer package that is not installed (compressed-tensors)
        pytest.skip(f"{form}: {error}")
    with torch.no_grad():
        expected = model(x)
    _, unfrozen = compiled_records(model, x, freezing=False)
    out, frozen = compiled_records(model, x, freezing=True)
    assert frozen == unfrozen and frozen, (frozen, unfrozen)
    assert all(fused for fused, *_ in frozen) == (form not in _NO_KERNEL_HERE), frozen
    assert "internal error" not in repr(frozen)
    tolerance = 1e-5 if x.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize("form", ["gptq", "gptq_act_order", "compressed_tensors_w4a16", "torchao_intx"])
def test_frozen_cpu_int4_weight_is_packed_at_compile_time(form):
    """On the CPU the int4 linear's weight is a constant under freezing: the lowering packs it at
    compile time and the generated code calls ATen's int4pack kernel itself, with no Python op (the
    same kernel on the same packing: the same output, bit for bit)."""
    build, example = FORMS[form]
    try:
        model, x = build(), example()
    except ImportError as error:
        pytest.skip(f"{form}: {error}")
    unfrozen, _ = compiled_records(model, x, freezing=False)
    torch._dynamo.reset()
    with torch._inductor.config.patch(freezing=True), pass_skipping_caches_off(), torch.no_grad():
        marker = qfuse.graphs_compiled()
        frozen = torch.compile(model, backend="qfuse")(x)
        (record,) = qfuse.reports_since(marker)[-1].fused
    assert record.lowered.startswith("ATen's _weight_int4pack_mm_for_cpu on the frozen weight"), record.lowered
    assert torch.equal(frozen, unfrozen)


def test_a_frozen_compile_of_another_model_of_the_same_shapes_gets_its_own_weights():
    """Inductor keys frozen parameters by shape and dtype only; the int4 weight qfuse packs at compile
    time is a constant of its own, so a frozen graph is not cached (`QfusePass.uuid`): the second
    model, same shapes, other weights, computes with its own."""
    x = wo.example_input(256, BF16)
    with torch._inductor.config.patch(freezing=True, fx_graph_cache=True), torch.no_grad():
        for seed in (0, 1):
            torch._dynamo.reset()
            model = wo.gptq_packed_int4(BF16, seed=seed)
            out = torch.compile(model, backend="qfuse")(x)
            torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2 * model(x).abs().max().item())


def test_a_training_graph_is_not_taken_in_the_joint_stage():
    """freezing=True with autograd on: Inductor does not freeze, and qfuse's joint-stage pass leaves
    a forward + backward graph alone."""
    from qfuse.passes.core.manager import _is_training_graph

    graph = torch.fx.Graph()
    graph.placeholder("primals_1"), graph.placeholder("tangents_1")
    assert _is_training_graph(graph)
    inference = torch.fx.Graph()
    inference.placeholder("arg0_1")
    assert not _is_training_graph(inference)


def test_a_near_miss_of_the_joint_stage_is_no_float_matmul_of_the_post_grad_stage():
    """Under freezing the joint stage records AWQ's float32 linear at 144 rows as a near miss (the CPU int4 kernels
    take up to 128 rows); the post-grad stage sees the same linear as a new matmul node, computed from the stored
    int32 words that freezing keeps: it is no float matmul (it was listed as one beside the near miss)."""
    model, x = wo.awq_int4(torch.float32), wo.example_input(256, torch.float32, tokens=144)
    torch._dynamo.reset()
    with torch._inductor.config.patch(freezing=True), pass_skipping_caches_off(), torch.no_grad():
        marker = qfuse.graphs_compiled()
        torch.compile(model, backend="qfuse")(x)
    (report,) = qfuse.reports_since(marker)
    assert len(report.near_misses) == 1 and not report.float_matmuls, report.table()
