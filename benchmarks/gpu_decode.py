"""Decode-sized scaled mm (M <= 16) timed the way a decode step runs, and the host cost per call (GPU).

    python benchmarks/gpu_decode.py [--part weight_read host linear ...] [--int8] [--quick] [--out FILE.json]

weight_read  M in {1, 16} x (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}, fp8 (and
             int8 with --int8). Each variant is timed by `do_bench` and as a decode step runs it:
             a CUDA graph of R calls over R different weights, together 4x the L2 (hbm.py): a
             read-only Triton kernel (the ceiling for reading those bytes), a device copy,
             cuBLAS row-wise / tensor-wise fp8, the `triton` kernel as it dispatches, and
             `scaled_mm.py` over small-tile configs. Shares are weight bytes / time / HBM bandwidth.
host         host time per call (enqueue rate, GPU never the bottleneck: `qfuse.bench.time_call`'s
             host_us over 100 calls) of each layer of the triton path: the launchers, the kernel's
             `apply`, the qfuse ops, and the compiled reference-form fp8 linear under Inductor /
             qfuse (cutlass) / qfuse (triton); with a cProfile of the compiled triton linear
             (written beside the JSON: <out stem>_host_profile.txt).
linear       the compiled reference-form fp8 linear at M in {1, 16}, without and with CUDA graphs
             on a static input (`mark_static_address`: no copy into the graph's input buffer, as
             when the linear sits inside a larger captured model). gpu_triton.py has M >= 1024.
--quick: M = 1 (host: 16), the first shape, two small-tile configs. Writes gpu_decode.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats

import torch

from gemm_cases import FP8, SHAPES, compiled_ms, quantized, random_fp8_linear, reference_fp8_linear, scales, triton_kernel
from hbm import decode_graph_calls, hbm_bandwidth, read_only, share_of_hbm
from qfuse.bench import add_output_arguments, graph_ms_per_call, kernel_ms, machine, out_path, progress, time_call, warm, write
from qfuse.kernels.prepared import PreparedWeight
from qfuse.kernels.registry import get_kernel
from qfuse.kernels.triton import persistent_mm, scaled_mm
from qfuse.kernels.triton.quant import triton_dynamic_quant
from qfuse.schemes import Granularity

SMALL_CONFIGS = ((16, 64, 512, 8, 4, 6), (16, 32, 512, 8, 4, 6), (16, 64, 256, 8, 4, 4), (16, 32, 256, 8, 4, 4),
                 (16, 128, 256, 8, 4, 4), (16, 32, 1024, 8, 4, 4), (16, 64, 1024, 8, 8, 3), (16, 16, 512, 8, 2, 6))
COMPILERS = {"inductor": ("inductor", {}), "qfuse cutlass": ("qfuse", {}), "qfuse triton": ("qfuse", {"kernel": "triton"})}


def weight_read_variants(m, n, k, dtype, count, configs):
    """name -> `count` calls, each on its own activation and weight."""
    activations, weights = [quantized(m, k, dtype) for _ in range(count)], [quantized(n, k, dtype) for _ in range(count)]
    sa, sb = scales(m, n)
    copies = [torch.empty_like(w) for w in weights]
    pairs = list(zip(activations, weights))
    variants = {
        "read only": [read_only(w) for w in weights],
        "copy": [lambda w=w, c=c: c.copy_(w) for w, c in zip(weights, copies)],
        "triton (as dispatched)": [lambda a=a, w=w: triton_kernel(a, w, sa, sb) for a, w in pairs],
    }
    if dtype == FP8:
        one = torch.ones((), device="cuda")
        variants["cuBLAS rowwise"] = [lambda a=a, w=w: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)
                                      for a, w in pairs]
        variants["cuBLAS tensorwise"] = [lambda a=a, w=w: torch._scaled_mm(a, w.t(), one, one, out_dtype=torch.bfloat16)
                                         for a, w in pairs]
    for config in configs:
        variants[f"scaled_mm {config}"] = [
            lambda a=a, w=w, config=config: scaled_mm.triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16, config)
            for a, w in pairs]
    return variants


def weight_read_rows(bandwidth, dtypes, ms, shapes, configs):
    rows = []
    for dtype, m, (n, k) in itertools.product(dtypes, ms, shapes):
        count = decode_graph_calls(n * k)
        row = {"section": "weight_read", "dtype": str(dtype), "m": m, "n": n, "k": k, "graph_calls": count, "variants": {}}
        for name, calls in weight_read_variants(m, n, k, dtype, count, configs).items():
            try:
                graph, single = graph_ms_per_call(calls), kernel_ms(calls[0])
            except Exception as error:  # a config that does not compile is a result, not a crash
                row["variants"][name] = {"failed": f"{type(error).__name__}: {error}"[:300]}
                continue
            bytes_read = n * k * (2 if name == "copy" else 1)
            row["variants"][name] = {"graph_ms": graph, "do_bench_ms": single,
                                     "graph_share": share_of_hbm(bytes_read, graph, bandwidth),
                                     "do_bench_share": share_of_hbm(bytes_read, single, bandwidth)}
        rows.append(row)
        timed = {name: v for name, v in row["variants"].items() if "graph_share" in v}
        summary = ", ".join(f"{name} {v['graph_share']:.0%}/{v['do_bench_share']:.0%}"
                            for name, v in timed.items() if not name.startswith("scaled_mm"))
        share, best = max(((v["graph_share"], name) for name, v in timed.items() if name.startswith("scaled_mm")),
                          default=(0.0, "none"))
        print(f"{dtype} M={m} N={n} K={k} (graph/do_bench): {summary}; best config {best} {share:.0%}", flush=True)
    return rows


def host_us(fn) -> float:
    """Host µs per call of 100 calls issued right after a synchronisation (the enqueue rate)."""
    warm(fn, times=5)
    return time_call(fn, calls=10, repeats=1, host_calls=100)["host_us"]


def host_profile(fn, path) -> None:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(45)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())


def host_layers(m, k, w, w_scale):
    """name -> call, each layer of the triton path and the ATen GEMM beside it."""
    n = w.shape[0]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, sa = triton_dynamic_quant(x, FP8, Granularity.PER_TOKEN, 1e-6)
    sa, sb = sa.float(), w_scale.reshape(1, n)
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
    return x, layers


def host_rows(ms, profile_path):
    rows = []
    n = k = 4096
    w, w_scale = torch.randn(n, k, device="cuda").to(FP8), torch.rand(n, device="cuda") + 0.5
    for m in ms:
        x, layers = host_layers(m, k, w, w_scale)
        times = {name: host_us(fn) for name, fn in layers.items()}
        for label, (backend, options) in COMPILERS.items():
            torch._dynamo.reset()
            compiled = torch.compile(reference_fp8_linear, backend=backend, options=options)
            times[f"compiled {label}"] = host_us(lambda: compiled(x, w, w_scale))
            times[f"compiled {label} wall"] = kernel_ms(lambda: compiled(x, w, w_scale)) * 1e3
            if label == "qfuse triton" and m == 16:
                host_profile(lambda: compiled(x, w, w_scale), profile_path)
        rows.append({"section": "host", "m": m, "host_us": times})
        print(f"host us/call M={m}: " + ", ".join(f"{name} {us:.1f}" for name, us in times.items()), flush=True)
    return rows


def linear_rows(ms, shapes):
    rows = []
    for m, (n, k) in itertools.product(ms, shapes):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        times = compiled_ms(random_fp8_linear(n, k), x, COMPILERS)
        rows.append({"section": "linear", "m": m, "n": n, "k": k, "ms": times})
        print(f"linear M={m} N={n} K={k}: " + ", ".join(f"{name} {t * 1e3:.1f}us" for name, t in times.items()), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", nargs="+", choices=("weight_read", "host", "linear"),
                        default=["weight_read", "host", "linear"])
    parser.add_argument("--int8", action="store_true", help="weight_read also for int8")
    add_output_arguments(parser, "gpu_decode", quick="M = 1 (host: 16), one shape, two small-tile configs")
    args = parser.parse_args()
    out = out_path(args, "gpu_decode")
    dtypes = (FP8, torch.int8) if args.int8 else (FP8,)
    ms, shapes, configs = ((1,), SHAPES[:1], SMALL_CONFIGS[:2]) if args.quick else ((1, 16), SHAPES, SMALL_CONFIGS)
    bandwidth = hbm_bandwidth()
    print(f"{machine()}, HBM copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    sections = {"weight_read": lambda: weight_read_rows(bandwidth, dtypes, ms, shapes, configs),
                "host": lambda: host_rows((16,) if args.quick else (16, 1024),
                                          out.with_name(f"{out.stem}_host_profile.txt")),
                "linear": lambda: linear_rows(ms, shapes)}
    rows = []
    for section in args.part:
        progress(f"gpu_decode: {section}")
        rows += sections[section]()
        write(out, rows, hbm_bytes_per_s=bandwidth)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
