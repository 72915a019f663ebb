"""Weight-only quantized linears (issue #14) in the forms real code writes: each runs eagerly with the
weight its builder drew, compiles with plain Inductor to the same numbers, and its post-grad graph
holds the ATen ops that characterise it (so a change of form upstream fails here).

The form tests involve no qfuse pass (qfuse fuses only the bf16 int8 forms so far: the last test
checks those with backend="qfuse"). The graph is the one a qfuse pass would
see (`post_grad_custom_post_pass` runs after Inductor's own post-grad patterns), so where Inductor
already rewrites a form (its int8 weight-only pattern, `woq_int8` -> `_weight_int8pack_mm`), the
graph shows the rewrite, and where Inductor's rewrite fails the compile, a test says so.
Op names below are `namespace.op` or `namespace.op.overload`; `inductor.woq_int8` stands for the node
Inductor's weight-only lowering pattern leaves in the graph. Casts are `source->target` dtypes of
`prims.convert_element_type`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.nn import functional as F

from qfuse.config import pass_skipping_caches_off
from tests.peers import weight_only_models as wo

FP32, BF16 = torch.float32, torch.bfloat16
INDUCTOR_WOQ_INT8 = "inductor.woq_int8"
_OP_IN_CODE = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.(\w+)\(")


@dataclass
class PostGradGraph:
    code: str
    ops: set[str] = field(default_factory=set)  # "aten.mm" and "aten.mm.default"
    casts: set[str] = field(default_factory=set)  # "int8->bfloat16"


def short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def summarize(graph: torch.fx.Graph) -> PostGradGraph:
    code = graph.python_code("self").src
    summary = PostGradGraph(code)
    for namespace, op, overload in _OP_IN_CODE.findall(code):
        summary.ops |= {f"{namespace}.{op}", f"{namespace}.{op}.{overload}"}
    if "torch__inductor_fx_passes_quantization_woq_int8" in code:
        summary.ops.add(INDUCTOR_WOQ_INT8)
    for node in graph.find_nodes(op="call_function", target=torch.ops.prims.convert_element_type.default):
        summary.casts.add(f"{short(node.args[0].meta['val'].dtype)}->{short(node.args[1])}")
    return summary


class PostGradRecorder(CustomGraphPass):
    """Hands a summary of every post-grad graph to `sink` (a list's `append`: Inductor deep-copies its
    configuration, and a builtin method copies as itself, so the summaries land in the caller's list)."""

    def __init__(self, sink) -> None:
        self.sink = sink

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.sink(summarize(graph))

    def uuid(self) -> None:
        return None  # compiled with the caches off


def compile_with_inductor(model, x):
    """Plain Inductor, caches off; returns the output and the post-grad graphs."""
    graphs: list[PostGradGraph] = []
    torch._dynamo.reset()
    recorder = PostGradRecorder(graphs.append)
    with pass_skipping_caches_off(), torch._inductor.config.patch(post_grad_custom_post_pass=recorder):
        out = torch.compile(model)(x)
    return out, graphs


def assert_close_relative(actual, expected, tolerance):
    """Max abs difference within `tolerance` times the largest expected magnitude."""
    error = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    assert error <= tolerance * scale, f"max abs error {error:.3e} > {tolerance:g} * {scale:.3e}"


TOLERANCE = {FP32: 1e-5, BF16: 2e-2}
FLOAT_CASTS = ("->float32", "->bfloat16")  # as `absent_casts`: nothing in the graph is cast to a float dtype


def check_form(model, x, ops=(), casts=(), absent=(), absent_casts=()) -> PostGradGraph:
    """Eager matches the builder's reference weight, the compiled model matches eager, in one graph,
    and that graph holds `ops` and `casts`, none of `absent`, and no cast whose name contains one of
    `absent_casts`."""
    bias = getattr(model, "bias", None)
    with torch.no_grad():
        eager = model(x)
        reference = F.linear(x.double(), model.reference_weight, None if bias is None else bias.double())
        out, graphs = compile_with_inductor(model, x)
    assert eager.dtype == x.dtype and out.dtype == x.dtype
    assert_close_relative(eager, reference, TOLERANCE[x.dtype])
    assert_close_relative(out, eager, TOLERANCE[x.dtype])
    assert len(graphs) == 1, f"{len(graphs)} graphs (graph breaks)"
    (graph,) = graphs
    assert set(ops) <= graph.ops, f"missing {set(ops) - graph.ops}\n{graph.code}"
    assert set(casts) <= graph.casts, f"missing casts {set(casts) - graph.casts} (has {graph.casts})\n{graph.code}"
    assert not set(absent) & graph.ops, f"unexpected {set(absent) & graph.ops}\n{graph.code}"
    unexpected_casts = {cast for cast in graph.casts if any(part in cast for part in absent_casts)}
    assert not unexpected_casts, f"unexpected casts {unexpected_casts}\n{graph.code}"
    return graph


def build(builder, *args, **kwargs):
    """The model, or a skip naming what is missing when the peer package is not installed."""
    try:
        return builder(*args, **kwargs)
    except ImportError as error:
        pytest.skip(f"{builder.__name__}: {error}")


# --- 1. int8 weight-only written by hand ------------------------------------------------------------------


@pytest.mark.parametrize("dtype, three_d", [(FP32, True), (BF16, False)], ids=["fp32-3D", "bf16-2D"])
def test_int8_scale_in_the_weight_is_a_float_linear_on_a_dequantized_weight(dtype, three_d):
    model = wo.hand_written_int8(dtype, scale_after_matmul=False)
    check_form(model, wo.example_input(64, dtype, three_d),
               ops={"aten.mul", "aten.permute", "aten.addmm"}, casts={f"int8->{short(dtype)}"},
               absent={INDUCTOR_WOQ_INT8, "aten.mm"})


def test_int8_scale_after_the_matmul_is_mm_of_the_upcast_weight_then_mul():
    """bf16 with a 3-D input, which Inductor's weight-only pattern does not take (fp32: the torchao
    test below has the same graph)."""
    model = wo.hand_written_int8(BF16, scale_after_matmul=True)
    check_form(model, wo.example_input(64, BF16, three_d=True),
               ops={"aten.reshape", "aten.permute", "aten.mm", "aten.mul", "aten.add"}, casts={"int8->bfloat16"},
               absent={INDUCTOR_WOQ_INT8})


def test_int8_scale_after_the_matmul_in_bf16_2d_is_taken_by_inductors_weight_only_pattern():
    """Inductor's own pattern (bf16 activation, bf16 scale, int8 weight, `mm(x, w.t().to(bf16)) * s`
    with no reshape between) replaces the linear before any custom post-grad pass sees it; it lowers
    to `aten._weight_int8pack_mm`. With a 3-D input (reshape around the mm) it does not match."""
    model = wo.hand_written_int8(BF16, scale_after_matmul=True)
    check_form(model, wo.example_input(64, BF16, three_d=False),
               ops={INDUCTOR_WOQ_INT8, "aten.add"}, absent={"aten.mm", "prims.convert_element_type"})


def test_inductors_weight_only_pattern_fails_the_compile_when_the_scale_is_cast_in_the_graph():
    """A float32 scale cast to bf16 in the forward (`* scale.to(x.dtype)`): Inductor's pattern still
    matches (it checks the dtype of the cast's result), and its lowering asserts on the unrealized
    cast (`ir.Pointwise`). Plain Inductor cannot compile this form (torch 2.13, CPU); eager runs."""
    model = wo.hand_written_int8(BF16, scale_after_matmul=True, scale_dtype=FP32)
    x = wo.example_input(64, BF16, three_d=False)
    with torch.no_grad():
        model(x)
        with pytest.raises(torch._inductor.exc.InductorError, match="Pointwise"):
            compile_with_inductor(model, x)


# --- 2. torchao quantize_ ---------------------------------------------------------------------------------


def test_torchao_int8_weight_only_fp32_is_mm_of_the_upcast_weight_times_the_row_scale():
    model = build(wo.torchao_int8_weight_only, FP32)
    check_form(model, wo.example_input(128, FP32, three_d=False),
               ops={"aten.permute", "aten.mm", "aten.mul", "aten.add"}, casts={"int8->float32"},
               absent={INDUCTOR_WOQ_INT8})


def test_torchao_int8_weight_only_bf16_is_taken_by_inductors_weight_only_pattern():
    """torchao reshapes the activation to 2-D itself, so Inductor's pattern matches in 3-D too; the
    fp32 scale's cast to bf16 sits behind a reshape and lowers fine here (compare the test above)."""
    model = build(wo.torchao_int8_weight_only, BF16)
    check_form(model, wo.example_input(128, BF16, three_d=True),
               ops={INDUCTOR_WOQ_INT8, "aten.add"}, casts={"float32->bfloat16"}, absent={"aten.mm"})


def test_torchao_int8_weight_only_per_group_dequantizes_the_weight_then_runs_a_float_mm():
    model = build(wo.torchao_int8_weight_only, BF16, granularity="per_group_32")
    check_form(model, wo.example_input(128, BF16, three_d=True),
               ops={"aten.sub", "aten.mul", "aten.permute", "aten.mm"}, casts={"int8->bfloat16"},
               absent={INDUCTOR_WOQ_INT8})


def test_torchao_int8_weight_only_per_tensor_bf16_fails_in_inductors_weight_only_kernel():
    """Inductor's pattern takes a per-tensor scale (`[1]`) too, and `_weight_int8pack_mm` on CPU wants
    one scale per output channel: the compile fails (torch 2.13); eager and fp32 run."""
    model = build(wo.torchao_int8_weight_only, BF16, granularity="per_tensor")
    x = wo.example_input(128, BF16)
    with torch.no_grad():
        model(x)
        with pytest.raises((torch._inductor.exc.InductorError, RuntimeError), match="expect scales to be 1d tensor"):
            compile_with_inductor(model, x)


@pytest.mark.parametrize("packing_format", wo.TORCHAO_INT4_PACKING_FORMATS)
def test_torchao_int4_weight_only_config(packing_format):
    """`Int4WeightOnlyConfig` has no CPU packing format in torchao 0.18: each is skipped with torchao's
    own error. Should one start to run here, it must at least compile and match eager."""
    pytest.importorskip("torchao")
    try:
        model = wo.torchao_int4_weight_only(BF16, packing_format)
    except Exception as error:  # torchao's refusal (ImportError, NotImplementedError, AssertionError)
        why = f"{type(error).__name__}: {error}"
        pytest.skip(f"Int4WeightOnlyConfig({packing_format!r}) does not run on this CPU: {why}")
    x = wo.example_input(128, BF16)
    with torch.no_grad():
        out, _ = compile_with_inductor(model, x)
        assert_close_relative(out, model(x), TOLERANCE[BF16])


@pytest.mark.parametrize("dtype, three_d", [(FP32, True), (BF16, False)], ids=["fp32-3D", "bf16-2D"])
def test_torchao_int4_on_cpu_is_one_opaque_weight_int4pack_mm_for_cpu(dtype, three_d):
    model = build(wo.torchao_int4_cpu, dtype)
    check_form(model, wo.example_input(128, dtype, three_d),
               ops={"aten._weight_int4pack_mm_for_cpu", "aten.add"},
               absent={"aten.mm", "aten.addmm", "aten.bitwise_and", "prims.convert_element_type"})


def test_qfuse_reports_torchaos_int4_cpu_call_as_the_models_own_kernel():
    """torchao's CPU int4 linear calls `_weight_int4pack_mm_for_cpu` itself: qfuse leaves it and says the
    model called it (it was reported as taken by Inductor's quantization passes, which it was not)."""
    import qfuse

    model = build(wo.torchao_int4_cpu, BF16)
    x = wo.example_input(128, BF16)
    with torch.no_grad():
        (report,) = qfuse.explain(model, x).reports
    assert not report.records and not report.inductor_quantized, report.table()
    assert len(report.model_kernel_calls) == 1 and "_weight_int4pack_mm_for_cpu" in report.model_kernel_calls[0]
    assert "1 quantized kernel call of the model's own left alone" in report.headline(), report.headline()


# --- 3. GPTQ / compressed-tensors pack-quantized int4 ------------------------------------------------------

UNPACK_ALONG_K = {"aten.unsqueeze", "aten.__rshift__.Tensor", "aten.bitwise_and.Scalar", "aten.reshape"}


@pytest.mark.parametrize("dtype, three_d, options, ops", [
    (FP32, False, dict(group_size=32), {"aten.sub", "aten.mul", "aten.permute", "aten.addmm"}),
    (BF16, True, dict(group_size=None), {"aten.sub", "aten.mul", "aten.permute", "aten.addmm"}),
    (BF16, True, dict(group_size=64, symmetric=False, scale_expand="repeat_interleave"),
     {"aten.__rshift__.Tensor", "aten.expand", "aten.clone", "aten.sub", "aten.mul", "aten.addmm"}),
    (FP32, True, dict(group_size=128, symmetric=False, act_order=True, zeros_minus_one=True),
     {"aten.add", "aten.index.Tensor", "aten.sub", "aten.mul", "aten.addmm"}),
], ids=["sym-g32-reshape-fp32-2D", "sym-per-channel-bf16-3D", "asym-g64-repeat_interleave-bf16-3D",
        "asym-g128-act_order-zeros_minus_one-fp32-3D"])
def test_gptq_pack_quantized_int4_unpacks_with_shift_and_mask(dtype, three_d, options, ops):
    """The int -> float conversion is implicit: `(q - zero) * scale` promotes int32 x float in `mul`,
    so the graph casts nothing to float (act-order casts `g_idx` to int64 for the gathers)."""
    model = wo.gptq_packed_int4(dtype, **options)
    check_form(model, wo.example_input(256, dtype, three_d), ops=UNPACK_ALONG_K | ops,
               absent={"aten.bitwise_right_shift", INDUCTOR_WOQ_INT8}, absent_casts=FLOAT_CASTS)


def test_autogptq_classic_layout_dequantizes_a_k_by_n_weight_without_a_transpose():
    model = wo.autogptq_int4(BF16, act_order=True)
    check_form(model, wo.example_input(256, BF16, three_d=True),
               ops={"aten.bitwise_right_shift.Tensor", "aten.bitwise_and.Scalar", "aten.add", "aten.index.Tensor",
                    "aten.sub", "aten.mul", "aten.mm"},
               absent={"aten.permute", "aten.__rshift__"}, casts={"int32->int64"}, absent_casts=FLOAT_CASTS)


CT_UNPACK = {"aten.view.dtype", "aten.bitwise_and.Scalar", "aten.__rshift__.Scalar", "aten.cat", "aten.sub"}


def test_compressed_tensors_unpack_and_dequantize_trace_into_one_graph():
    """compressed-tensors' own `unpack_from_int32` (int32 words viewed as bytes, nibbles split) and
    `dequantize`; the weight equals its `decompress`. The asymmetric zero point is unpacked the same
    way along N (a transpose and a contiguous copy first); a symmetric scheme (the W4A16 preset) has
    the weight's half only. One compile: this form is the slowest to trace."""
    model = build(wo.compressed_tensors_w4a16, BF16, group_size=128, symmetric=False)
    check_form(model, wo.example_input(256, BF16, three_d=True),
               ops=CT_UNPACK | {"aten.clone", "aten.mul", "aten.permute", "aten.addmm"},
               casts={"int8->bfloat16"}, absent={"aten.bitwise_right_shift"})


def test_compressed_tensors_own_decompress_graph_breaks_on_its_weight_shape_tensor():
    """`PackedQuantizationCompressor.decompress` reads `weight_shape` (a tensor) with `int(...)`: a
    `Tensor.item()` graph break, so the dequantize runs outside the graph."""
    model = build(wo.compressed_tensors_w4a16, FP32)
    forward = wo.compressed_tensors_decompress_forward(model)
    x = wo.example_input(256, FP32)
    with torch.no_grad():
        torch.testing.assert_close(forward(x), model(x))
        explanation = torch._dynamo.explain(forward)(x)
    assert explanation.graph_break_count >= 1
    assert any("item()" in str(reason.reason) for reason in explanation.break_reasons), explanation.break_reasons


# --- 4. AWQ ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, three_d, unpack_order", [(FP32, False, "index"), (BF16, True, "shifts")],
                         ids=["order-by-index-fp32-2D", "order-in-shifts-bf16-3D"])
def test_awq_unpacks_along_n_and_undoes_its_interleaved_order(dtype, three_d, unpack_order):
    model = wo.awq_int4(dtype, unpack_order=unpack_order)
    ops = {"aten.bitwise_right_shift.Tensor", "aten.bitwise_and.Scalar", "aten.expand", "aten.sub", "aten.mul"}
    ops |= {"aten.index.Tensor"} if unpack_order == "index" else set()
    ops |= {"aten.addmm"} if dtype == FP32 else {"aten.mm", "aten.add"}
    absent = {"aten.permute"} | (set() if unpack_order == "index" else {"aten.index"})
    check_form(model, wo.example_input(256, dtype, three_d), ops=ops, absent=absent, absent_casts=FLOAT_CASTS)


# --- 5. transformers -------------------------------------------------------------------------------------

SRQ_GUARD = {"aten.ne.Scalar", "aten.where.self", "aten.round", "aten.clamp_min", "aten.clamp_max"}


@pytest.mark.parametrize("dtype, three_d, num_bits", [(FP32, True, 8), (BF16, False, 4)],
                         ids=["int8-fp32-3D", "int4-bf16-2D"])
def test_transformers_gemma_quantized_linear_keeps_its_srq_guards_around_the_linear(dtype, three_d, num_bits):
    """transformers' pure-torch weight-only linear: the weight dequantizes in the model dtype, and the
    input and output pass through `where(scale != 0, fake_quant, x)` (weight-only: scale 0)."""
    model = build(wo.transformers_gemma_quantized_linear, dtype, num_bits=num_bits)
    unpack = {"aten.bitwise_and.Scalar", "aten.__rshift__.Scalar", "aten.cat"} if num_bits == 4 else set()
    casts = {f"int8->{short(dtype)}"} | ({"uint8->int8"} if num_bits == 4 else set())
    check_form(model, wo.example_input(64, dtype, three_d), casts=casts,
               ops=SRQ_GUARD | unpack | {"aten.mul", "aten.permute", "aten.addmm"}, absent={INDUCTOR_WOQ_INT8})


# --- qfuse on the int8 forms it fuses (bf16 activations on CPU) -------------------------------------------

QFUSE_INT8_FORMS = {
    "hand_written_scale_in_the_weight": lambda: wo.hand_written_int8(BF16, scale_after_matmul=False),
    "hand_written_scale_after_the_matmul": lambda: wo.hand_written_int8(BF16, scale_after_matmul=True),
    "torchao_int8_per_row": lambda: wo.torchao_int8_weight_only(BF16, "per_row"),
    "transformers_gemma_int8": lambda: wo.transformers_gemma_quantized_linear(BF16, num_bits=8),
}


@pytest.mark.parametrize("three_d", [False, True], ids=["2D", "3D"])
@pytest.mark.parametrize("form", list(QFUSE_INT8_FORMS))
def test_qfuse_fuses_the_int8_forms_or_inductor_took_them_first(form, three_d):
    """Every linear of these peer forms is fused by qfuse (weight-only, the torch kernel) or, where
    Inductor's own int8 weight-only pattern matched first, taken by it; the output matches eager and
    the float64 reference weight."""
    import qfuse

    model = build(QFUSE_INT8_FORMS[form])
    x = wo.example_input(model.reference_weight.shape[1], BF16, three_d)
    bias = getattr(model, "bias", None)
    with torch.no_grad():
        eager = model(x)
        reference = F.linear(x.double(), model.reference_weight, None if bias is None else bias.double())
        torch._dynamo.reset()
        explanation = qfuse.explain(model, x)
        out = torch.compile(model, backend="qfuse")(x)
    (report,) = explanation.reports
    fused = [record for record in report.records if record.fused]
    assert len(fused) + len(report.inductor_quantized) == 1 and len(report.records) == len(fused), report.table()
    for record in fused:
        assert record.scheme == "bf16 x int8 per-channel (weight-only)" and record.kernel == "torch", report.table()
        assert "_weight_int8pack_mm" in record.lowered, report.table()
    assert_close_relative(out, eager, TOLERANCE[BF16])
    assert_close_relative(out, reference, TOLERANCE[BF16])
