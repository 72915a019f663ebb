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
from torch.nn import functional as F

from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs
from qfuse.passes.families import intx_weight_only
from tests.helpers import eager_compiled_and_explained
from tests.passes.post_grad import run_family
from tests.passes.test_int4_weight_only import (INT4_OP, ONE_ROW, assert_a_dynamic_batch_compiles_once_and_fuses,
                                               assert_close_relative)
from tests.peers import weight_only_models as wo

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
PATTERN = "int8-stored int4 (torchao intx) + dequantize + float linear"


@pytest.mark.parametrize("shape", [(1, 256), (5, 256), (2, 3, 256), (0, 256)], ids=["M1", "M5", "3D", "M0"])
@pytest.mark.parametrize("dtype", [BF16, pytest.param(FP16, marks=pytest.mark.slow), pytest.param(FP32, marks=pytest.mark.slow)])
@pytest.mark.parametrize("zero_points, values, group_size", [
    ("zero", "int4", 32), ("none", "int4", 64), ("int4", "int4", 128), ("wide", "int4", 32), ("zero", "int8", 32),
], ids=["symmetric-g32", "no-zero-point-g64", "asymmetric-g128", "wide-zero-points", "int8-values"])
def test_intx_weights_fuse_and_match_eager(zero_points, values, group_size, dtype, shape):
    model = wo.torchao_intx_int4(dtype, group_size=group_size, zero_points=zero_points, values=values)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    eager, out, explanation = eager_compiled_and_explained(model, x)
    assert_close_relative(out, eager)
    (record,) = explanation.records
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
    # up to 8 rows: one bucket on every CPU (on AMX, Inductor's own code takes bf16 intx above 8: int4_cpu.max_rows)
    assert_a_dynamic_batch_compiles_once_and_fuses(wo.torchao_intx_int4(BF16, group_size=32), BF16, batches=(2, 5, 8))


def dequantized(model, x, values=None):
    """The intx weight [N, K] of `values` (the stored ones by default), as torchao dequantizes it."""
    n, k = model.qdata.shape
    values = model.qdata if values is None else values
    return (values.view(n, k // model.group_size, -1).to(x.dtype) * model.scale.view(n, -1, 1)).view(n, k)


def zero_point_scaled_by_sub(model, x):
    n, k = model.qdata.shape
    groups = k // model.group_size
    values = torch.sub(model.qdata.view(n, groups, -1).to(x.dtype), model.zero_point.view(n, groups, 1).to(x.dtype),
                       alpha=2)
    return F.linear(x, (values * model.scale.view(n, groups, 1)).view(n, k), model.bias)


def weight_used_twice(model, x):
    weight = dequantized(model, x)
    return F.linear(x, weight, model.bias), weight.sum()


#: forms that are not torchao's intx linear, or not provably: (forward(model, x), family, its reason)
NOT_TAKEN = {
    "values computed per call": (lambda model, x: F.linear(x, dequantized(model, x, model.qdata.clamp(-8, 7)), model.bias),
                                 "intx_weight_only", "its values are computed on every call"),
    "weight used twice": (weight_used_twice, "intx_weight_only", "the dequantized weight has 2 users"),
    "addmm scales its terms": (lambda model, x: torch.addmm(model.bias, x, dequantized(model, x).t(), beta=0.5, alpha=2.0),
                               "intx_weight_only", "the addmm scales its terms (alpha or beta)"),
    "sub scales the zero point": (zero_point_scaled_by_sub, None, ""),  # q - 2 zp: no family's dequantize
    "values stored grouped": (lambda model, x: F.linear(x, dequantized(model, x, model.grouped), model.bias),
                              "fake_quant_linear", "times one scale per group of 32 input channels"),
}


class Form(torch.nn.Module):
    def __init__(self, model, forward):
        super().__init__()
        self.model, self.form = model, forward
        n, k = model.qdata.shape  # the values stored as [N, K / g, g]: not torchao's [N, K] storage
        model.register_buffer("grouped", model.qdata.view(n, k // model.group_size, -1).clone())

    def forward(self, x):
        return self.form(self.model, x)


@pytest.mark.parametrize("form", list(NOT_TAKEN))
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_forms_not_taken_are_named_and_stay_correct(form, dtype):
    forward, family, reason = NOT_TAKEN[form]
    model = Form(wo.torchao_intx_int4(dtype, group_size=32, zero_points="int4"), forward)
    x = wo.example_input(256, dtype, tokens=1)
    eager, out, explanation = eager_compiled_and_explained(model, x)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    assert not any(record.fused for record in explanation.records), explanation
    if family is not None:
        records = [record for record in explanation.records if record.family == family]
        assert any(reason in record.reason for record in records), explanation
