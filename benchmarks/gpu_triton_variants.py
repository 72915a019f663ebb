"""Which Triton GEMM variant to ship, per M bucket (GPU): every variant against cuBLAS in one run.

    python benchmarks/gpu_triton_variants.py [--out DIR]

M in {128, 1024, 4096}: the persistent TMA kernel (`persistent_mm.py`) over block configs x fp8
promotion interval (1, 4, never) and the non-persistent kernel (`scaled_mm.py`), each against
cuBLAS `torch._scaled_mm` row-wise (bf16 out; also with use_fast_accum=True), with its relative
error against cuBLAS. Shapes (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}. do_bench
medians in ms. Writes gpu_triton_variants.json to --out. (Decode sizes, M <= 16, and the host cost
per call: benchmarks/gpu_decode.py.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from pathlib import Path

import torch
import triton

from qfuse.kernels.triton import persistent_mm, scaled_mm

from gpu_timing import bench  # noqa: E402  (beside this script)

FP8 = torch.float8_e4m3fn
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
NEVER = 0
LARGE_CONFIGS = ((128, 128, 128, 8, 8, 4), (128, 256, 128, 8, 8, 3))
M128_CONFIGS = ((64, 128, 128, 8, 4, 4),)


def operands(m, n, k, dtype):
    if dtype == FP8:
        a, w = torch.randn(m, k, device="cuda").to(FP8), torch.randn(n, k, device="cuda").to(FP8)
    else:
        a = torch.randint(-127, 128, (m, k), dtype=dtype, device="cuda")
        w = torch.randint(-127, 128, (n, k), dtype=dtype, device="cuda")
    return a, w, torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5


def relative_error(out, reference):
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


def large_rows():
    rows = []
    for m, (n, k) in itertools.product((128, 1024, 4096), SHAPES):
        a, w, sa, sb = operands(m, n, k, FP8)
        cublas = torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)
        variants = {
            "fp8 cuBLAS rowwise use_fast_accum=True": lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16, use_fast_accum=True),
            "fp8 scaled_mm": lambda: scaled_mm.triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16),
        }
        for config, promote in itertools.product(LARGE_CONFIGS + (M128_CONFIGS if m == 128 else ()), (1, 4, NEVER)):
            variants[f"fp8 persistent {config} promote={promote or 'never'}"] = (
                lambda config=config, promote=promote: persistent_mm.persistent_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16, config, promote))
        row = {"m": m, "n": n, "k": k, "cublas_ms": bench(lambda: torch._scaled_mm(a, w.t(), sa, sb, out_dtype=torch.bfloat16)),
               "variants": {}}
        for name, run in variants.items():
            row["variants"][name] = {"ms": bench(run), "error": relative_error(run(), cublas)}
            row["variants"][name]["vs_cublas"] = row["cublas_ms"] / row["variants"][name]["ms"]
        rows.append(row)
        best = max((v["vs_cublas"], name) for name, v in row["variants"].items())
        print(f"large M={m} N={n} K={k}: cuBLAS {row['cublas_ms']:.4f} ms; best {best[1]} at {best[0]:.3f}x", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}}
    print(result, flush=True)
    result["large"] = large_rows()
    (Path(args.out) / "gpu_triton_variants.json").write_text(json.dumps(result, indent=2, default=str))
    names = [name for name in result["large"][0]["variants"]]
    for bucket in (128, 1024, 4096):
        scores = {}
        for name in names:
            ratios = [row["variants"].get(name, {}).get("vs_cublas") for row in result["large"] if row["m"] == bucket]
            if all(ratios):
                scores[name] = math.prod(ratios) ** (1 / len(ratios))
        for name, score in sorted(scores.items(), key=lambda item: -item[1])[:6]:
            print(f"M={bucket} geomean {score:.3f}x  {name}")


if __name__ == "__main__":
    main()
