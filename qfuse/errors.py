"""How qfuse fails: never by breaking the user's compile.

qfuse is an optimisation. An exception inside one of its passes, its kernel choice or its
lowerings is a bug in qfuse, not in the model, so it must not reach `torch.compile`'s caller: the
part that failed is undone (the linear stays as it was, the op runs as an extern call), the reason
goes into the graph's report, and a `QfuseInternalWarning` is issued once per distinct failure.

Errors that are the user's own (a kernel asked for by name that cannot run, an unknown option)
are `QfuseUserError`s: they are raised to the user, never caught as internal errors.
"""

from __future__ import annotations

import logging
import traceback
import warnings

log = logging.getLogger("qfuse")

_warned: set[str] = set()


class QfuseUserError(RuntimeError):
    """What the user asked qfuse for cannot be done here; the message says why."""


class QfuseInternalWarning(RuntimeWarning):
    """qfuse hit an internal error and left that part of the graph to Inductor (please report it)."""


def describe_failure(stage: str, error: BaseException) -> str:
    """One line naming the stage and the error: '<stage> failed: ValueError: ...'."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{stage} failed: {type(error).__name__}" + (f": {message}" if message else "")


def contain_internal_error(stage: str, error: Exception, fallback: str) -> str:
    """Called with an exception caught in `stage`: a `QfuseUserError` is re-raised (it is the user's
    to see); any other is a bug in qfuse, and this warns (once per distinct failure) that `stage`
    failed and what qfuse did instead (`fallback`), and returns the one-line reason for the report.
    The traceback goes to the qfuse logger at DEBUG."""
    if isinstance(error, QfuseUserError):
        raise error
    reason = f"qfuse internal error, {fallback}: {describe_failure(stage, error)}"
    log.debug("%s\n%s", reason, "".join(traceback.format_exception(error)))
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(reason, QfuseInternalWarning, stacklevel=2)
    return reason
