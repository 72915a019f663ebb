"""Which Triton GEMM variant to ship, per M bucket (GPU): every variant against cuBLAS in one run.

    python benchmarks/explorations/gpu_triton_variants.py [--quick] [--out FILE.json]

M in {128, 1024, 4096}: the persistent TMA kernel (`persistent_mm.py`) over block configs x fp8
promotion interval (1, 4, never) and the non-persistent kernel (`scaled_mm.py`), each against
cuBLAS `torch._scaled_mm` row-wise (bf16 out; also with use_fast_accum=True), with its relative
error against cuBLAS. Shapes (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}. do_bench
medians in ms. --quick: M = 1024, the first shape, one config at promotion interval 4. Writes
gpu_triton_variants.json. (Decode sizes, M <= 16, and the host cost per call: benchmarks/gpu_decode.py.)
"""

from __future__ import annotations

import argparse
import itertools

import torch

from gemm_cases import FP8, SHAPES, operands
from qfuse.bench import add_output_arguments, geomean, kernel_ms, machine, out_path, progress, relative_error, write
from qfuse.kernels.triton import persistent_mm, scaled_mm

NEVER = 0
LARGE_CONFIGS = ((128, 128, 128, 8, 8, 4), (128, 256, 128, 8, 8, 3))
M128_CONFIGS = ((64, 128, 128, 8, 4, 4),)


def variants(m, a, w, sa, sb, configs, promotions):
    """name -> call: cuBLAS with fast accumulation, scaled_mm.py, the persistent kernel per config x promotion."""
    calls = {
        "fp8 cuBLAS rowwise use_fast_accum=True": lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True),
        "fp8 scaled_mm": lambda: scaled_mm.triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16),
    }
    for config, promote in itertools.product(configs + (M128_CONFIGS if m == 128 else ()), promotions):
        calls[f"fp8 persistent {config} promote={promote or 'never'}"] = (
            lambda config=config, promote=promote: persistent_mm.persistent_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16, config, promote))
    return calls


def large_rows(ms, shapes, configs, promotions):
    rows = []
    for m, (n, k) in itertools.product(ms, shapes):
        progress(f"M={m} N={n} K={k}")
        a, w, sa, sb = operands(m, n, k, FP8)
        cublas = torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)
        row = {"m": m, "n": n, "k": k, "variants": {},
               "cublas_ms": kernel_ms(lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16))}
        for name, run in variants(m, a, w, sa, sb, configs, promotions).items():
            time_ms = kernel_ms(run)
            row["variants"][name] = {"ms": time_ms, "error": relative_error(run(), cublas),
                                     "vs_cublas": row["cublas_ms"] / time_ms}
        rows.append(row)
        best = max((v["vs_cublas"], name) for name, v in row["variants"].items())
        print(f"large M={m} N={n} K={k}: cuBLAS {row['cublas_ms']:.4f} ms; best {best[1]} at {best[0]:.3f}x", flush=True)
    return rows


def print_best(rows, buckets):
    names = list(rows[0]["variants"])
    for bucket in buckets:
        scores = {}
        for name in names:
            ratios = [row["variants"].get(name, {}).get("vs_cublas") for row in rows if row["m"] == bucket]
            if all(ratios):
                scores[name] = geomean(ratios)
        for name, score in sorted(scores.items(), key=lambda item: -item[1])[:6]:
            print(f"M={bucket} geomean {score:.3f}x  {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "gpu_triton_variants", quick="M = 1024, one shape, one config, promotion every 4")
    args = parser.parse_args()
    out = out_path(args, "gpu_triton_variants")
    print(machine(), flush=True)
    if args.quick:
        ms, shapes, configs, promotions = (1024,), SHAPES[:1], LARGE_CONFIGS[:1], (4,)
    else:
        ms, shapes, configs, promotions = (128, 1024, 4096), SHAPES, LARGE_CONFIGS, (1, 4, NEVER)
    rows = large_rows(ms, shapes, configs, promotions)
    write(out, rows)
    print_best(rows, ms)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
