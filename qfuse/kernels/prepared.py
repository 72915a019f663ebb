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
The cache never holds the weight's own storage (that would keep a deleted model's weight alive):
when the prepared weight is the input weight itself (the kernel had nothing to do), the entry only
records that, and later calls rebuild the (trivial) prepared form from the inputs they are given.

On CUDA a weight is prepared in a helper thread (`outside_cuda_graph_pools`), so that under CUDA
graphs it is no tensor of a graph's memory pool.

Padding helpers shared by kernels that need aligned sizes (zero padding is exact: the extra
products are zero): `padded_weight` once, `padded_activation` per call.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

log = logging.getLogger("qfuse")


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
    packing: str = ""  # how `data` is packed when it is no [K, N] matrix (e.g. "int4pack_cpu")
    input_order: torch.Tensor | None = None  # the activation's K columns in the order of `data`'s rows


#: PreparedWeight.packing of an int4 weight no int4 GEMM can take exactly: its float [K, N] matrix,
#: dequantized once, which `qfuse::int4_weight_only_mm` multiplies by a plain matmul
DENSE = "dense"


def dense_int4_weight(values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, why: str,
                      group: torch.Tensor | None = None) -> PreparedWeight:
    """The DENSE weight w[k, n] = (values[k, n] - zero_point[group[k], n]) * scale[group[k], n] of an
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
    return PreparedWeight(weight, None, None, *weight.shape, packing=DENSE)


def _tensor_key(tensor: torch.Tensor | None):
    if tensor is None:
        return None
    return (StorageWeakRef(tensor.untyped_storage()), tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype, tensor.device, tensor._version)


def _cacheable(*tensors: torch.Tensor | None) -> bool:
    return not any(t is not None and t.is_inference() for t in tensors)


_CACHE: dict[tuple, PreparedWeight | object] = {}
_AS_GIVEN = object()  # cache entry: the kernel uses this weight as given (nothing to prepare)


def prepare_once(kernel, b: torch.Tensor, scale: torch.Tensor | None, zero_point: torch.Tensor | None) -> PreparedWeight:
    """`kernel.prepare_weight(b, scale, zero_point)`, computed once per weight (see module docstring)."""
    if not kernel.prepares_weight or not _cacheable(b, scale, zero_point):
        return kernel.prepare_weight(b, scale, zero_point)
    key = (kernel.name, _tensor_key(b), _tensor_key(scale), _tensor_key(zero_point))
    prepared = _CACHE.get(key)
    if prepared is _AS_GIVEN:
        return kernel.prepare_weight(b, scale, zero_point)
    if prepared is None:
        prepared = outside_cuda_graph_pools(lambda: kernel.prepare_weight(b, scale, zero_point), b)
        opaque = prepared.data.layout != torch.strided  # e.g. a packed MKLDNN tensor: never the input
        as_given = not opaque and StorageWeakRef(prepared.data.untyped_storage()) == key[1][0]
        _remember(key, _AS_GIVEN if as_given else prepared)
    return prepared


def built_once(label: tuple, tensors: tuple[torch.Tensor | None, ...], build) -> PreparedWeight:
    """`build()`, computed once per `label` and `tensors` (keyed as the module docstring says), for a
    prepared weight made from several stored tensors (a packed int4 weight, its shifts, scales and
    zero points). Its result must not be one of `tensors` itself."""
    if not _cacheable(*tensors):
        return build()
    key = (label, *(_tensor_key(tensor) for tensor in tensors))
    prepared = _CACHE.get(key)
    if prepared is None:
        prepared = outside_cuda_graph_pools(build, next(tensor for tensor in tensors if tensor is not None))
        _remember(key, prepared)
    return prepared


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


def _remember(key: tuple, entry) -> None:
    _evict_expired()
    _CACHE[key] = entry


def _evict_expired() -> None:
    for key in [key for key in _CACHE if any(part and part[0].expired() for part in key[1:])]:  # key[0]: the label
        del _CACHE[key]


def cached_weight_count() -> int:
    """How many prepared weights are alive (for tests and debug output)."""
    _evict_expired()
    return sum(entry is not _AS_GIVEN for entry in _CACHE.values())


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
