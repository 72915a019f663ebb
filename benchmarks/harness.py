"""What every GPU benchmark of a compiled model measures, and how its results are written.

A compiled call is timed three ways, because a user meets all three:

    per_call_us   wall clock per call of calls issued back to back (synchronised at the end):
                  the larger of the GPU time and the host time, what a default-mode model sees
    host_us       the Python / launch time of one call, issued while the GPU is idle
    gpu_us        the GPU time of one call: calls captured in one CUDA graph and replayed
    (mode)        the same per-call time for a model compiled with mode="reduce-overhead" (CUDA graphs)

Medians over `repeats` rounds. Results are one JSON file: the machine, the versions, the command
line, and one row per measurement.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        import triton

        info |= {"gpu": torch.cuda.get_device_name(), "capability": ".".join(map(str, torch.cuda.get_device_capability())),
                 "cuda": torch.version.cuda, "triton": triton.__version__}
    return info


def time_call(fn, *args, calls: int = 50, repeats: int = 5, host_calls: int = 10) -> dict:
    """{'per_call_us', 'host_us'} of `fn(*args)` (already warm)."""
    sync = torch.cuda.synchronize
    per_call, host = [], []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        sync()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        start = time.perf_counter()
        for _ in range(host_calls):
            fn(*args)
        host.append((time.perf_counter() - start) / host_calls * 1e6)
        sync()
    return {"per_call_us": statistics.median(per_call), "host_us": statistics.median(host)}


def gpu_time(fn, *args, calls: int = 20) -> float | None:
    """GPU us per call of `fn(*args)` (warm): `calls` calls in one CUDA graph, median of its replays
    (`gpu_timing.graph_ms_per_call`). None where the call cannot be captured (a CPU sync, an op that
    CUDA graphs refuse)."""
    from gpu_timing import graph_ms_per_call

    try:
        return graph_ms_per_call([lambda: fn(*args)] * calls) * 1e3
    except RuntimeError as error:
        progress(f"  not capturable in a CUDA graph: {str(error).splitlines()[0]}")
        return None


def warm(fn, *args, times: int = 3):
    for _ in range(times):
        out = fn(*args)
    torch.cuda.synchronize()
    return out


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.double(), expected.double()
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def write(path: str | Path, rows: list[dict], **extra) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine(), **extra, "rows": rows}, indent=1))


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
