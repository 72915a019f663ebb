"""Inductor lowerings of qfuse ops. The only place that touches Inductor internals beyond the
pattern matcher: if those internals move, qfuse logs it once and the ops run as extern calls."""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("qfuse")


@functools.cache
def register_lowerings() -> bool:
    """Register qfuse's lowerings with Inductor (once); False if this Inductor cannot take them."""
    import qfuse.ops  # noqa: F401

    try:
        from qfuse.lowerings import int4_weight_only, quantize, scaled_mm, weight_only

        scaled_mm.register()
        weight_only.register()
        int4_weight_only.register()
        quantize.register()
    except (ImportError, AttributeError, TypeError) as error:
        log.warning("qfuse: Inductor lowerings unavailable (%s); fused ops run as extern calls", error)
        return False
    return True
