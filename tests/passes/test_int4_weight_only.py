"""int4_weight_only: int4 weights unpacked in the graph (GPTQ [N, K / 8], AutoGPTQ [K / 8, N], AWQ
[K, N / 8], compressed-tensors pack-quantized) become one qfuse::int4_weight_only_mm on the stored
words, and match eager.

The models are the peer forms of tests/peers/weight_only_models.py, written as GPTQ model code and
compressed-tensors' own `unpack_from_int32` / `dequantize` write them (and AutoGPTQ's and AutoAWQ's
torch paths: act order, zero points stored minus one, AWQ's channel order). Covered: symmetric (uint4
offset 8) and zero points, groups of 32 / 64 / 128 and per channel, bf16 / fp16 / fp32, 2D and 3D,
bias or not, M = 1 and odd, a dynamic batch; the stored tensors reach the op (nothing is unpacked
in the compiled graph); forms that must not be rewritten here, each with its reason.
"""

import pytest
import torch

import qfuse
from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs
from qfuse.passes.families import int4_weight_only
from tests.helpers import eager_compiled_and_explained
from tests.passes.post_grad import run_family
from tests.peers import weight_only_models as wo

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
INT4_OP = "qfuse.int4_weight_only_mm.default"
PATTERN = "int4 unpack + dequantize + float linear"
ONE_ROW = torch.randn(1, 256)  # a float32 activation of one row
TOLERANCE = {BF16: 2**-7, FP16: 2**-10, FP32: 1e-5}  # one rounding of the output, relative to its largest value


def assert_close_relative(out, expected):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if not expected.numel():
        return
    scale = expected.float().abs().max()
    assert (out.float() - expected.float()).abs().max() <= TOLERANCE[expected.dtype] * scale


def build(builder, *args, **kwargs):
    try:
        return builder(*args, **kwargs)
    except ImportError as error:
        pytest.skip(f"{builder.__name__}: {error}")


FORMS = {
    "gptq-sym-g32": (wo.gptq_packed_int4, dict(group_size=32)),
    "gptq-sym-channel": (wo.gptq_packed_int4, dict(group_size=None)),
    "gptq-zeros-g64": (wo.gptq_packed_int4, dict(group_size=64, symmetric=False)),
    "gptq-zeros-channel": (wo.gptq_packed_int4, dict(group_size=None, symmetric=False)),
    "gptq-sym-g128-no-bias": (wo.gptq_packed_int4, dict(group_size=128, bias=False)),
    "ct-sym-g64": (wo.compressed_tensors_w4a16, dict(group_size=64)),
    "ct-zeros-g64": (wo.compressed_tensors_w4a16, dict(group_size=64, symmetric=False)),
    "ct-sym-channel": (wo.compressed_tensors_w4a16, dict(strategy="channel")),
    "gptq-act-order-g64": (wo.gptq_packed_int4, dict(group_size=64, act_order=True)),
    "gptq-act-order-zeros-minus-one": (wo.gptq_packed_int4, dict(group_size=64, act_order=True, symmetric=False,
                                                                 zeros_minus_one=True)),
    "gptq-repeat-interleave": (wo.gptq_packed_int4, dict(group_size=64, scale_expand="repeat_interleave")),
    "gptq-zeros-minus-one-g32": (wo.gptq_packed_int4, dict(group_size=32, symmetric=False, zeros_minus_one=True)),
    "autogptq-g64": (wo.autogptq_int4, dict(group_size=64)),
    "autogptq-act-order-g128": (wo.autogptq_int4, dict(group_size=128, act_order=True)),
    "awq-g64": (wo.awq_int4, dict(group_size=64)),
    "awq-order-in-shifts-g128": (wo.awq_int4, dict(group_size=128, unpack_order="shifts")),
}


@pytest.mark.parametrize("shape", [pytest.param((1, 256), id="M1", marks=pytest.mark.slow), pytest.param((5, 256), id="M5"),
                                   pytest.param((2, 3, 256), id="3D", marks=pytest.mark.slow)])  # M5, bf16 in the fast tier
@pytest.mark.parametrize("dtype", [BF16, pytest.param(FP16, marks=pytest.mark.slow), pytest.param(FP32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("form", list(FORMS))
def test_int4_forms_fuse_on_the_stored_words_and_match_eager(form, dtype, shape):
    builder, options = FORMS[form]
    model = build(builder, dtype, **options)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    eager, out, explanation = eager_compiled_and_explained(model, x)
    assert_close_relative(out, eager)
    (record,) = explanation.records
    assert record.fused and record.family == "int4_weight_only" and record.pattern == PATTERN
    assert record.scheme == f"{ {BF16: 'bf16', FP16: 'fp16', FP32: 'fp32'}[dtype]} x int4 per-group (weight-only)"
    report = explanation.reports[-1]
    assert report.ops_after[INT4_OP] == 1
    for unpack_op in ("aten.bitwise_and.Scalar", "aten.__rshift__.Tensor", "aten.__rshift__.Scalar", "aten.addmm.default"):
        assert report.ops_after[unpack_op] == 0, unpack_op


def test_the_op_gets_the_stored_tensors():
    model = wo.gptq_packed_int4(FP32, group_size=32, symmetric=False)
    run = run_family(int4_weight_only, model, ONE_ROW)
    (fused,) = [node for node in run.graph.nodes if str(node.target) == INT4_OP]
    call = Int4WeightOnlyMmArgs.of(fused)
    assert all(operand.op == "placeholder" for operand in (call.packed, call.shifts, call.scales, call.packed_zeros))
    assert call.group_size == 32 and call.kernel == "torch"


@pytest.mark.parametrize("unpack_order", ["index", "shifts"])
def test_awq_reaches_the_op_packed_along_n_with_its_order_in_the_shifts(unpack_order):
    """AutoAWQ's gather by `arange(N).view(-1, 8)[:, C]` becomes shifts 4 C, a constant of the graph;
    the order folded into stored shifts is those shifts themselves."""
    model = wo.awq_int4(FP32, group_size=64, unpack_order=unpack_order)
    run = run_family(int4_weight_only, model, ONE_ROW)
    (fused,) = [node for node in run.graph.nodes if str(node.target) == INT4_OP]
    call = Int4WeightOnlyMmArgs.of(fused)
    assert call.packed_along_n and call.packed.op == "placeholder" and call.shifts.op in ("placeholder", "get_attr")
    shifts = getattr(run.graph.owning_module, call.shifts.target) if call.shifts.op == "get_attr" else model.shifts
    assert shifts.tolist() == [4 * nibble for nibble in wo.AWQ_UNPACK_ORDER]


def test_compressed_tensors_unpack_has_no_shifts_tensor():
    """compressed-tensors splits bytes into nibbles: the op reads nibble i at bits 4i (shifts None)."""
    model = build(wo.compressed_tensors_w4a16, FP32, group_size=64)
    run = run_family(int4_weight_only, model, ONE_ROW)
    (fused,) = [node for node in run.graph.nodes if str(node.target) == INT4_OP]
    assert Int4WeightOnlyMmArgs.of(fused).shifts is None


def assert_a_dynamic_batch_compiles_once_and_fuses(model, dtype, batches=(2, 7, 33)):
    compiled = torch.compile(model, backend="qfuse", dynamic=True)
    marker = qfuse.graphs_compiled()
    with torch.no_grad():
        for rows in batches:
            x = torch.randn(rows, 256).to(dtype)
            assert_close_relative(compiled(x), model(x))
    reports = qfuse.reports_since(marker)
    assert len(reports) == 1 and reports[0].fused and not reports[0].near_misses


def test_a_dynamic_batch_compiles_once_and_fuses():
    assert_a_dynamic_batch_compiles_once_and_fuses(wo.gptq_packed_int4(BF16, group_size=64), BF16)


NEAR_MISSES = {
    "group-of-16": (wo.gptq_packed_int4, dict(group_size=16), "needs a weight group size that is a multiple of 32, got 16"),
    "n-not-multiple-of-16": (wo.gptq_packed_int4, dict(group_size=32, out_features=40), "N a multiple of 16"),
}


@pytest.mark.parametrize("form", list(NEAR_MISSES))
def test_forms_not_taken_are_named_and_stay_correct(form):
    builder, options, reason = NEAR_MISSES[form]
    model = builder(FP32, **options)
    x = wo.example_input(256, FP32)
    eager, out, explanation = eager_compiled_and_explained(model, x)
    assert_close_relative(out, eager)
    int4_records = [record for record in explanation.records
                    if record.family == "int4_weight_only" or "int4_weight_only" in record.note]
    assert int4_records and not any(record.fused and record.family == "int4_weight_only" for record in int4_records)
    assert any(reason in record.reason + record.note for record in int4_records), explanation


class _GptqVariant(torch.nn.Module):
    """The GPTQ form (`wo.gptq_packed_int4`'s stored tensors, groups of 32) with one change to its dequantize."""

    def __init__(self, variant: str):
        super().__init__()
        self.base, self.variant = wo.gptq_packed_int4(BF16, group_size=32), variant
        if variant == "float32-scales":
            self.base.scales = self.base.scales.float()

    def forward(self, x):
        base, variant = self.base, self.variant
        n = base.qweight.shape[0]
        q = ((base.qweight.unsqueeze(-1) >> base.shifts) & (0x7 if variant == "three-bit-mask" else 0xF)).reshape(n, -1)
        k, g = q.shape[1], base.group_size
        scales = base.scales.abs() if variant == "scales-per-call" else base.scales
        w = ((q - (7 if variant == "offset-7" else 8)).reshape(n, k // g, g) * scales.unsqueeze(-1)).reshape(n, k)
        out = torch.nn.functional.linear(x, w.to(x.dtype), base.bias)
        return out + w.sum() if variant == "two-users" else out


RECOGNITION_NEAR_MISSES = {
    "offset-7": ("int4_weight_only", "its zero point is neither the uint4 offset 8 nor int32 [N / 8, K / g] zero points"),
    "scales-per-call": ("int4_weight_only", "its scales are computed on every call"),
    "float32-scales": ("int4_weight_only", "its scales are torch.float32 and the activation torch.bfloat16"),
    "two-users": ("int4_weight_only", "the dequantized weight has 2 users"),
    "three-bit-mask": ("unrecognised", "the weight operand is computed from stored quantized tensors (int32 [128, 32])"),
}


@pytest.mark.parametrize("variant", list(RECOGNITION_NEAR_MISSES))
def test_a_dequantize_that_is_no_int4_scheme_is_a_near_miss_with_its_reason(variant):
    """Unpacked words whose dequantize differs from every int4 scheme in one way are not rewritten; explain
    names the linear and why. A weight unpacked by a mask of 0x7 matches no form at all: it is still named
    as a quantized linear (computed from stored int32 words), not counted as a float matmul."""
    model = _GptqVariant(variant)
    x = wo.example_input(256, BF16)
    eager, out, explanation = eager_compiled_and_explained(model, x)
    assert_close_relative(out, eager)
    family, reason = RECOGNITION_NEAR_MISSES[variant]
    (record,) = explanation.records
    assert not record.fused and record.family == family and reason in record.reason, explanation
    assert not explanation.reports[-1].float_matmuls
