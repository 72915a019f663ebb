"""`python -m qfuse demo`: every linear of its model fuses, in float32 and bfloat16, and the output
matches eager (the demo's speed is measured in docs/benchmarks.md, never asserted here)."""

import pytest

from qfuse.demo import run_demo


@pytest.mark.parametrize("activations", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])  # the CPU default fast
def test_demo_fuses_every_linear(activations, capsys):
    result = run_demo(tokens=9, hidden=64, layers=1, runs=1, activations=activations)
    assert len(result["records"]) == 7 and all(record.fused for record in result["records"])
    tolerance = 1e-5 if activations == "float32" else 6e-2
    assert result["errors"]["qfuse vs eager"] <= tolerance
    assert "linears seen by qfuse: 7, fused: 7" in capsys.readouterr().out
