"""One Inductor lowering per qfuse op: the kernel of the call's M bucket, then that kernel's own lowering.

    kernel   = the pass's choice (the op's `kernel` argument); where M is dynamic, kernel choice is
               asked again for M's bucket (`KernelRequest.choose_by_rows`, each bound guarded by
               `ir.rows_at_most`): the one choice of `qfuse.kernels.registry`, for a static and a dynamic M
               alike, under the same configuration (a forced kernel has no buckets; preferred and disabled
               kernels apply per bucket), taken where the bucket kernel's lowering takes the call
    lowering = the `KernelLowering` that kernel's module registered for the op (`lowerings/<kernel>.py`)
    out      = lowering.lower(call) where lowering.why_not(call) is '', else the op's extern call with
               that kernel, and why (in the record and the debug log); where a dynamic M's bucket has no
               kernel that beats Inductor's own code, that code (the op's math in IR, `add_inductors_own`)

No lowering compares kernel names: a kernel's module says what it takes and how it enters the code,
beside the kernel's eager `apply` (docs/architecture.md, "A kernel").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
from torch._inductor import lowering as inductor_lowering

from qfuse.lowerings.ir import (current_record, extern_call, falls_back_to_extern_call, record_lowering, rows_and_k,
                                rows_at_most)
from qfuse.ops import SIBLING_ARGUMENTS
from qfuse.platform import current_platform


@dataclass(frozen=True)
class KernelLowering:
    """How one kernel's call of one op enters Inductor's generated code."""

    #: '' if `lower` takes the call (the op's named arguments, their tensors Inductor IR), else why the
    #: op stays an extern call. It guards a dynamic M (`ir.rows_at_most`) only where it must to answer.
    why_not: Callable[[Any], str]
    #: the op's result in IR; it writes how into the record (`ir.record_lowering`)
    lower: Callable[[Any], Any]


#: (op's named-arguments class, kernel name) -> its lowering; filled by `add` from each kernel's module
_LOWERINGS: dict[tuple[type, str], KernelLowering] = {}
#: op's named-arguments class -> Inductor's own code for a call of it, `lower(call, why)` (the op's math in IR, what
#: Inductor makes of the unfused graph): for a dynamic M's bucket where kernel choice finds Inductor's code faster
_INDUCTORS_OWN: dict[type, Callable[[Any, str], Any]] = {}


def add(kernel: str, lowerings: dict[type, KernelLowering]) -> None:
    """Register `kernel`'s lowerings, by the named-arguments class of the op each lowers."""
    for arguments_type, lowering in lowerings.items():
        _LOWERINGS[arguments_type, kernel] = lowering


def add_inductors_own(lowerings: dict[type, Callable[[Any, str], Any]]) -> None:
    """Register Inductor's own code for ops, by their named-arguments class."""
    _INDUCTORS_OWN.update(lowerings)


def _kernel_of_bucket(call) -> tuple[Any, str, bool]:
    """(the call with the kernel of its M bucket, why that is not the pass's kernel or '', whether Inductor's own
    code runs the bucket instead of any kernel). The op's first argument is its activation, whose leading dims are
    M. A static M was chosen for by the pass; an op the passes did not emit has no request to ask again. The
    bucket's kernel is taken where its lowering takes the call, or where it has none for this op (it runs as the
    op's extern call by design); where its lowering declines the call, the pass's kernel stays (an extern call of
    another kernel than the one measured would prepare a second copy of the weight for no measured gain). A bucket
    where every kernel is slower than Inductor's own code gets that code where the op has it
    (`add_inductors_own`), else the pass's kernel."""
    record = current_record()
    request = None if record is None else record.request
    rows = rows_and_k(call[0])[0]
    if request is None or sympy.sympify(rows).is_number:
        return call, "", False
    platform = current_platform(call[0].get_device().type)
    choice, bucket = request.choose_by_rows(platform, lambda bound: rows_at_most(rows, bound))
    if choice.kernel is None and type(call) in _INDUCTORS_OWN:
        return call, f"{bucket} (a dynamic M, guarded): {choice.rejections()}", True
    if choice.kernel is None or choice.kernel.name == call.kernel:
        return call, "", False
    bucket_call = call._replace(kernel=choice.kernel.name)
    lowering = _LOWERINGS.get((type(call), bucket_call.kernel))
    if lowering is not None and lowering.why_not(bucket_call):
        return call, "", False
    why = (f"{bucket} (a dynamic M, guarded) runs {choice.kernel.name}, not {call.kernel}: "
           f"{choice.rejected.get(call.kernel, '')}")
    return bucket_call, why, False


def _lowering_of(arguments_type: type) -> Callable:
    @falls_back_to_extern_call(arguments_type)
    def lowering(*args, **kwargs):
        call, why_this_kernel, inductors_own = _kernel_of_bucket(arguments_type(*args, **kwargs))
        if inductors_own:
            return _INDUCTORS_OWN[arguments_type](call, why_this_kernel)
        kernel_lowering = _LOWERINGS.get((arguments_type, call.kernel))
        reason = (f"kernel {call.kernel!r} runs as an extern call" if kernel_lowering is None
                  else kernel_lowering.why_not(call))
        out = extern_call(call, reason) if reason else kernel_lowering.lower(call)
        if why_this_kernel:  # the report says why, before how the bucket's kernel was lowered
            record_lowering(f"{why_this_kernel}: {current_record().lowered}")
        return out
    return lowering


def register() -> None:
    """Give Inductor one lowering for each op that a kernel lowers, and for the sibling ops (whose kernels run
    them as extern calls: the lowering chooses the kernel of a dynamic M's bucket)."""
    lowered = [arguments_type for arguments_type, _ in _LOWERINGS]
    for arguments_type in dict.fromkeys([*lowered, *SIBLING_ARGUMENTS.values()]):
        inductor_lowering.register_lowering(arguments_type.op, type_promotion_kind=None)(_lowering_of(arguments_type))
