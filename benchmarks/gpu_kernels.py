"""GPU benchmark of the registry's GEMM kernels (issue #4): cutlass vs triton vs torch vs bf16.

    python benchmarks/gpu_kernels.py [--out DIR]

Every ratio is against a baseline timed in the same run.
1. Kernel level, M in {1, 16, 128, 1024, 4096} x (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}
   plus one unaligned shape (4100, 4100) that the cutlass kernel pads: per-token x per-channel fp8
   and int8, bf16 output, no bias. Each kernel that can implement the key runs `apply` on a weight
   prepared once (as the op does), against bf16 torch.mm of the same sizes.
2. Whole reference-form fp8 W8A8 linear (bf16 in and out) compiled by plain Inductor and by
   backend="qfuse" with the default kernel choice (which kernel that is, is recorded).
Times: triton.testing.do_bench, median, milliseconds. Writes gpu_kernels.json to --out.
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
from triton.testing import do_bench

import qfuse
from qfuse.kernels import KERNELS, GemmKey
from qfuse.platform import current_platform
from qfuse.schemes import FP8_DTYPE, Granularity, QuantScheme

M_VALUES = (1, 16, 128, 1024, 4096)
SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (4100, 4100))
GPU_KERNELS = ("cutlass", "triton", "torch")
SCHEMES = {
    "fp8": QuantScheme(FP8_DTYPE, FP8_DTYPE, Granularity.PER_TOKEN, Granularity.PER_CHANNEL, dynamic=True),
    "int8": QuantScheme(torch.int8, torch.int8, Granularity.PER_TOKEN, Granularity.PER_CHANNEL, dynamic=True),
}


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def quantized(rows, cols, dtype):
    if dtype == FP8_DTYPE:
        return torch.randn(rows, cols, device="cuda").to(dtype)
    return torch.randint(-127, 128, (rows, cols), dtype=dtype, device="cuda")


def kernel_rows(m, n, k):
    platform = current_platform("cuda")
    x, w = (torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for rows in (m, n))
    row = {"m": m, "n": n, "k": k, "ms": {"bf16 mm": bench(lambda: torch.mm(x, w.t()))}, "rejected": {}}
    for (label, scheme), name in itertools.product(SCHEMES.items(), GPU_KERNELS):
        kernel = KERNELS[name]
        key = GemmKey(scheme, n=n, k=k, out_dtype=torch.bfloat16, bias_dtype=None, device_type="cuda")
        ok, reason = kernel.can_implement(key, platform)
        if not ok:
            row["rejected"][f"{label} {name}"] = reason
            continue
        a, b = quantized(m, k, scheme.activation_dtype), quantized(n, k, scheme.weight_dtype).t()
        scale_a, scale_b = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
        weight = kernel.prepare_weight(b, scale_b, None)
        row["ms"][f"{label} {name}"] = bench(lambda: kernel.apply(a, weight, scale_a, None, None, torch.bfloat16))
    row["speedup_vs_bf16"] = {label: row["ms"]["bf16 mm"] / t for label, t in row["ms"].items() if label != "bf16 mm"}
    return row


def fp8_linear(x, w, w_scale):
    s = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-6) / 448.0
    q = (x / s).clamp(-448, 448).to(FP8_DTYPE)
    one = torch.ones((), device=x.device)
    y = torch._scaled_mm(q, w.t(), one, one, out_dtype=torch.float32)
    return (y * s * w_scale).to(torch.bfloat16)


def linear_rows():
    rows = []
    for m, (n, k) in itertools.product((1, 16, 1024, 4096), SHAPES[:3]):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w, w_scale = torch.randn(n, k, device="cuda").to(FP8_DTYPE), torch.rand(n, device="cuda") + 0.5
        times = {}
        for label, backend in (("inductor", "inductor"), ("qfuse", "qfuse")):
            torch._dynamo.reset()
            marker = qfuse.graphs_compiled()
            compiled = torch.compile(fp8_linear, backend=backend)
            compiled(x, w, w_scale)
            if backend == "qfuse":
                kernels = [record.kernel for report in qfuse.reports_since(marker) for record in report.fused]
            times[label] = bench(lambda: compiled(x, w, w_scale))
        rows.append({"m": m, "n": n, "k": k, "ms": times, "qfuse_kernels": kernels,
                     "speedup": times["inductor"] / times["qfuse"]})
    return rows


def geomean(values):
    return math.prod(values) ** (1 / len(values)) if values else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "platform": str(current_platform("cuda"))}
    print(info)
    gemm = [kernel_rows(m, n, k) for m, (n, k) in itertools.product(M_VALUES, SHAPES)]
    for row in gemm:
        print(row["m"], row["n"], row["k"], {label: round(t, 4) for label, t in row["ms"].items()})
    if gemm[0]["rejected"]:
        print("rejected:", gemm[0]["rejected"])
    for label in sorted({label for row in gemm for label in row["speedup_vs_bf16"]}):
        for m in M_VALUES:
            ratios = [row["speedup_vs_bf16"][label] for row in gemm if row["m"] == m and label in row["speedup_vs_bf16"]]
            print(f"{label} vs bf16 mm, geomean at M={m}: {geomean(ratios):.3f}")
    linear = linear_rows()
    for row in linear:
        print("linear", row["m"], row["n"], row["k"], {k: round(v, 4) for k, v in row["ms"].items()},
              row["qfuse_kernels"], round(row["speedup"], 3))
    result = {"machine": info, "scaled_mm": gemm, "linear": linear}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_kernels.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
