"""The linter over the package, its benchmarks and tests (ruff, configured in pyproject.toml): an undefined
name in code that runs only on a GPU (a lowering, a benchmark) fails here, in CI, instead of on the GPU."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    result = subprocess.run([ruff, "check", "--no-cache", "qfuse", "benchmarks", "tests"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
