"""Debug mode a user can read: explain(), near-miss reasons, verify mode, depyf, logging."""

import logging
import os
import sys

import pytest
import torch

import qfuse
from qfuse.kernels import KERNELS
from qfuse.kernels.torch_native import TorchKernel
from tests.helpers import FLOAT_WRITTEN_INT8
from tests.passes.test_pt2e_linear import QDQLinear, WrongAxis
from tests.passes.test_reference_linear import (
    accumulator_has_another_user,
    dynamic_int8,
    int_mm_linear,
    no_dequantize,
    operands,
    weight_scale_with_extra_dim,
)


def int8_times_fp8(x, w, w_scale, bias):
    q, s = dynamic_int8(x)
    return (q.float() @ w.to(torch.float8_e4m3fn).float().t()) * s


def integer_output(x, w, w_scale, bias):
    q, _ = dynamic_int8(x)
    return torch._int_mm(q, w.t()) * 3


class AddmmWithBeta(QDQLinear):
    def forward(self, x):
        return torch.addmm(self.bias, self.dequantized_activation(x), self.dequantized_weight().t(), beta=0.5)


REFERENCE_NEAR_MISSES = {
    weight_scale_with_extra_dim: "_int_mm (int8) found, but the factor view has shape [1, 1, 48], which would broadcast "
                                 "the [5, 48] output to more dims",
    accumulator_has_another_user: "_int_mm (int8) found, but _int_mm has 2 users, so what follows it cannot move "
                                  "into a fused op",
    no_dequantize: "_int_mm (int8) found, but no dequantize scale is applied to its output",
    int8_times_fp8: "float mm of upcast of torch.int8 x torch.float8_e4m3fn",
    integer_output: "_int_mm (int8) found, but the epilogue ends in torch.int32",
}
PT2E_NEAR_MISSES = {
    WrongAxis: "the weight is dequantized per channel along axis 1, not along its output channels",
    AddmmWithBeta: "addmm with beta or alpha other than 1",
}


@pytest.mark.parametrize("form", list(REFERENCE_NEAR_MISSES), ids=lambda form: form.__name__)
def test_reference_near_miss_reasons(form):
    explanation = qfuse.explain(form, *operands((5, 64)))
    (record,) = explanation.near_misses
    assert record.reason.startswith(REFERENCE_NEAR_MISSES[form]) and not explanation.fused
    assert "NOT FUSED" in str(explanation) and REFERENCE_NEAR_MISSES[form] in str(explanation)


@pytest.mark.parametrize("model_class", list(PT2E_NEAR_MISSES), ids=lambda cls: cls.__name__)
def test_pt2e_near_miss_reasons(model_class):
    with torch.no_grad():
        explanation = qfuse.explain(model_class(), torch.randn(5, 64))
    (record,) = explanation.near_misses
    assert record.reason == PT2E_NEAR_MISSES[model_class] and record.family == "pt2e_linear"


def test_explain_reports_fused_linears_with_scheme_and_kernel():
    explanation = qfuse.explain(int_mm_linear, *operands((2, 7, 64)), options={"kernel": "reference"})
    (record,) = explanation.fused
    assert (record.scheme, record.kernel) == ("int8 dyn-token x per-channel", "reference")
    assert "kernel     reference" in str(explanation)


def test_linears_with_the_same_outcome_are_one_block_and_details_give_each_its_own():
    def two_linears(x, w, w_scale, bias):
        return int_mm_linear(x, w, w_scale, bias) + int_mm_linear(x * 2, w, w_scale, bias)

    explanation = qfuse.explain(two_linears, *operands((5, 64)), options={"kernel": "reference"})
    text, details = str(explanation), explanation.details()
    assert "2 linears: " in text and text.count("  fused ") == 1 and "explanation.details()" in text
    assert details.count("  fused ") == 2 and "linears: " not in details


def test_headline_is_logged_once_per_graph_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="qfuse"):
        qfuse.explain(int_mm_linear, *operands((5, 64)), options={"kernel": "torch"})
    headlines = [r.message for r in caplog.records if r.message.startswith("qfuse: graph_")]
    assert len(headlines) == 1
    assert headlines[0].endswith("1 of 1 linears fused (1 int8 dyn-token x per-channel -> torch)")


def test_verify_mode_records_the_error_of_each_rewrite():
    with torch.no_grad():
        explanation = qfuse.explain(QDQLinear(), torch.randn(9, 64), options={"verify": True, **FLOAT_WRITTEN_INT8})
    (record,) = explanation.fused
    assert record.max_error is not None and record.max_error < 1e-3
    assert "verified   max abs error" in str(explanation)


class OffByTenPercent(TorchKernel):
    """A deliberately wrong kernel, to prove that verify mode catches one."""

    name = "off_by_ten_percent"

    def apply(self, *args):
        return super().apply(*args) * 1.1


def test_verify_mode_catches_a_wrong_kernel(monkeypatch):
    monkeypatch.setitem(KERNELS, OffByTenPercent.name, OffByTenPercent())
    options = {"kernel": OffByTenPercent.name}
    explanation = qfuse.explain(int_mm_linear, *operands((5, 64)), options=options)  # runs, silently wrong
    assert explanation.fused[0].kernel == OffByTenPercent.name
    torch._dynamo.reset()
    with pytest.raises(qfuse.QfuseVerificationError, match=r"relative error 1\.0\d+e-01 > tolerance 1\.0e-03"):
        qfuse.explain(int_mm_linear, *operands((5, 64)), options={**options, "verify": True})


def test_depyf_dump_beside_the_graphs(tmp_path):
    pytest.importorskip("depyf")
    qfuse.explain(int_mm_linear, *operands((5, 64)), options={"debug": True, "debug_dir": str(tmp_path)})
    process_dir = tmp_path / f"pid{os.getpid()}"
    assert any(path.name.startswith("full_code_for_int_mm_linear") for path in (process_dir / "depyf").iterdir())
    assert (next(process_dir.glob("graph_*")) / "report.json").exists()


def test_without_depyf_debug_says_so_and_compiles(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "depyf", None)  # import depyf now raises ImportError
    monkeypatch.setattr(qfuse.debug.DepyfDump, "_said_missing", False)
    with caplog.at_level(logging.WARNING, logger="qfuse"):
        explanation = qfuse.explain(int_mm_linear, *operands((5, 64)), options={"debug": True, "debug_dir": str(tmp_path)})
    assert explanation.fused
    assert any("depyf is not installed" in record.message for record in caplog.records)


def test_one_record_per_linear_whichever_families_passed_it_over():
    """Two families passing one matmul over make one near miss (the first family's reason, the later
    one's as a note, both printed); a family that then fuses it keeps both in the fused record's note."""
    from qfuse.passes.core.report import LinearRecord, PassReport

    report = PassReport(graph_name="graph_x")
    report.add(LinearRecord(node="addmm", family="int4_weight_only", fused=False, reason="no kernel can run it"))
    report.add(LinearRecord(node="addmm", family="fake_quant_linear", fused=False, reason="group scales"))
    (record,) = report.records
    assert record.reason == "no kernel can run it" and record.note == "fake_quant_linear: group scales"
    assert "also       fake_quant_linear: group scales" in report.table() and "(also: " in report.summary()
    report.add(LinearRecord(node="addmm", family="later", fused=True, pattern="p", scheme="s", kernel="k"))
    (fused,) = report.records
    assert "passed over by int4_weight_only: no kernel can run it" in fused.note and "group scales" in fused.note


def test_a_float_linear_of_an_activation_read_from_integers_is_a_float_matmul():
    """Only the weight operand is followed back to stored integers: image pixels stored as uint8 and scaled
    to float feed a float linear, which stays a float matmul (no `unrecognised` near miss)."""
    linear = torch.nn.Linear(48, 8)

    def model(pixels):
        return linear(pixels.float() / 255)

    pixels = torch.randint(0, 256, (4, 48), dtype=torch.uint8)
    with torch.no_grad():
        (report,) = qfuse.explain(model, pixels).reports
    assert not report.records and len(report.float_matmuls) == 1, report.table()


def test_a_switched_off_family_is_named_in_the_unrecognised_reason():
    """With the int4 family off by `patterns`, a GPTQ linear is still named as a quantized linear, and the
    reason says which families the configuration did not run."""
    from qfuse.passes.families import PATTERN_FAMILIES
    from tests.peers.weight_only_models import example_input, gptq_packed_int4

    model = gptq_packed_int4(torch.bfloat16, group_size=32)
    x = example_input(256, torch.bfloat16)
    patterns = [family for family in PATTERN_FAMILIES if family != "int4_weight_only"]
    with torch.no_grad():
        (report,) = qfuse.explain(model, x, options={"patterns": patterns}).reports
    (record,) = report.records
    assert record.family == "unrecognised" and "not run, by the configuration's `patterns`: int4_weight_only" in record.reason


def test_explain_ends_with_what_the_prepared_weights_cost():
    """The prepared weights made from the model's tensors on the run: how many, their bytes beside the stored
    ones, and the dense (full-precision) copies, where an int4 weight has no exact int4 kernel."""
    from tests.peers import weight_only_models as wo

    x = wo.example_input(256, torch.bfloat16, tokens=3)
    int4 = wo.gptq_packed_int4(torch.bfloat16, group_size=64, out_features=64)  # packed once into int4pack
    prepared = qfuse.explain(int4, x).prepared
    assert prepared.weights == 1 and prepared.dense == 0 and prepared.prepared_bytes > 0
    stored = sum(tensor.untyped_storage().nbytes() for tensor in (int4.qweight, int4.scales))
    assert stored <= prepared.source_bytes <= stored + sum(b.untyped_storage().nbytes() for b in int4.buffers())
    wide = wo.torchao_intx_int4(torch.bfloat16, values="int8", out_features=64)  # int8 values: no int4 weight
    explanation = qfuse.explain(wide, x)
    assert explanation.prepared.dense == 1 and "1 of them dense (a full-precision copy, exact)" in str(explanation)
    x8, w, w_scale, bias = operands((5, 64))
    explanation = qfuse.explain(lambda x: int_mm_linear(x, w, w_scale, bias), x8)
    assert explanation.prepared is None
