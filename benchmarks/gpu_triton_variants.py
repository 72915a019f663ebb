"""Which Triton GEMM variant to ship, per M bucket (GPU): every variant against cuBLAS in one run.

    python benchmarks/gpu_triton_variants.py [--part large|small|overhead ...] [--out DIR]

large     M in {128, 1024, 4096}: the persistent TMA kernel (`persistent_mm.py`) over block
          configs x fp8 promotion interval (1, 4, never) and the non-persistent kernel
          (`scaled_mm.py`), each against cuBLAS `torch._scaled_mm` row-wise (bf16 out; also with
          use_fast_accum=True), with its relative error against cuBLAS.
small     M in {1, 16}: the non-persistent kernel over small-tile configs, fp8 and int8, as a share
          of the HBM roofline for reading the weight, beside a device copy of the weight.
overhead  host time per call of the compiled reference-form fp8 linear with kernel="triton"
          (M=1024, N=K=4096), and a cProfile of those calls (written to overhead_profile.txt).
Shapes (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}. do_bench medians in ms. Writes
gpu_triton_variants.json to --out.
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
from triton.testing import do_bench

from qfuse.kernels.triton import persistent_mm, scaled_mm

FP8 = torch.float8_e4m3fn
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))
NEVER = 0
LARGE_CONFIGS = ((128, 128, 128, 8, 8, 4), (128, 256, 128, 8, 8, 3))
M128_CONFIGS = ((64, 128, 128, 8, 4, 4),)
SMALL_CONFIGS = ((16, 64, 512, 8, 4, 6), (16, 32, 512, 8, 4, 6), (16, 64, 256, 8, 4, 4))


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


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


def small_rows(bandwidth):
    rows = []
    for dtype, m, (n, k) in itertools.product((FP8, torch.int8), (1, 16), SHAPES):
        a, w, sa, sb = operands(m, n, k, dtype)
        copy = torch.empty_like(w)
        row = {"dtype": str(dtype), "m": m, "n": n, "k": k, "variants": {},
               "weight_copy_share": 2 * n * k / (bench(lambda: copy.copy_(w)) * 1e-3) / bandwidth}
        for config in SMALL_CONFIGS:
            ms = bench(lambda config=config: scaled_mm.triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16, config))
            row["variants"][str(config)] = {"ms": ms, "weight_read_share": n * k / (ms * 1e-3) / bandwidth}
        rows.append(row)
        best = max((v["weight_read_share"], name) for name, v in row["variants"].items())
        print(f"small {dtype} M={m} N={n} K={k}: best {best[1]} at {best[0]:.1%} of HBM; a copy of the weight {row['weight_copy_share']:.1%}", flush=True)
    return rows


def reference_fp8_linear(x, w, w_scale):
    x2d = x.reshape(-1, x.shape[-1])
    s = x2d.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / 448.0
    q = (x2d / s).clamp(-448, 448).to(FP8)
    one = torch.ones((), device=x.device)
    y = torch._scaled_mm(q, w.t(), one, one, out_dtype=torch.float32)
    return (y * s * w_scale).to(torch.bfloat16)


def overhead_row(out_dir):
    m, n, k = 1024, 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w, w_scale = torch.randn(n, k, device="cuda").to(FP8), torch.rand(n, device="cuda") + 0.5
    row = {}
    for label, backend, options in (("inductor", "inductor", None), ("qfuse triton", "qfuse", {"kernel": "triton"}),
                                    ("qfuse cutlass", "qfuse", {"kernel": "cutlass"})):
        torch._dynamo.reset()
        compiled = torch.compile(reference_fp8_linear, backend=backend, options=options)
        compiled(x, w, w_scale)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            compiled(x, w, w_scale)
        host = (time.perf_counter() - start) / 200 * 1e3
        torch.cuda.synchronize()
        row[label] = {"host_ms_per_call": host, "device_ms": bench(lambda: compiled(x, w, w_scale))}
        if label == "qfuse triton":
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(200):
                compiled(x, w, w_scale)
            profile.disable()
            torch.cuda.synchronize()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
            (Path(out_dir) / "overhead_profile.txt").write_text(text.getvalue())
        print(f"overhead {label}: {row[label]}", flush=True)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", nargs="+", default=["large", "small", "overhead"])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result = {"machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}}
    source = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    result["hbm_bytes_per_s"] = bandwidth = 2 * source.numel() / (bench(lambda: target.copy_(source)) * 1e-3)
    del source, target
    print(result, flush=True)
    for part in args.part:
        result[part] = {"large": large_rows, "small": lambda: small_rows(bandwidth),
                        "overhead": lambda: overhead_row(args.out)}[part]()
        (Path(args.out) / "gpu_triton_variants.json").write_text(json.dumps(result, indent=2, default=str))
    if "large" in result:
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
