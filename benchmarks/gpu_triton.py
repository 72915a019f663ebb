"""GPU benchmark of the Triton kernels (issue #3), every ratio against a baseline timed in the same run.

    python benchmarks/gpu_triton.py [--tune | --tune-only] [--quick] [--out FILE.json]

1. Ceilings: HBM bandwidth from a 1 GiB device copy (bytes read + written / time).
2. Scaled mm, M in {1, 16, 128, 1024, 4096} x (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}:
   bf16 torch.mm; fp8 torch._scaled_mm tensor-wise and row-wise (also with use_fast_accum=True);
   torch._int_mm + rescale (two kernels); the qfuse `triton` kernel (as it dispatches: the persistent
   TMA kernel above M = 128 on Hopper) fp8 row-wise (per-token x per-channel) and int8 with the
   scales in its epilogue, and fp8 with fast accumulation (no promotion) at M >= 1024; for M <= 16
   the share of HBM bandwidth spent reading the 1-byte weight (and that of a device copy of it),
   timed by do_bench and, as a decode step runs, by CUDA-graph replays over weights 4x the L2
   beside a read-only kernel's share (`decode_weight_read`; `qfuse.bench.graph_ms_per_call` says why both).
3. Dynamic per-token fp8 quant at M=4096, K=14336 (bf16 in): the Triton kernel vs Inductor's code
   for the same reference-form function, as a share of HBM bandwidth.
4. The reference-form fp8 W8A8 linear (bf16 in and out) compiled by plain Inductor and by
   backend="qfuse" with its default kernel choice (cutlass on CUDA) and with kernel="triton",
   each without and with CUDA graphs on an input marked static (`gemm_cases.compiled_ms`).
With --tune, first searches block configs per M bucket (`tune`), prints the best and uses them.
--quick: M in {16, 1024} and the first shape (the linear: M = 1024). Times: triton.testing.do_bench,
median, in milliseconds. Writes gpu_triton.json: rows of sections scaled_mm, quant, linear.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from gemm_cases import FP8, SHAPES, compiled_ms, operands, random_fp8_linear, reference_quant, triton_kernel
from hbm import decode_graph_calls, hbm_bandwidth, read_only, share_of_hbm
from qfuse.bench import add_output_arguments, geomean, graph_ms_per_call, kernel_ms, machine, out_path, progress, write
from qfuse.kernels.triton import persistent_mm
from qfuse.kernels.triton import scaled_mm as triton_mm
from qfuse.kernels.triton.quant import triton_dynamic_quant
from qfuse.schemes import Granularity

M_VALUES = (1, 16, 128, 1024, 4096)
COMPILERS = {"inductor": ("inductor", {}), "qfuse": ("qfuse", {}), "qfuse triton": ("qfuse", {"kernel": "triton"})}


def scaled_mm_rows(m, n, k, bandwidth):
    a8, w8, sa, sb = operands(m, n, k, FP8)
    ai, wi, _, _ = operands(m, n, k, torch.int8)
    x, w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    one = torch.ones((), device="cuda")
    times = {
        "bf16 mm": kernel_ms(lambda: torch.mm(x, w.t())),
        "fp8 _scaled_mm tensorwise": kernel_ms(lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16)),
        "fp8 _scaled_mm rowwise": kernel_ms(lambda: torch._scaled_mm(a8, w8.t(), sa, sb, out_dtype=torch.bfloat16)),
        "fp8 _scaled_mm rowwise fast accum": kernel_ms(lambda: torch._scaled_mm(a8, w8.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True)),
        "fp8 triton rowwise": kernel_ms(lambda: triton_kernel(a8, w8, sa, sb)),
        "triton int8 scaled": kernel_ms(lambda: triton_kernel(ai, wi, sa, sb)),
    }
    if m >= 1024:
        times["fp8 triton rowwise fast accum"] = kernel_ms(lambda: persistent_mm.persistent_scaled_mm(a8, w8.t(), sa, sb, None, torch.bfloat16, promote=0))
    if m > 16:  # cuBLAS int8 needs M > 16
        times["_int_mm + rescale"] = kernel_ms(lambda: (torch._int_mm(ai, wi.t()) * sa * sb).to(torch.bfloat16))
    row = {"section": "scaled_mm", "m": m, "n": n, "k": k, "ms": times,
           "fp8_triton_vs_rowwise": times["fp8 _scaled_mm rowwise"] / times["fp8 triton rowwise"],
           "fp8_triton_tflops": 2 * m * n * k / times["fp8 triton rowwise"] / 1e9}
    if m >= 1024:
        row["fp8_triton_fast_vs_rowwise_fast"] = times["fp8 _scaled_mm rowwise fast accum"] / times["fp8 triton rowwise fast accum"]
    if "_int_mm + rescale" in times:
        row["int8_triton_vs_int_mm_rescale"] = times["_int_mm + rescale"] / times["triton int8 scaled"]
    if m <= 16:
        for name in ("fp8 triton rowwise", "triton int8 scaled", "fp8 _scaled_mm rowwise"):
            row[f"weight_read_share_of_hbm[{name}]"] = share_of_hbm(n * k, times[name], bandwidth)
        copy = torch.empty_like(w8)
        row["weight_copy_share_of_hbm"] = share_of_hbm(2 * n * k, kernel_ms(lambda: copy.copy_(w8)), bandwidth)
        for name, share in decode_weight_read(m, n, k, bandwidth).items():
            row[f"decode_weight_read_share_of_hbm[{name}]"] = share
    return row


def decode_weight_read(m, n, k, bandwidth):
    """Weight bytes / time / HBM bandwidth as a decode step sees it: one CUDA graph of calls over
    different weights, together 4x the L2 (`hbm.decode_graph_calls`)."""
    count = decode_graph_calls(n * k)
    fp8 = [operands(m, n, k, FP8) for _ in range(count)]
    int8 = [operands(m, n, k, torch.int8) for _ in range(count)]
    one = torch.ones((), device="cuda")
    variants = {
        "read only": [read_only(w) for _, w, _, _ in fp8],
        "fp8 triton rowwise": [lambda o=o: triton_kernel(*o) for o in fp8],
        "triton int8 scaled": [lambda o=o: triton_kernel(*o) for o in int8],
        "fp8 _scaled_mm rowwise": [lambda a=a, w=w, sa=sa, sb=sb: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16) for a, w, sa, sb in fp8],
        "fp8 _scaled_mm tensorwise": [lambda a=a, w=w: torch._scaled_mm(a, w.t(), one, one, out_dtype=torch.bfloat16) for a, w, _, _ in fp8],
    }
    return {name: share_of_hbm(n * k, graph_ms_per_call(calls), bandwidth) for name, calls in variants.items()}


def quant_row(bandwidth, m=4096, k=14336):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(reference_quant)
    compiled(x)
    bytes_moved = m * k * (2 + 1) + m * 2
    times = {"triton dynamic quant": kernel_ms(lambda: triton_dynamic_quant(x, FP8, Granularity.PER_TOKEN, 1e-6)),
             "inductor reference quant": kernel_ms(lambda: compiled(x))}
    return {"section": "quant", "m": m, "k": k, "ms": times,
            "share_of_hbm": {name: share_of_hbm(bytes_moved, t, bandwidth) for name, t in times.items()}}


def linear_rows(ms, shapes):
    rows = []
    for m, (n, k) in itertools.product(ms, shapes):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        times = compiled_ms(random_fp8_linear(n, k), x, COMPILERS)
        baseline = {label: "inductor cudagraphs" if label.endswith("cudagraphs") else "inductor" for label in times}
        rows.append({"section": "linear", "m": m, "n": n, "k": k, "ms": times,
                     "speedup": {label: times[baseline[label]] / times[label] for label in times if not label.startswith("inductor")}})
    return rows


LARGE_M_SPACE = itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4))


def tune(buckets=(128, 4096)):
    """Best wgmma-tile config per dtype and M bucket (geomean over SHAPES). M <= 16 picks its tile
    width by grid fill instead (`scaled_mm.DECODE_TILES`, measured by gpu_decode.py)."""
    large = [(bm, bn, bk, 8, warps, stages) for bm, bn, bk, warps, stages in LARGE_M_SPACE
             if not (bm == 128 and bn == 256 and (stages == 4 or bk == 128))]
    best = {}
    for (label, dtype), m in itertools.product((("fp8", FP8), ("int8", torch.int8)), buckets):
        scores = {}
        for config in large:
            if config[0] > max(16, 2 * m):
                continue
            total = 0.0
            for n, k in SHAPES:
                a, w, sa, sb = operands(m, n, k, dtype)
                try:
                    total += math.log(kernel_ms(lambda: triton_mm.triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16, config)))
                except Exception as error:  # out of shared memory etc.: not a candidate
                    print(f"  config {config} failed at M={m}: {type(error).__name__}")
                    total = math.inf
                    break
            scores[config] = total
        best[label, m] = min(scores, key=scores.get)
        print(f"tune: {label} M={m}: best {best[label, m]}")
    return best


def print_summary(gemm, linear):
    for row in gemm:
        extras = {key: round(value, 3) for key, value in row.items() if key not in ("section", "m", "n", "k", "ms")}
        print(row["m"], row["n"], row["k"], {name: round(t, 4) for name, t in row["ms"].items()}, extras)
    for m in sorted({row["m"] for row in gemm if row["m"] >= 1024}):
        for key in ("fp8_triton_vs_rowwise", "fp8_triton_fast_vs_rowwise_fast", "int8_triton_vs_int_mm_rescale"):
            print(f"{key} geomean at M={m}: {geomean(row[key] for row in gemm if row['m'] == m):.3f}")
    for row in linear:
        print("linear", row["m"], row["n"], row["k"], {k: round(v, 4) for k, v in row["ms"].items()},
              {k: round(v, 3) for k, v in row["speedup"].items()})
    for label in linear[0]["speedup"]:
        print(f"linear speedup geomean {label}: {geomean(row['speedup'][label] for row in linear):.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--tune-only", action="store_true", help="search configs, print them, stop")
    parser.add_argument("--buckets", type=int, nargs="+", default=[128, 4096], help="M values to tune")
    add_output_arguments(parser, "gpu_triton", quick="M in {16, 1024}, the first shape (linear: M = 1024)")
    args = parser.parse_args()
    out = out_path(args, "gpu_triton")
    print(machine())
    tuned = {}
    if args.tune or args.tune_only:
        tuned = tune(args.buckets)
        if args.tune_only:
            return
        triton_mm.CONFIGS = {label: {128: tuned[label, 128], 2**62: tuned[label, 4096]}
                             for label in ("fp8", "int8")}
    ms, shapes, linear_ms = ((16, 1024), SHAPES[:1], (1024,)) if args.quick else (M_VALUES, SHAPES, (1024, 4096))
    bandwidth = hbm_bandwidth()
    print(f"HBM copy bandwidth: {bandwidth / 1e12:.2f} TB/s")
    gemm = []
    for m, (n, k) in itertools.product(ms, shapes):
        progress(f"scaled mm M={m} N={n} K={k}")
        gemm.append(scaled_mm_rows(m, n, k, bandwidth))
    progress("quant")
    quant = quant_row(bandwidth)
    print("quant", quant)
    progress("compiled linear")
    linear = linear_rows(linear_ms, shapes)
    print_summary(gemm, linear)
    write(out, [*gemm, quant, *linear], hbm_bytes_per_s=bandwidth,
          tuned_configs={f"{label} M={m}": config for (label, m), config in tuned.items()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
