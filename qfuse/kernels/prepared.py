"""Prepared weights: a weight in the layout one kernel wants, made once per weight.

Kernels that repack (oneDNN), pad (CUTLASS), re-encode (AITER's e4m3fnuz) or pack (XPU int4) their
weight do it in `Kernel.prepare_weight`. `prepare_once` caches the result per kernel and per weight,
so the work runs on the first call only: in eager, under torch.compile, with or without freezing
(the compiled graph hands the op the same parameter storage on every call).

Cache key, per input tensor (weight, its scale, its zero point): a weak reference to the storage
(`StorageWeakRef`: when the weight is freed its entries expire, and the address cannot be reused
while the reference lives), the view's offset, shape, strides and dtype, and the version counter,
so an in-place update of the weight (`load_state_dict`, `copy_`) prepares it again. Inference
tensors have no version counter: they are prepared on every call rather than risk a stale entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef


@dataclass(frozen=True)
class PreparedWeight:
    """The weight of one linear as a kernel consumes it.

    `data`, `scale` and `zero_point` are in the kernel's own layout (the default kernel keeps the
    [K, N] weight, None / [] / [1, N] scale and zero point the ops normalised); `k` and `n` are
    the logical sizes, so a kernel that padded or packed the weight can shape its output.
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    k: int
    n: int


def _tensor_key(tensor: torch.Tensor | None):
    if tensor is None:
        return None
    return (StorageWeakRef(tensor.untyped_storage()), tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype, tensor.device, tensor._version)


def _cacheable(*tensors: torch.Tensor | None) -> bool:
    return not any(t is not None and t.is_inference() for t in tensors)


_CACHE: dict[tuple, PreparedWeight] = {}


def prepare_once(kernel, b: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> PreparedWeight:
    """`kernel.prepare_weight(b, scale, zero_point)`, computed once per weight (see module docstring)."""
    if not kernel.prepares_weight or not _cacheable(b, scale, zero_point):
        return kernel.prepare_weight(b, scale, zero_point)
    key = (kernel.name, _tensor_key(b), _tensor_key(scale), _tensor_key(zero_point))
    prepared = _CACHE.get(key)
    if prepared is None:
        _evict_expired()
        prepared = _CACHE[key] = kernel.prepare_weight(b, scale, zero_point)
    return prepared


def _evict_expired() -> None:
    for key in [key for key in _CACHE if any(part and part[0].expired() for part in key[1:])]:
        del _CACHE[key]


def cached_weight_count() -> int:
    """How many prepared weights are alive (for tests and debug output)."""
    _evict_expired()
    return len(_CACHE)
