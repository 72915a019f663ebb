"""Prepared weights: a weight in the layout one kernel wants, made once per weight.

Kernels that repack (oneDNN), pad (CUTLASS), re-encode (AITER's e4m3fnuz) or pack (XPU int4) their
weight do it in `Kernel.prepare_weight`. `prepare_once` caches the result per kernel and per weight,
so the work runs on the first call only: in eager, under torch.compile, with or without freezing
(the compiled graph hands the op the same parameter storage on every call).

Cache key, per input tensor (weight, its scale, its zero point): a weak reference to the storage
(`StorageWeakRef`: the address cannot be reused while the reference lives), the view's offset,
shape, strides and dtype. Each entry records the inputs' version counters and data addresses (a storage
resized in place, as FSDP does, moves its data under the same counter): where the op sees the
weight's own counter, an in-place update (`load_state_dict`, `copy_`) prepares it again at the next
call, into the same memory where the layout is the same (no second copy per reload). Where it
cannot (a view Inductor makes for an extern call has a counter of its own; a CUDA graph replay
runs no Python), `refresh_weights(model)` prepares a model's weights again, in place.
Inference tensors have no version counter: they are prepared on every call rather than risk a
stale entry.
The cache never holds the weight's own storage (that would keep a deleted model's weight alive):
when the prepared weight is the input weight itself (the kernel had nothing to do), the entry only
records that, and later calls rebuild the (trivial) prepared form from the inputs they are given.
A freed weight's entries go at the next preparation or the next full garbage collection
(`gc.collect()`), whichever comes first. One lock guards the misses: two threads calling a
compiled model for the first time prepare each weight once.

On CUDA a weight is prepared in a helper thread (`outside_cuda_graph_pools`), so that under CUDA
graphs it is no tensor of a graph's memory pool.

Padding helpers shared by kernels that need aligned sizes (zero padding is exact: the extra
products are zero): `padded_weight` once, `padded_activation` per call.
"""

from __future__ import annotations

import dataclasses
import enum
import gc
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

log = logging.getLogger("qfuse")


class Packing(str, enum.Enum):
    """Every layout a prepared weight's `data` can have beside the plain [K, N] matrix (`PreparedWeight.packing`
    None): one name each, so that a kernel reading a prepared weight checks it was made for it."""

    DENSE = "dense"  # an int4 weight no int4 GEMM takes exactly: its float [K, N], dequantized once (exact)
    INT4PACK_CPU = "int4pack_cpu"  # ATen's `_weight_int4pack_mm_for_cpu` layout (`kernels.int4_cpu`)
    INT4PACK_CUDA = "int4pack_cuda"  # ATen's tinygemm layout (`kernels.int4_tinygemm`)
    INT4_ZERO_POINTS_BF16 = "int4_zero_points_bf16"  # qfuse's CPU int4 kernel with zero points, bf16 (`kernels.cpu`)
    INT4_ZERO_POINTS_FP16 = "int4_zero_points_fp16"  # the same, fp16
    INT4_ZERO_POINTS_FP32 = "int4_zero_points_fp32"  # the same, float32 (no rounding of the weight)
    INT4_WORDS_NK = "int4_words_nk"  # int4 words along K, [N, K / 8] (`kernels.int4_words`; the Triton kernels)
    INT4_WORDS_NK_ZEROS_MINUS_ONE = "int4_words_nk_zeros_minus_one"  # the same, zero points of up to 16 minus one
    INT4_MMA_BF16 = "int4_mma_bf16"  # the cuda int4 kernel's words and (s, z) pairs, for bf16 activations
    INT4_MMA_FP16 = "int4_mma_fp16"  # the same, for fp16
    #: the checkpoint's own int4 words, scales and zero points, read where they are by the cuda int4 kernel: `data`
    #: a table of their addresses (`kernels.cuda.int4_mma.checkpoint_weight`), nothing copied
    INT4_CHECKPOINT_BF16 = "int4_checkpoint_bf16"
    INT4_CHECKPOINT_FP16 = "int4_checkpoint_fp16"
    W8_MMA_INT8 = "w8_mma_int8"  # the cuda 8-bit kernel's words of an int8 weight
    W8_MMA_FP8 = "w8_mma_fp8"  # the same, of an fp8 e4m3fn weight

    def __str__(self) -> str:  # its name in messages, on every Python version
        return self.value


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
    packing: Packing | None = None  # how `data` is laid out when it is no plain [K, N] matrix (`Packing`)
    input_order: torch.Tensor | None = None  # the activation's K columns in the order of `data`'s rows
    settings: tuple = ()  # what else a packing's kernel compiles in (the checkpoint words' layout, say)


def dense_int4_weight(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, why: str,
                      group: torch.Tensor | None = None) -> PreparedWeight:
    """The `Packing.DENSE` weight w[k, n] = (values[k, n] - zero_point[group[k], n]) * scale[group[k], n] of an
    int8 [K, N] int4 weight (any integer values; `group` None: contiguous groups of K / scale rows),
    computed in float32, where the product is exact, and rounded once to the scales' dtype. Logged
    once per weight with `why` (a dense weight takes memory the int4 one did not)."""
    k, n = values.shape
    if group is None:
        group = torch.arange(k, device=values.device) // (k // scale.shape[0])
    log.warning("qfuse: an int4 weight [N, K] = [%d, %d] is dequantized once to a dense %s weight (exact): %s",
                n, k, scale.dtype, why)
    difference = values.float() - (0 if zero_point is None else zero_point[group].float())
    weight = (difference * scale[group].float()).to(scale.dtype)
    return PreparedWeight(weight, None, None, *weight.shape, packing=Packing.DENSE)


class _SourceKey(NamedTuple):
    """How a cache key names one source tensor: a weak reference to its storage and the view."""

    storage: StorageWeakRef
    offset: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor | None) -> _SourceKey | None:
        if tensor is None:
            return None
        return cls(_storage(tensor), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype,
                   tensor.device)

    def view_of(self, owner: torch.Tensor) -> torch.Tensor:
        """This view of `owner`'s storage (whose version counter is `owner`'s, not this view's)."""
        with torch.no_grad():
            return torch.empty(0, dtype=self.dtype, device=self.device).set_(owner.untyped_storage(), self.offset,
                                                                             self.shape, self.stride)


def _versions(tensors) -> tuple:
    """Each tensor's version counter and data address: a storage resized in place (FSDP's reshard and unshard)
    moves the data under the same storage and version, and a prepared weight that reads it where it lies
    (`Packing.INT4_CHECKPOINT_*`: a table of addresses) must be made again."""
    return tuple(None if tensor is None else (tensor._version, tensor.data_ptr()) for tensor in tensors)


def _cacheable(*tensors: torch.Tensor | None) -> bool:
    return not any(t is not None and t.is_inference() for t in tensors)


@dataclass
class _Entry:
    """One prepared weight: made by `build(*sources)` from the sources at `versions`."""

    build: Callable[..., PreparedWeight]  # holds no source tensor (a kernel's method, a closure over settings)
    versions: tuple
    prepared: PreparedWeight | None  # None: the kernel uses the weight as given (rebuilt from the call's inputs)


_CACHE: dict[tuple, _Entry] = {}  # key: (label, *source keys)
_LOCK = threading.Lock()  # held while an entry is made or removed: one preparation a weight, whatever the threads


def prepare_once(kernel, b: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> PreparedWeight:
    """`kernel.prepare_weight(b, scale, zero_point)`, computed once per weight (see module docstring); for a
    kernel that reads the weight scale per call (`Kernel.reads_weight_scale_per_call`), once per weight and
    zero point, with this call's `scale` attached."""
    if not kernel.prepares_weight:
        return kernel.prepare_weight(b, scale, zero_point)
    if kernel.reads_weight_scale_per_call:
        return dataclasses.replace(built_once((kernel.name,), (b, None, zero_point), kernel.prepare_weight), scale=scale)
    return built_once((kernel.name,), (b, scale, zero_point), kernel.prepare_weight)


def built_once(label: tuple, sources: tuple[torch.Tensor | None, ...], build) -> PreparedWeight:
    """`build(*sources)`, computed once per `label` and `sources` (keyed as the module docstring
    says) and again after an in-place update of a source. `build` must hold no tensor of its own
    (the entry keeps it, to prepare the weight again)."""
    recent = _recent_entry(label, sources)  # (never an inference tensor's: those are not remembered)
    if recent is not None and recent.versions == _versions(sources):
        return build(*sources) if recent.prepared is None else recent.prepared
    if not _cacheable(*sources):
        return build(*sources)
    versions = _versions(sources)
    key = (label, *(_SourceKey.of(source) for source in sources))
    entry = _CACHE.get(key)
    if entry is None or entry.versions != versions:
        with _LOCK:  # another thread may have made it meanwhile: look again
            entry = _CACHE.get(key)
            if entry is None or entry.versions != versions:
                entry, prepared = _prepared_entry(key, sources, versions, build, entry)
                _remember(label, sources, entry)
                return prepared
    _remember(label, sources, entry)
    return build(*sources) if entry.prepared is None else entry.prepared


def _prepared_entry(key: tuple, sources: tuple, versions: tuple, build, stale: _Entry | None) -> tuple[_Entry, PreparedWeight]:
    """(the entry, the weight) prepared from `sources` (under the lock) and remembered under `key`, into the
    memory of the `stale` entry's weight where the layout is the same."""
    prepared = _rebuilt(stale and stale.prepared, build, sources)
    opaque = prepared.data.layout != torch.strided  # e.g. a packed MKLDNN tensor: never an input
    as_given = not opaque and _storage(prepared.data) in _storages(sources)
    entry = _Entry(build, versions, None if as_given else prepared)
    _evict_expired()
    _CACHE[key] = entry
    return entry, prepared


#: (label, the sources' ids) -> (weak references to the sources, a weak reference to the entry): a compiled graph
#: hands each call its weights as the same tensors, so a repeated call finds its entry here without the keys (a
#: storage reference and view a source, the costliest part of a hit). A source gone misses; the caller checks the
#: entry's versions, which hold the sources' addresses too (new memory, `param.data = ...`, moves no version).
_RECENT: dict[tuple, tuple] = {}
_RECENT_MOST = 4096  # entries of dropped models' tensors are cleared past this many


def _recent_entry(label: tuple, sources: tuple) -> _Entry | None:
    recent = _RECENT.get((label, *map(id, sources)))
    if recent is None:
        return None
    references, entry = recent
    if any(source is not None and reference() is not source for reference, source in zip(references, sources)):
        return None
    return entry()


def _remember(label: tuple, sources: tuple, entry: _Entry) -> None:
    if len(_RECENT) >= _RECENT_MOST:
        _RECENT.clear()
    references = tuple(None if source is None else weakref.ref(source) for source in sources)
    _RECENT[(label, *map(id, sources))] = (references, weakref.ref(entry))  # (the cache owns the entry)


def _rebuilt(old: PreparedWeight | None, build, sources: tuple) -> PreparedWeight:
    """`build(*sources)`, written into `old`'s tensors when their layouts are the same (a weight
    loaded again in place: the memory a captured CUDA graph reads stays the same), else new."""
    anchor = next(source for source in sources if source is not None)
    return outside_cuda_graph_pools(lambda: _refilled(old, build(*sources), _storages(sources)), anchor)


def _refilled(old: PreparedWeight | None, new: PreparedWeight, inputs: set) -> PreparedWeight:
    if old is None or type(old) is not type(new):  # a kernel's subclass may add fields (oneDNN's packed weight)
        return new
    pairs = [(getattr(old, field.name), getattr(new, field.name)) for field in dataclasses.fields(old)]
    if not all(_refillable(old_value, new_value, inputs) for old_value, new_value in pairs):
        return new
    for old_value, new_value in pairs:
        if isinstance(old_value, torch.Tensor) and _storage(old_value) != _storage(new_value):
            old_value.copy_(new_value)
    return old


def _refillable(old, new, inputs: set) -> bool:
    """Whether `new` can be written into `old`: equal settings, or tensors of one layout in memory of
    the cache's own (an input the kernel kept as it is, such as a scale, is the same tensor again)."""
    if not isinstance(old, torch.Tensor) or not isinstance(new, torch.Tensor):
        return not isinstance(old, torch.Tensor) and not isinstance(new, torch.Tensor) and old == new
    if old.layout != torch.strided or new.layout != torch.strided:
        return False
    if _storage(old) == _storage(new):
        return old.storage_offset() == new.storage_offset() and old.shape == new.shape and old.stride() == new.stride()
    return (_storage(old) not in inputs and old.shape == new.shape and old.stride() == new.stride()
            and old.dtype == new.dtype and old.device == new.device)


def _storage(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def _storages(tensors) -> set:
    return {_storage(tensor) for tensor in tensors if tensor is not None}


def refresh_weights(model: torch.nn.Module) -> int:
    """Prepare again, in place, every prepared weight made from `model`'s parameters and buffers;
    returns how many. Call it after changing the weights in place (a checkpoint loaded with
    `load_state_dict`, weights synced from a trainer): the next call, or CUDA graph replay, computes
    with the new weights from the same memory.

    Why it is needed: a call notices a changed weight by its version counter only where the op is
    handed the weight as the model holds it (or as a view torch tracks). Inductor hands a transposed
    or reshaped weight to an extern op as its own view, whose counter starts again at 0 on every
    call, and a CUDA graph replay runs no Python at all."""
    owners = {_storage(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
    refreshed = 0
    with _LOCK:
        for key, entry in list(_CACHE.items()):
            parts = key[1:]
            if entry.prepared is None or any(part is not None and part.storage not in owners for part in parts):
                continue
            sources = tuple(None if part is None else part.view_of(owners[part.storage]) for part in parts)
            entry.prepared = _rebuilt(entry.prepared, entry.build, sources)
            refreshed += 1
    return refreshed


@dataclass(frozen=True)
class PreparedMemory:
    """What the prepared weights made from one model's tensors cost (`prepared_memory`)."""

    weights: int  # prepared weights (a sibling call's concatenation is one)
    prepared_bytes: int  # their tensors, where they are no source tensor itself
    source_bytes: int  # the model's stored tensors they were made from
    dense: int  # of them, full-precision copies (an int4 weight no int4 kernel takes exactly: `Packing.DENSE`)

    def describe(self) -> str:
        if not self.weights:
            return "prepared weights: none (every kernel reads the stored weights as they are)"
        dense = f"; {self.dense} of them dense (a full-precision copy, exact)" if self.dense else ""
        return (f"prepared weights: {self.weights}, {_size(self.prepared_bytes)} in the kernels' own layouts, beside "
                f"the {_size(self.source_bytes)} of stored tensors they were made from{dense}")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def prepared_memory(model: torch.nn.Module) -> PreparedMemory:
    """The prepared weights alive now that were made from `model`'s parameters and buffers, and their bytes."""
    owners = {_storage(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
    weights = prepared_bytes = dense = 0
    sources: dict = {}
    with _LOCK:
        _evict_expired()
        for key, entry in _CACHE.items():
            parts = [part for part in key[1:] if part is not None]
            if entry.prepared is None or not parts or any(part.storage not in owners for part in parts):
                continue
            weights += 1
            dense += entry.prepared.packing == Packing.DENSE
            inputs = {part.storage for part in parts}
            for value in vars(entry.prepared).values():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.layout != torch.strided:  # an opaque packed weight (oneDNN's): its elements
                    prepared_bytes += value.numel() * value.element_size()
                elif _storage(value) not in inputs:
                    prepared_bytes += value.untyped_storage().nbytes()
            sources.update({part.storage: owners[part.storage].untyped_storage().nbytes() for part in parts})
    return PreparedMemory(weights, prepared_bytes, sum(sources.values()), dense)


def outside_cuda_graph_pools(build, weight: torch.Tensor):
    """`build()`, its CUDA allocations kept out of a CUDA graph's memory pool.

    While Inductor's CUDA graph trees (mode="reduce-overhead") warm up or record a graph, every
    allocation of the calling thread goes to that graph's pool, and a prepared weight cached past
    the call would be a pool tensor no graph output accounts for (an error at the next recording).
    A helper thread allocates from the ordinary pool; this thread waits for it, and for its kernels.
    Preparing during a capture itself would put the preparation into the graph: refused (the graph
    trees warm every graph up before they record it, so the weight is ready by then)."""
    if weight.device.type != "cuda":
        return build()
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("qfuse prepares a weight on its first call, which must not be inside a CUDA graph "
                           "capture: run the model once before capturing it")
    result: dict = {}
    caller_stream = torch.cuda.current_stream(weight.device)

    def run():  # a new thread inherits neither the grad mode nor the stream: no autograd graph, work after the caller's
        try:
            with torch.cuda.device(weight.device), torch.no_grad():
                torch.cuda.current_stream().wait_stream(caller_stream)
                result["value"] = build()
                torch.cuda.current_stream().synchronize()
        except BaseException as error:  # noqa: BLE001 (handed to the waiting thread, which raises it)
            result["error"] = error

    helper = threading.Thread(target=run, name="qfuse-prepare-weight")
    helper.start()
    helper.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _evict_expired() -> None:
    """Drop the entries of freed weights (under the lock)."""
    for key in [key for key in _CACHE if any(part and part.storage.expired() for part in key[1:])]:  # key[0]: the label
        del _CACHE[key]


def _evict_after_full_collection(phase: str, info: dict) -> None:
    """A gc callback: a dropped model's prepared weights go at the next full collection (`gc.collect()`),
    not only at the next preparation. Skipped while an entry is being made (by this thread or another)."""
    if phase == "stop" and info["generation"] == 2 and _LOCK.acquire(blocking=False):
        try:
            _evict_expired()
        finally:
            _LOCK.release()


gc.callbacks.append(_evict_after_full_collection)


def prepared_weights() -> list[PreparedWeight]:
    """The prepared weights alive now (for tests and debug output)."""
    with _LOCK:
        _evict_expired()
        return [entry.prepared for entry in _CACHE.values() if entry.prepared is not None]


def cached_weight_count() -> int:
    """How many prepared weights are alive."""
    return len(prepared_weights())


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def padded_weight(b: torch.Tensor, k_multiple: int, n_multiple: int = 1) -> torch.Tensor:
    """The [K, N] weight column-major and zero padded to [K', N'] (b itself if it already is)."""
    k, n = b.shape
    if k % k_multiple == 0 and n % n_multiple == 0 and b.stride(0) == 1:
        return b
    column_major = b.new_zeros((round_up(n, n_multiple), round_up(k, k_multiple)))
    column_major[:n, :k] = b.t()
    return column_major.t()


def padded_activation(a: torch.Tensor, k_padded: int) -> torch.Tensor:
    """a [M, K] with zero columns appended up to k_padded (a itself when nothing is missing)."""
    return a if a.shape[1] == k_padded else torch.nn.functional.pad(a, (0, k_padded - a.shape[1]))
