"""Helpers shared by the pass tests."""

import torch

import qfuse


def compile_and_run(fn, *args, dynamic=None, **options):
    """Compile `fn` with backend="qfuse", run it, return (output, the report of its last graph)."""
    marker = qfuse.graphs_compiled()
    compiled = torch.compile(fn, backend="qfuse", options=options or None, dynamic=dynamic)
    out = compiled(*args)
    reports = qfuse.reports_since(marker)
    assert reports, "qfuse's pass did not run"
    return out, reports[-1]
