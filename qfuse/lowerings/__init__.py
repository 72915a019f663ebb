"""Inductor lowerings of qfuse ops, one module per kernel beside the kernel's own (`qfuse.kernels`):
`torch_native`, `cutlass`, `onednn`, `triton`, `cuda`. Each says, per op, what it takes (`why_not`) and how it
enters Inductor's code (`lower`); `dispatch` gives Inductor one lowering per op, which finds the kernel
of the call's M bucket and its lowering, or the op's extern call. The only place that touches
Inductor internals beyond the pattern matcher: if those move, qfuse logs it once and the ops run as
extern calls."""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("qfuse")


@functools.cache
def register_lowerings() -> bool:
    """Register qfuse's lowerings with Inductor (once); False if this Inductor cannot take them."""
    import qfuse.ops  # noqa: F401

    try:
        from qfuse.lowerings import cuda, cutlass, dispatch, onednn, torch_native, triton

        for kernel_lowerings in (torch_native, cutlass, onednn, triton, cuda):
            dispatch.add(kernel_lowerings.KERNEL, kernel_lowerings.LOWERINGS)
        dispatch.add_inductors_own(triton.INDUCTORS_OWN)
        dispatch.register()
    except (ImportError, AttributeError, TypeError) as error:
        log.warning("qfuse: Inductor lowerings unavailable (%s); fused ops run as extern calls", error)
        return False
    return True
