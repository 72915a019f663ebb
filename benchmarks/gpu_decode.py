"""Decode-sized scaled mm (M <= 16) timed the way a decode step runs, and the host cost per call (GPU).

    python benchmarks/gpu_decode.py [--part weight_read host linear ...] [--out DIR]

weight_read  M in {1, 16} x (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}, fp8 (and
             int8 with --int8). Each variant is timed by `do_bench` and as a decode step runs it:
             a CUDA graph of R calls over R different weights, together 4x the L2 (gpu_timing.py):
             a read-only Triton kernel (the ceiling for reading those bytes), a device copy,
             cuBLAS row-wise / tensor-wise fp8, the `triton` kernel as it dispatches, and
             `scaled_mm.py` over small-tile configs. Shares are weight bytes / time / HBM bandwidth.
host         host time per call (enqueue rate, GPU never the bottleneck) of each layer of the
             triton path: the launchers, the kernel's `apply`, the qfuse ops, and the compiled
             reference-form fp8 linear under Inductor / qfuse (cutlass) / qfuse (triton); with a
             cProfile of the compiled triton linear (host_profile.txt).
linear       the compiled reference-form fp8 linear at M in {1, 16}, without and with CUDA graphs
             on a static input (`mark_static_address`: no copy into the graph's input buffer, as
             when the linear sits inside a larger captured model). gpu_triton.py has M >= 1024.
Writes gpu_decode.json to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import math
import os
import pstats
import time
from pathlib import Path

import torch
import triton

from qfuse.kernels.prepared import PreparedWeight
from qfuse.kernels.registry import get_kernel
from qfuse.kernels.triton import persistent_mm, scaled_mm
from qfuse.kernels.triton.quant import triton_dynamic_quant
from qfuse.schemes import Granularity

from gpu_timing import bench, graph_ms_per_call, hbm_bandwidth, read_only  # noqa: E402  (beside this script)

FP8 = torch.float8_e4m3fn
DTYPES = (FP8,)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
SMALL_CONFIGS = ((16, 64, 512, 8, 4, 6), (16, 32, 512, 8, 4, 6), (16, 64, 256, 8, 4, 4), (16, 32, 256, 8, 4, 4),
                 (16, 128, 256, 8, 4, 4), (16, 32, 1024, 8, 4, 4), (16, 64, 1024, 8, 8, 3), (16, 16, 512, 8, 2, 6))


def operands(m, n, k, dtype, count):
    def quantized(*shape):
        if dtype == FP8:
            return torch.randn(*shape, device="cuda").to(FP8)
        return torch.randint(-127, 128, shape, dtype=dtype, device="cuda")
    return ([quantized(m, k) for _ in range(count)], [quantized(n, k) for _ in range(count)],
            torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5)


def triton_kernel(a, w, sa, sb):
    weight = PreparedWeight(w.t(), sb, None, w.shape[1], w.shape[0])
    return get_kernel("triton").apply(a, weight, sa, None, None, torch.bfloat16)


def weight_read_rows(bandwidth, l2_bytes):
    rows = []
    for dtype, m, (n, k) in itertools.product(DTYPES, (1, 16), SHAPES):
        count = max(8, math.ceil(4 * l2_bytes / (n * k)))
        activations, weights, sa, sb = operands(m, n, k, dtype, count)
        copies = [torch.empty_like(w) for w in weights]
        variants = {
            "read only": [read_only(w) for w in weights],
            "copy": [lambda w=w, c=c: c.copy_(w) for w, c in zip(weights, copies)],
            "triton (as dispatched)": [lambda a=a, w=w: triton_kernel(a, w, sa, sb) for a, w in zip(activations, weights)],
        }
        if dtype == FP8:
            one = torch.ones((), device="cuda")
            variants["cuBLAS rowwise"] = [lambda a=a, w=w: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)
                                          for a, w in zip(activations, weights)]
            variants["cuBLAS tensorwise"] = [lambda a=a, w=w: torch._scaled_mm(a, w.t(), one, one, out_dtype=torch.bfloat16)
                                             for a, w in zip(activations, weights)]
        for config in SMALL_CONFIGS:
            variants[f"scaled_mm {config}"] = [
                lambda a=a, w=w, config=config: scaled_mm.triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16, config)
                for a, w in zip(activations, weights)]
        row = {"dtype": str(dtype), "m": m, "n": n, "k": k, "graph_calls": count, "variants": {}}
        for name, calls in variants.items():
            try:
                ms = graph_ms_per_call(calls)
                single = bench(calls[0])
            except Exception as error:  # a config that does not compile is a result, not a crash
                row["variants"][name] = {"failed": f"{type(error).__name__}: {error}"[:300]}
                continue
            bytes_read = n * k * (2 if name == "copy" else 1)
            row["variants"][name] = {"graph_ms": ms, "do_bench_ms": single,
                                     "graph_share": bytes_read / (ms * 1e-3) / bandwidth,
                                     "do_bench_share": bytes_read / (single * 1e-3) / bandwidth}
        rows.append(row)
        summary = ", ".join(f"{name} {v['graph_share']:.0%}/{v['do_bench_share']:.0%}"
                            for name, v in row["variants"].items() if "graph_share" in v and not name.startswith("scaled_mm"))
        best = max((v["graph_share"], name) for name, v in row["variants"].items() if name.startswith("scaled_mm") and "graph_share" in v)
        print(f"{dtype} M={m} N={n} K={k} (graph/do_bench): {summary}; best config {best[1]} {best[0]:.0%}", flush=True)
    return rows


def reference_fp8_linear(x, w, w_scale):
    x2d = x.reshape(-1, x.shape[-1])
    s = x2d.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / 448.0
    q = (x2d / s).clamp(-448, 448).to(FP8)
    one = torch.ones((), device=x.device)
    y = torch._scaled_mm(q, w.t(), one, one, out_dtype=torch.float32)
    return (y * s * w_scale).to(torch.bfloat16)


def host_us_per_call(fn, calls=100) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


COMPILERS = (("inductor", "inductor", {}), ("qfuse cutlass", "qfuse", {}), ("qfuse triton", "qfuse", {"kernel": "triton"}))


def host_rows(out_dir):
    rows = {}
    n = k = 4096
    w, w_scale = torch.randn(n, k, device="cuda").to(FP8), torch.rand(n, device="cuda") + 0.5
    sb = w_scale.reshape(1, n)
    for m in (16, 1024):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        a, sa = triton_dynamic_quant(x, FP8, Granularity.PER_TOKEN, 1e-6)
        sa = sa.float()
        weight = PreparedWeight(w.t(), sb, None, k, n)
        layers = {
            "triton_dynamic_quant": lambda: triton_dynamic_quant(x, FP8, Granularity.PER_TOKEN, 1e-6),
            "triton_scaled_mm launcher": lambda: scaled_mm.triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16),
            "TritonKernel.apply": lambda: get_kernel("triton").apply(a, weight, sa, None, None, torch.bfloat16),
            "qfuse::scaled_mm op": lambda: torch.ops.qfuse.scaled_mm(a, w.t(), sa, w_scale, None, None, None, torch.bfloat16, "triton"),
            "qfuse::quant_scaled_mm op": lambda: torch.ops.qfuse.quant_scaled_mm(x, w.t(), None, w_scale, None, FP8, 1e-6, torch.bfloat16, "triton"),
            "torch._scaled_mm rowwise": lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16),
        }
        if m > 128:
            layers["persistent launcher"] = lambda: persistent_mm.persistent_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16)
        row = {name: host_us_per_call(fn) for name, fn in layers.items()}
        for label, backend, options in COMPILERS:
            torch._dynamo.reset()
            compiled = torch.compile(reference_fp8_linear, backend=backend, options=options)
            row[f"compiled {label}"] = host_us_per_call(lambda: compiled(x, w, w_scale))
            row[f"compiled {label} wall"] = bench(lambda: compiled(x, w, w_scale)) * 1e3
            if label == "qfuse triton" and m == 16:
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(200):
                    compiled(x, w, w_scale)
                profile.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(45)
                (Path(out_dir) / "host_profile.txt").write_text(text.getvalue())
        rows[f"M={m}"] = row
        print(f"host us/call M={m}: " + ", ".join(f"{name} {us:.1f}" for name, us in row.items()), flush=True)
    return rows


class Fp8Linear(torch.nn.Module):
    def __init__(self, w, w_scale):
        super().__init__()
        self.register_buffer("w", w)
        self.register_buffer("w_scale", w_scale)

    def forward(self, x):
        return reference_fp8_linear(x, self.w, self.w_scale)


def linear_rows():
    rows = []
    for m, (n, k) in itertools.product((1, 16), SHAPES):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        torch._dynamo.mark_static_address(x)
        module = Fp8Linear(torch.randn(n, k, device="cuda").to(FP8), torch.rand(n, device="cuda") + 0.5)
        times = {}
        for (label, backend, options), graphs in itertools.product(COMPILERS, (False, True)):
            torch._dynamo.reset()
            compiled = torch.compile(module, backend=backend, options={**options, "triton.cudagraphs": graphs})
            for _ in range(3):
                compiled(x)
            times[label + (" cudagraphs" if graphs else "")] = bench(lambda: compiled(x))
        rows.append({"m": m, "n": n, "k": k, "ms": times})
        print(f"linear M={m} N={n} K={k}: " + ", ".join(f"{name} {ms * 1e3:.1f}us" for name, ms in times.items()), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", default=["weight_read", "host", "linear"])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--int8", action="store_true", help="weight_read also for int8")
    args = parser.parse_args()
    global DTYPES
    DTYPES = (FP8, torch.int8) if args.int8 else (FP8,)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    properties = torch.cuda.get_device_properties(0)
    bandwidth = hbm_bandwidth()
    result = {"machine": {"gpu": properties.name, "torch": torch.__version__, "triton": triton.__version__,
                          "l2_bytes": properties.L2_cache_size}, "hbm_bytes_per_s": bandwidth}
    print(result, flush=True)
    parts = {"weight_read": lambda: weight_read_rows(bandwidth, properties.L2_cache_size),
             "host": lambda: host_rows(args.out), "linear": linear_rows}
    for part in args.part:
        result[part] = parts[part]()
        (Path(args.out) / "gpu_decode.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
