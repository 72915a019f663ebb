"""HBM measurements the GPU benchmarks take their shares of (on top of `qfuse.bench`).

`hbm_bandwidth` is the bytes a 1 GiB device copy reads and writes per second: the ceiling every
"share of HBM" is taken of. `read_only` is the ceiling for reading one tensor once, at its size:
a Triton kernel that loads it in 16-byte vectors and keeps one sum per program. A decode step
reads every layer's weight from HBM, so its weight reads are timed as one CUDA graph of calls over
`decode_graph_calls` different weights, together several times the L2 (`qfuse.bench.graph_ms_per_call`
says why, and why not `do_bench`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qfuse.bench import kernel_ms


def hbm_bandwidth() -> float:
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() / (kernel_ms(lambda: target.copy_(source)) * 1e-3)


def share_of_hbm(bytes_moved: float, ms: float, bandwidth: float) -> float:
    return bytes_moved / (ms * 1e-3) / bandwidth


def decode_graph_calls(weight_bytes: int, l2_factor: int = 4) -> int:
    """How many calls, each on its own weight, make a graph whose weights are `l2_factor` x the L2 (8 at least)."""
    return max(8, math.ceil(l2_factor * torch.cuda.get_device_properties(0).L2_cache_size / weight_bytes))


@triton.jit
def _read_kernel(x_ptr, out_ptr, words, BLOCK: tl.constexpr):
    """Reads `words` int32 words once (16-byte vectors); one sum per program keeps the loads live."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < words, other=0), axis=0))


def read_only(w: torch.Tensor, block: int = 4096):
    """A call that reads `w` once (the read-only ceiling for its bytes)."""
    words = w.view(torch.int32).reshape(-1)
    out = torch.empty(triton.cdiv(words.numel(), block), dtype=torch.int32, device=w.device)
    return lambda: _read_kernel[(out.numel(),)](words, out, words.numel(), BLOCK=block, num_warps=8)
