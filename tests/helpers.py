"""Helpers shared by the pass tests."""

import torch

import qfuse


def compile_and_run(fn, *args, dynamic=None, **options):
    """Compile `fn` with backend="qfuse", run it, return (output, the report of its last graph)."""
    before = len(qfuse.recent_reports())
    compiled = torch.compile(fn, backend="qfuse", options=options or None, dynamic=dynamic)
    out = compiled(*args)
    reports = qfuse.recent_reports()
    assert len(reports) > before, "qfuse's pass did not run"
    return out, reports[-1]
