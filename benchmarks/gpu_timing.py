"""GPU timing shared by the benchmark scripts.

`bench` is `triton.testing.do_bench`'s median in ms; `hbm_bandwidth` the bytes a 1 GiB device copy
reads and writes per second (the HBM ceiling every share is taken of).

Decode-sized calls need more care. A step of a decoder runs layer after layer, each reading its
own weight, so a weight that fits in the L2 is still read from HBM every time. `graph_ms_per_call`
times one CUDA graph of many calls, each on its own buffers (pass enough weights that together
they are several times the L2), and divides by the number of calls: no launch gaps, no cache hits.
`do_bench` instead writes 256 MB to empty the L2 before each run, and a short kernel timed right
after it reads slowly (likely behind the write-back of the dirty lines it evicts): on an H200 a
read-only pass over a 16.8 MB weight measured 37-40% of HBM bandwidth under do_bench and 62-67%
in the graph. `read_only` is that ceiling for reading a tensor once: a Triton kernel that loads
it in 16-byte vectors and keeps one sum per program.
"""

from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def hbm_bandwidth() -> float:
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return 2 * source.numel() / (bench(lambda: target.copy_(source)) * 1e-3)


@triton.jit
def _read_kernel(x_ptr, out_ptr, words, BLOCK: tl.constexpr):
    """Reads `words` int32 words once (16-byte vectors); one sum per program keeps the loads live."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.load(x_ptr + offs, mask=offs < words, other=0), axis=0))


def read_only(w: torch.Tensor, block: int = 4096):
    words = w.view(torch.int32).reshape(-1)
    out = torch.empty(triton.cdiv(words.numel(), block), dtype=torch.int32, device=w.device)
    return lambda: _read_kernel[(out.numel(),)](words, out, words.numel(), BLOCK=block, num_warps=8)


def graph_ms_per_call(calls) -> float:
    """Median replay time of one CUDA graph holding `calls` (each on its own buffers), per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / len(calls)
