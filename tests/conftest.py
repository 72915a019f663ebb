"""Shared test fixtures: fresh Dynamo state and no compile caches (a warm FX graph cache would
skip the post-grad passes, so match counts and reports need a real compile); Triton's interpreter
where there is no GPU."""

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
