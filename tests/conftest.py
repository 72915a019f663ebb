"""Shared test fixtures: fresh Dynamo state and no compile caches (a warm FX graph cache would
skip the post-grad passes, so match counts and reports need a real compile); Triton's interpreter
where there is no GPU; and the two tiers: tests marked `slow` (multi-process tensor parallelism,
whole models, the benchmark scripts, Triton's interpreter, tests that start a fresh Python, the forms'
further dtypes and shapes) run with
`--slow` or `-m slow`, as CI's second step does (docs/testing.md); a plain `pytest` leaves them out."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU tensors (set before any kernel is defined,
    # so before qfuse is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from qfuse.config import pass_skipping_caches_off  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_compile_state():
    torch._dynamo.reset()
    with pass_skipping_caches_off():
        yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def no_depyf_dump_left_running():
    """A debug compile through the backend starts a process-wide depyf dump; end it per test."""
    yield
    import qfuse.debug

    qfuse.debug.stop_depyf()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (CI runs them)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow") or "slow" in (config.getoption("markexpr") or ""):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


def pytest_report_header(config):
    if not (config.getoption("--slow") or "slow" in (config.getoption("markexpr") or "")):
        return "the fast tier: tests marked slow are left out (run them with --slow, or only them with -m slow)"
