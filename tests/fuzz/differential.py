"""Run one generated case three ways (eager, plain Inductor, backend="qfuse") and judge qfuse.

The rules, in order:
1. qfuse's compile never fails where plain Inductor's does not (but a forced kernel that cannot run a linear
   raises `KernelUnavailableError`, as documented), nor where the fused op lifts the limits of a CUDA `_int_mm`
   that fails plain Inductor on the user's own call (`_lifts_int_mm_limits`); where eager raises, qfuse raises
   the same exception type (or, where plain Inductor returns instead, returns what Inductor returns).
2. Wherever plain Inductor agrees with eager, qfuse agrees with eager: the same nan and inf
   positions (signs included) and finite values within the output dtype's rounding (integer GEMMs
   are exact; the float epilogue may sum and round in another order). A form whose compiled code
   plain Inductor already gets different from eager (a rounding tie, nan cast to int8) is judged on
   rule 1 and 3 only. Where plain Inductor raises and qfuse returns, qfuse agrees with eager.
   Eager's `torch._int_mm` is the exact product wherever the kernel would refuse or err (`_exact_int_mm`):
   on CUDA, cuBLASLt's limits (M > 16, K and N multiples of 8) are lifted by zero padding, as qfuse's fused
   op lifts them, so the judge is eager on the same device (where plain Inductor's compile of the user's call
   raises, it also compiles the padded call, to know whether it agrees with eager there);
   on the CPU, where K == 1 gives garbage that could agree with Inductor's and judge qfuse wrong, it is the
   outer product (eager's only: Inductor's own garbage then tells the judge it disagrees).
3. A near form is not fused as W8A8 (a weight-only linear of its float activation is fine); a form
   that must fuse (`Case.why_it_may_stay_unfused` is '') is fused, every linear of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.nn.functional as F

import qfuse
from qfuse.config import pass_skipping_caches_off
from qfuse.kernels.prepared import round_up
from qfuse.platform import CUDA_INT_MM_MIN_ROWS
from tests.fuzz.cases import DEVICE, Case, build

#: a forced kernel that cannot run a linear raises, as documented (docs/debugging.md): no failure of qfuse's
FORCED_KERNEL_REFUSES = "KernelUnavailableError: forced kernel"

#: max |out - eager| allowed, relative to max |eager| over finite values, by output dtype
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@dataclass
class Outcome:
    case: Case
    fused: int = 0  # linears qfuse fused
    fused_schemes: list[str] = field(default_factory=list)
    near_misses: list[str] = field(default_factory=list)
    inductor_agrees: bool = True
    problems: list[str] = field(default_factory=list)

    def failure(self) -> str:
        return "\n".join([f"{self.case!r}", *self.problems, f"repro: {self.case.repro()}"])


def difference(out, reference) -> str:
    """'' when `out` agrees with `reference` (rule 2: integers equal, finite values within the output dtype's
    `TOLERANCE`), else what differs."""
    outs = out if isinstance(out, tuple) else (out,)
    references = reference if isinstance(reference, tuple) else (reference,)
    for index, (value, expected) in enumerate(zip(outs, references, strict=True)):
        where = f"output {index}: " if len(outs) > 1 else ""
        if value.shape != expected.shape or value.dtype != expected.dtype:
            return f"{where}{value.dtype}{list(value.shape)} instead of {expected.dtype}{list(expected.shape)}"
        if not value.is_floating_point():
            if not torch.equal(value, expected):
                return f"{where}{(value != expected).sum()} integer elements differ"
            continue
        value, expected = value.float(), expected.float()
        if not torch.equal(value.isnan(), expected.isnan()):
            return f"{where}nan at {int(value.isnan().sum())} places instead of {int(expected.isnan().sum())}"
        infinite = expected.isinf()
        if not torch.equal(value.isinf(), infinite) or not torch.equal(value[infinite], expected[infinite]):
            return f"{where}inf at {int(value.isinf().sum())} places instead of {int(infinite.sum())}"
        finite = expected.isfinite()
        if finite.any():
            error = (value[finite] - expected[finite]).abs().max().item()
            size = max(expected[finite].abs().max().item(), 1e-6)
            if error > TOLERANCE[outs[0].dtype] * size:
                return f"{where}max error {error:.3g} against max |eager| {size:.3g}"
    return ""


_INT_MM = torch._int_mm


#: what CUDA `_int_mm` (cuBLASLt) takes besides more than 16 rows (`CUDA_INT_MM_MIN_ROWS`): K and N multiples of 8
CUDA_INT_MM_MULTIPLE = 8


def _exact_int_mm(a, b):
    """torch._int_mm as it should be, where eager runs it (the judge). On the CPU (torch 2.13) it returns
    garbage when K == 1, and garbage that two runs may share, so eager and Inductor's own code (which calls it
    too) can agree on it: the outer product instead. On CUDA it refuses M <= 16 and K, N not multiples of 8:
    zero rows and columns lift that and leave every integer sum as it is (qfuse's fused op pads the same way)."""
    (m, k), n = a.shape, b.shape[1]
    if a.device.type == "cpu" and k == 1:
        return a.to(torch.int32) * b.to(torch.int32)
    if a.device.type == "cuda":
        rows, inner, columns = max(m, CUDA_INT_MM_MIN_ROWS), round_up(k, CUDA_INT_MM_MULTIPLE), round_up(n, CUDA_INT_MM_MULTIPLE)
        if (rows, inner, columns) != (m, k, n):  # b keeps its layout (a transposed [N, K] weight stays one)
            padded_b = (F.pad(b.t(), (0, inner - k, 0, columns - n)).t() if b.stride(0) == 1
                        else F.pad(b, (0, columns - n, 0, inner - k)))
            return _INT_MM(F.pad(a, (0, inner - k, 0, rows - m)), padded_b)[:m, :n]
    return _INT_MM(a, b)


def _lifts_int_mm_limits(case: Case) -> bool:
    """Whether qfuse fuses the case's `_int_mm` (no second user of its sums, no near form, no forced kernel that
    may decline), so that the fused op's padding lifts cuBLASLt's limits the user's own call fails on."""
    return case.second_user != "accumulator" and not case.near and case.kernel in ("", "reference")


def _run(function, inputs):
    try:
        return function(*inputs), None
    except Exception as error:  # noqa: BLE001 - compared with eager's below
        return None, error


def run_case(case: Case) -> Outcome:
    """Judge qfuse on `case`; `outcome.problems` is empty when it passes."""
    outcome = Outcome(case)
    model, inputs = build(case)
    with torch.no_grad():
        with mock.patch.object(torch, "_int_mm", _exact_int_mm):
            eager, eager_error = _run(model, inputs)
        torch._dynamo.reset()
        inductor, inductor_error = _run(torch.compile(model, dynamic=case.dynamic), inputs)
        torch._dynamo.reset()
        padded_inductor, padded_inductor_error = inductor, inductor_error
        if inductor_error is not None and DEVICE == "cuda":
            # where cuBLASLt refuses, plain Inductor also compiles eager's padded _int_mm, so whether it agrees with
            # eager is known there too (its float code can round a quantizer's input differently from eager); the
            # user's own program (unpadded) still decides whether qfuse may fail
            with mock.patch.object(torch, "_int_mm", _exact_int_mm):
                padded_inductor, padded_inductor_error = _run(torch.compile(model, dynamic=case.dynamic), inputs)
            torch._dynamo.reset()
        marker = qfuse.graphs_compiled()
        compiled = torch.compile(model, backend="qfuse", dynamic=case.dynamic,
                                 options={"kernel": case.kernel} if case.kernel else None)
        with pass_skipping_caches_off():
            out, error = _run(compiled, inputs)
        torch._dynamo.reset()
    reports = qfuse.reports_since(marker)
    outcome.fused_schemes = [record.scheme for report in reports for record in report.fused]
    outcome.fused = len(outcome.fused_schemes)
    outcome.near_misses = [record.reason for report in reports for record in report.near_misses]
    outcome.problems += [f"qfuse internal error: {e}" for report in reports for e in report.errors]
    if error is not None and case.kernel and FORCED_KERNEL_REFUSES in str(error):
        return outcome  # documented: a forced kernel that cannot run a linear raises
    if eager_error is not None:
        if inductor_error is None:  # compiled code may lift eager's limits: as Inductor
            if error is not None or (problem := difference(out, inductor)):
                outcome.problems.append(f"eager raises {eager_error!r}, Inductor returns, qfuse "
                                        f"{repr(error) if error is not None else 'differs from it: ' + problem}")
        elif error is None or not (isinstance(error, type(eager_error)) or type(error) is type(inductor_error)):
            # Dynamo wraps an error raised while tracing in a subclass of the error's type
            outcome.problems.append(f"eager raises {eager_error!r}, qfuse {'returns' if error is None else repr(error)}")
        return outcome
    if error is not None:
        if inductor_error is None:
            outcome.problems.append(f"qfuse's compile fails where Inductor's does not: {error!r}")
        elif padded_inductor_error is None and _lifts_int_mm_limits(case):
            outcome.problems.append(f"qfuse's compile fails where its fused op lifts _int_mm's limits: {error!r}")
        return outcome
    if padded_inductor_error is None:
        outcome.inductor_agrees = not difference(padded_inductor, eager)
        if outcome.inductor_agrees and (problem := difference(out, eager)):
            outcome.problems.append(f"qfuse differs from eager where Inductor agrees: {problem}")
    elif problem := difference(out, eager):  # qfuse lifts a limit plain Inductor keeps
        outcome.problems.append(f"qfuse differs from eager where Inductor raises: {problem}")
    if case.near and any("weight-only" not in scheme for scheme in outcome.fused_schemes):
        outcome.problems.append(f"a near form ({case.form}) was fused as {outcome.fused_schemes}")
    linears = 2 if case.form == "mlp" else 1
    if DEVICE == "cpu" and not case.why_it_may_stay_unfused() and outcome.fused < linears:
        outcome.problems.append(f"fused {outcome.fused} of {linears} linears: {outcome.near_misses or 'no candidate'}")
    return outcome
