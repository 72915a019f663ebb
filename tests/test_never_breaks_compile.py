"""qfuse never breaks a compile: a fault injected at each stage (recognising a linear, choosing its
kernel, emitting the fused op, redirecting its users, folding the activation quant, a whole pattern
family, the Inductor lowering) leaves that part as it was, records the reason, warns once, and the
compiled model still returns what eager returns."""

import warnings

import pytest
import torch

from qfuse.errors import QfuseInternalWarning
from qfuse.passes.families import activation_quant, reference_linear
from qfuse.passes.core import fused_linear
from qfuse.passes.core.report import PassReport
from tests.helpers import compile_and_run

K, N = 64, 48
SCALED_MM = "qfuse.scaled_mm.default"
INJECTED = "injected fault"


def int8_linear(x, w, w_scale, bias):
    s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5) / 127.0
    q = torch.clamp(torch.round(x / s), -128, 127).to(torch.int8)
    return torch._int_mm(q, w.t()).to(torch.float32) * s * w_scale + bias


def operands(m=9):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(m, K, generator=generator), torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator),
            torch.rand(N, generator=generator) * 0.01 + 0.001, torch.randn(N, generator=generator))


def raise_injected(*args, **kwargs):
    raise RuntimeError(INJECTED)


def then_raise(function):
    """`function`, which does its work (inserts nodes, redirects users) and then raises."""
    def wrapped(*args, **kwargs):
        function(*args, **kwargs)
        raise RuntimeError(INJECTED)
    return wrapped


def compile_with_fault(kernel="torch", **options):
    """Compile and run int8_linear; returns (report, internal warnings), checking the output."""
    args = operands()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, report = compile_and_run(int8_linear, *args, kernel=kernel, **options)
    torch.testing.assert_close(out, int8_linear(*args), rtol=1e-4, atol=1e-4)
    return report, [w for w in caught if issubclass(w.category, QfuseInternalWarning)]


@pytest.fixture(autouse=True)
def warn_afresh(monkeypatch):
    """Each test sees the first warning of its failure (qfuse warns once per distinct failure)."""
    monkeypatch.setattr("qfuse.errors._warned", set())


def assert_not_fused_because_of_the_fault(report, internal_warnings):
    (record,) = report.records
    assert not record.fused and "qfuse internal error" in record.reason and INJECTED in record.reason
    assert report.ops_after[SCALED_MM] == 0 and report.ops_after["aten._int_mm.default"] == 1
    assert len(internal_warnings) == 1 and INJECTED in str(internal_warnings[0].message)


def test_recognising_a_linear(monkeypatch):
    monkeypatch.setattr(reference_linear, "analyze", raise_injected)
    assert_not_fused_because_of_the_fault(*compile_with_fault())


def test_choosing_the_kernel(monkeypatch):
    monkeypatch.setattr(fused_linear.KernelRequest, "choose", raise_injected)
    assert_not_fused_because_of_the_fault(*compile_with_fault())


def test_emitting_the_fused_op_after_some_nodes_went_in(monkeypatch):
    monkeypatch.setattr(fused_linear, "_fused_op_args", then_raise(fused_linear._fused_op_args))
    report, internal_warnings = compile_with_fault()
    assert_not_fused_because_of_the_fault(report, internal_warnings)
    assert report.ops_after == report.ops_before  # what the failed rewrite inserted is gone


def test_after_the_users_were_redirected_the_family_is_undone(monkeypatch):
    real_add = PassReport.add

    def add_then_fail(self, record):
        real_add(self, record)
        if record.fused:
            raise RuntimeError(INJECTED)

    monkeypatch.setattr(PassReport, "add", add_then_fail)
    report, internal_warnings = compile_with_fault()
    assert report.records == [] and report.ops_after == report.ops_before
    (error,) = report.errors
    assert "pattern family reference_linear" in error and INJECTED in error
    assert "1 internal error" in report.headline() and "internal errors" in report.table()
    assert len(internal_warnings) == 1


def test_folding_the_activation_quant(monkeypatch):
    monkeypatch.setattr(activation_quant, "fold_replacement", then_raise(activation_quant.fold_replacement))
    report, internal_warnings = compile_with_fault(kernel="reference")
    (record,) = report.records
    assert record.fused and "activation quant" not in record.pattern
    assert INJECTED in record.note and report.ops_after[SCALED_MM] == 1
    assert len(internal_warnings) == 1


def test_a_whole_family_after_it_changed_the_graph(monkeypatch):
    monkeypatch.setattr(activation_quant, "run", then_raise(activation_quant.run))
    report, internal_warnings = compile_with_fault(kernel="reference")
    (record,) = report.records  # reference_linear's fusion stands; activation_quant's fold is undone
    assert record.fused and "activation quant" not in record.pattern
    assert report.ops_after[SCALED_MM] == 1 and report.ops_after["qfuse.quant_scaled_mm.default"] == 0
    assert any("activation_quant" in error for error in report.errors) and len(internal_warnings) == 1


def test_the_inductor_lowering(monkeypatch):
    from qfuse.lowerings import dispatch

    monkeypatch.setattr(dispatch, "_kernel_of_bucket", raise_injected)
    report, internal_warnings = compile_with_fault()
    (record,) = report.records
    assert record.fused and record.lowered.startswith("extern call (qfuse internal error")
    assert len(internal_warnings) == 1


def test_warns_once_per_distinct_failure(monkeypatch):
    monkeypatch.setattr(fused_linear.KernelRequest, "choose", raise_injected)
    _, first = compile_with_fault()
    torch._dynamo.reset()
    _, second = compile_with_fault()
    assert len(first) == 1 and second == []


def test_a_users_own_error_still_raises():
    """A kernel asked for by name that cannot run here is the user's choice, not a qfuse bug."""
    with pytest.raises(Exception, match="cutlass"):
        compile_and_run(int8_linear, *operands(), kernel="cutlass")
