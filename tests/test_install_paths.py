"""The README's demo install has no triton (and zentorch only where it installs): the fused forms compile and run
on the CPU there, and nothing imports triton on the way (issue #41).

A subprocess blocks `import triton` and `import zentorch` (an import hook raises, as on a machine without them;
Inductor's own `has_triton()` then says no, and an import of triton from qfuse's code is recorded), compiles the demo's forms on the CPU with
backend="qfuse" and checks that each fused, matches eager and left no qfuse internal error. `.ci/run` also runs
the CPU tests of the fused forms in an environment installed the way the demo command installs."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a fresh Python compiling the demo's forms: CI's slow tier and its demo-install step

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import importlib.util, os, sys, traceback, warnings

    ABSENT = {"triton", "zentorch"}
    QFUSE = os.path.join(os.getcwd(), "qfuse") + os.sep  # the package's own files (the test runs from the root)
    probe = importlib.util.find_spec  # a probe for them finds nothing, as where they are not installed
    importlib.util.find_spec = lambda name, package=None: None if name.split(".")[0] in ABSENT else probe(name, package)

    class NoTriton:  # importing them raises, as where they are not installed; triton from qfuse's code is recorded
        from_qfuse = []

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] not in ABSENT:
                return None
            if name.split(".")[0] != "triton":
                raise ModuleNotFoundError(f"No module named {name!r}")
            importer = [frame for frame in traceback.extract_stack()[:-1] if "importlib" not in frame.filename][-1]
            if importer.filename.startswith(QFUSE):  # the import statement is qfuse's own (not torch's probe)
                NoTriton.from_qfuse.append(f"{importer.filename}:{importer.lineno}")
            raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, NoTriton())
    import torch
    import qfuse
    from qfuse.errors import QfuseInternalWarning
    warnings.simplefilter("error", QfuseInternalWarning)
    from tests.passes.test_reference_linear import int_mm_linear, operands
    from tests.peers.weight_only_models import gptq_packed_int4, hand_written_int8

    torch._inductor.config.force_disable_caches = True
    x, w, w_scale, bias = operands((5, 64))
    forms = [(int_mm_linear, (x, w, w_scale, bias)),
             (hand_written_int8(torch.bfloat16, True, in_features=64, out_features=48), (x.bfloat16(),)),
             (gptq_packed_int4(torch.bfloat16, group_size=32, in_features=64, out_features=48), (x.bfloat16(),))]
    for model, args in forms:
        marker = qfuse.graphs_compiled()
        torch._dynamo.reset()
        with torch.no_grad():
            out, expected = torch.compile(model, backend="qfuse")(*args), model(*args)
        records = [record for report in qfuse.reports_since(marker) for record in report.records]
        assert records and all(record.fused for record in records), [record.reason for record in records]
        assert "internal error" not in " ".join(record.lowered for record in records), records
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert not NoTriton.from_qfuse, f"qfuse imported triton at {NoTriton.from_qfuse}"
    print("ok", len(forms))
""")


def test_the_fused_forms_compile_on_the_cpu_without_triton_or_zentorch():
    result = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "ok 3" in result.stdout, result.stderr[-4000:]
