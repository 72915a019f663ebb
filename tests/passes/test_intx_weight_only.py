"""intx_weight_only: torchao's int4 "intx" weights (int4 values stored one per int8, a scale and an
int8 zero point per group) become one qfuse::int4_weight_only_mm on the stored tensors, and match eager.

The model is `IntxInt4Linear` of tests/peers/weight_only_models.py (the dequantize as torchao's
`IntxUnpackedToInt8Tensor` writes it; tests/peers/test_torchao.py runs torchao's own configs).
Covered: symmetric (zero points stored as zeros, or none), asymmetric, zero points and values out of
int4's range (what int8 storage allows: the op's exact dense fallback), groups of 32 / 64 / 128,
bf16 / fp16 / fp32, 2D and 3D, M = 0 / 1 / odd, a dynamic batch, bias or not; forms that must not
be rewritten, each with its reason.
"""

import pytest
import torch

import qfuse
from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs
from qfuse.passes import intx_weight_only
from tests.passes.post_grad import run_family
from tests.passes.test_int4_weight_only import INT4_OP, ONE_ROW, assert_close_relative, cpu_kernel_declines
from tests.peers import weight_only_models as wo

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
PATTERN = "int8-stored int4 (torchao intx) + dequantize + float linear"


@pytest.mark.parametrize("shape", [(1, 256), (5, 256), (2, 3, 256), (0, 256)], ids=["M1", "M5", "3D", "M0"])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("zero_points, values, group_size", [
    ("zero", "int4", 32), ("none", "int4", 64), ("int4", "int4", 128), ("wide", "int4", 32), ("zero", "int8", 32),
], ids=["symmetric-g32", "no-zero-point-g64", "asymmetric-g128", "wide-zero-points", "int8-values"])
def test_intx_weights_fuse_and_match_eager(zero_points, values, group_size, dtype, shape):
    model = wo.torchao_intx_int4(dtype, group_size=group_size, zero_points=zero_points, values=values)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        eager = model(x)
        explanation = qfuse.explain(model, x)
        out = torch.compile(model, backend="qfuse")(x)
    assert_close_relative(out, eager)
    (record,) = explanation.records
    declined = cpu_kernel_declines(dtype, shape, zero_points=False)  # int8 storage: zero points never decline
    if declined:
        assert not record.fused and declined in record.reason, explanation
        return
    assert record.fused and record.family == "intx_weight_only" and record.pattern == PATTERN, explanation
    assert record.scheme == f"{ {BF16: 'bf16', FP16: 'fp16', FP32: 'fp32'}[dtype]} x int4 per-group (weight-only)"
    report = explanation.reports[-1]
    assert report.ops_after[INT4_OP] == 1 and report.ops_after["aten.addmm.default"] == 0


def test_the_op_gets_the_stored_tensors():
    model = wo.torchao_intx_int4(FP32, group_size=64, zero_points="int4")
    run = run_family(intx_weight_only, model, ONE_ROW)
    (fused,) = [node for node in run.graph.nodes if str(node.target) == INT4_OP]
    call = Int4WeightOnlyMmArgs.of(fused)
    assert all(operand.op == "placeholder" for operand in (call.packed, call.scales, call.packed_zeros))
    assert call.shifts is None and call.group_size == 64 and call.kernel == "torch"


def test_a_dynamic_batch_compiles_once_and_fuses():
    model = wo.torchao_intx_int4(BF16, group_size=32)
    compiled = torch.compile(model, backend="qfuse", dynamic=True)
    marker = qfuse.graphs_compiled()
    with torch.no_grad():
        for rows in (2, 7, 33):
            x = torch.randn(rows, 256).to(BF16)
            assert_close_relative(compiled(x), model(x))
    reports = qfuse.reports_since(marker)
    assert len(reports) == 1 and reports[0].fused and not reports[0].near_misses


class ValuesComputedPerCall(torch.nn.Module):
    """The int8 values are computed in the forward (a clamp of the stored ones): nothing to prepare once."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        model = self.model
        n, k = model.qdata.shape
        values = model.qdata.clamp(-8, 7).view(n, k // model.group_size, model.group_size).to(x.dtype)
        weight = (values * model.scale.view(n, -1, 1)).view(n, k)
        return torch.nn.functional.linear(x, weight, model.bias)


class WeightUsedTwice(torch.nn.Module):
    """The dequantized weight also leaves the model: replacing the matmul would not remove it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        model = self.model
        n, k = model.qdata.shape
        values = model.qdata.view(n, k // model.group_size, model.group_size).to(x.dtype)
        weight = (values * model.scale.view(n, -1, 1)).view(n, k)
        return torch.nn.functional.linear(x, weight, model.bias), weight.sum()


class AddmmScalesItsTerms(torch.nn.Module):
    """addmm(bias, x, w.t(), beta=0.5, alpha=2): not a linear of w."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        model = self.model
        n, k = model.qdata.shape
        values = model.qdata.view(n, k // model.group_size, model.group_size).to(x.dtype)
        weight = (values * model.scale.view(n, -1, 1)).view(n, k)
        return torch.addmm(model.bias, x, weight.t(), beta=0.5, alpha=2.0)


class ZeroPointScaledBySub(torch.nn.Module):
    """torch.sub(q, zp, alpha=2): q - 2 zp, no dequantize of any scheme's form."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        model = self.model
        n, k = model.qdata.shape
        groups = k // model.group_size
        values = torch.sub(model.qdata.view(n, groups, model.group_size).to(x.dtype),
                           model.zero_point.view(n, groups, 1).to(x.dtype), alpha=2)
        return torch.nn.functional.linear(x, (values * model.scale.view(n, groups, 1)).view(n, k), model.bias)


class ValuesStoredGrouped(torch.nn.Module):
    """The int8 values stored as [N, K / g, g] already: not torchao's [N, K] storage."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        n, k = model.qdata.shape
        self.register_buffer("grouped", model.qdata.view(n, k // model.group_size, model.group_size).clone())

    def forward(self, x):
        n, groups, group_size = self.grouped.shape
        weight = (self.grouped.to(x.dtype) * self.model.scale.view(n, groups, 1)).view(n, groups * group_size)
        return torch.nn.functional.linear(x, weight, self.model.bias)


@pytest.mark.parametrize("wrapper, family, reason", [
    (ValuesComputedPerCall, "intx_weight_only", "its values are computed on every call"),
    (WeightUsedTwice, "intx_weight_only", "the dequantized weight has 2 users"),
    (AddmmScalesItsTerms, "intx_weight_only", "the addmm scales its terms (alpha or beta)"),
    (ZeroPointScaledBySub, None, ""),
    (ValuesStoredGrouped, "fake_quant_linear", "times one scale per group of 32 input channels"),
])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_forms_not_taken_are_named_and_stay_correct(wrapper, family, reason, dtype):
    model = wrapper(wo.torchao_intx_int4(dtype, group_size=32, zero_points="int4"))
    x = wo.example_input(256, dtype, tokens=1)
    with torch.no_grad():
        eager = model(x)
        explanation = qfuse.explain(model, x)
        out = torch.compile(model, backend="qfuse")(x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert not any(record.fused for record in explanation.records), explanation
    if family is not None:
        records = [record for record in explanation.records if record.family == family]
        assert any(reason in record.reason for record in records), explanation
