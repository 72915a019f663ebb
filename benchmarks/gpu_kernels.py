"""GPU benchmark of the registry's GEMM kernels (issue #4): cutlass vs triton vs torch vs bf16.

    python benchmarks/gpu_kernels.py [--quick] [--out FILE.json]

Every ratio is against a baseline timed in the same run.
1. Kernel level, M in {1, 16, 128, 1024, 4096} x (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}
   plus one unaligned shape (4100, 4100) that the cutlass kernel pads: per-token x per-channel fp8
   and int8, bf16 output, no bias. Each kernel that can implement the key runs `apply` on a weight
   prepared once (as the op does), against bf16 torch.mm of the same sizes.
2. Whole reference-form fp8 W8A8 linear (bf16 in and out) compiled by plain Inductor and by
   backend="qfuse" with the default kernel choice (which kernel that is, is recorded).
--quick: M in {16, 1024}, shapes (4096, 4096) and (4100, 4100) (the linear: the first).
Times: triton.testing.do_bench, median, milliseconds. Writes gpu_kernels.json: rows of sections
kernel and linear.
"""

from __future__ import annotations

import argparse
import itertools

import torch

import qfuse
from gemm_cases import SHAPES, operands, reference_fp8_linear
from qfuse.bench import add_output_arguments, geomean, kernel_ms, machine, out_path, progress, write
from qfuse.kernels import KERNELS, GemmKey
from qfuse.kernels.registry import why_not_implemented
from qfuse.platform import current_platform
from qfuse.schemes import FP8_DTYPE, Granularity, QuantScheme

M_VALUES = (1, 16, 128, 1024, 4096)
UNALIGNED = (4100, 4100)
GPU_KERNELS = ("cutlass", "triton", "torch")
SCHEMES = {
    "fp8": QuantScheme(FP8_DTYPE, FP8_DTYPE, Granularity.PER_TOKEN, Granularity.PER_CHANNEL, dynamic=True),
    "int8": QuantScheme(torch.int8, torch.int8, Granularity.PER_TOKEN, Granularity.PER_CHANNEL, dynamic=True),
}


def kernel_row(m, n, k):
    platform = current_platform("cuda")
    x, w = (torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for rows in (m, n))
    row = {"section": "kernel", "m": m, "n": n, "k": k, "ms": {"bf16 mm": kernel_ms(lambda: torch.mm(x, w.t()))},
           "rejected": {}}
    for (label, scheme), name in itertools.product(SCHEMES.items(), GPU_KERNELS):
        kernel = KERNELS[name]
        key = GemmKey(scheme, n=n, k=k, out_dtype=torch.bfloat16, bias_dtype=None, device_type="cuda")
        reason = why_not_implemented(kernel, key, platform)
        if reason:
            row["rejected"][f"{label} {name}"] = reason
            continue
        a, b, scale_a, scale_b = operands(m, n, k, scheme.activation_dtype)
        weight = kernel.prepare_weight(b.t(), scale_b, None)
        row["ms"][f"{label} {name}"] = kernel_ms(lambda: kernel.apply(a, weight, scale_a, None, None, torch.bfloat16))
    row["speedup_vs_bf16"] = {label: row["ms"]["bf16 mm"] / t for label, t in row["ms"].items() if label != "bf16 mm"}
    return row


def linear_row(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w, w_scale = torch.randn(n, k, device="cuda").to(FP8_DTYPE), torch.rand(n, device="cuda") + 0.5
    times, kernels = {}, []
    for backend in ("inductor", "qfuse"):
        torch._dynamo.reset()
        marker = qfuse.graphs_compiled()
        compiled = torch.compile(reference_fp8_linear, backend=backend)
        compiled(x, w, w_scale)
        if backend == "qfuse":
            kernels = [record.kernel for report in qfuse.reports_since(marker) for record in report.fused]
        times[backend] = kernel_ms(lambda: compiled(x, w, w_scale))
    return {"section": "linear", "m": m, "n": n, "k": k, "ms": times, "qfuse_kernels": kernels,
            "speedup": times["inductor"] / times["qfuse"]}


def print_summary(gemm, linear, ms):
    for row in gemm:
        print(row["m"], row["n"], row["k"], {label: round(t, 4) for label, t in row["ms"].items()})
    if gemm[0]["rejected"]:
        print("rejected:", gemm[0]["rejected"])
    for label in sorted({label for row in gemm for label in row["speedup_vs_bf16"]}):
        for m in ms:
            ratios = [row["speedup_vs_bf16"][label] for row in gemm if row["m"] == m and label in row["speedup_vs_bf16"]]
            print(f"{label} vs bf16 mm, geomean at M={m}: {geomean(ratios):.3f}")
    for row in linear:
        print("linear", row["m"], row["n"], row["k"], {k: round(v, 4) for k, v in row["ms"].items()},
              row["qfuse_kernels"], round(row["speedup"], 3))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output_arguments(parser, "gpu_kernels", quick="M in {16, 1024}, one aligned and the unaligned shape")
    args = parser.parse_args()
    out = out_path(args, "gpu_kernels")
    cuda_platform = str(current_platform("cuda"))
    print(machine(), cuda_platform)
    if args.quick:
        ms, shapes, linear_ms, linear_shapes = (16, 1024), (SHAPES[0], UNALIGNED), (16, 1024), SHAPES[:1]
    else:
        ms, shapes, linear_ms, linear_shapes = M_VALUES, (*SHAPES, UNALIGNED), (1, 16, 1024, 4096), SHAPES
    gemm = []
    for m, (n, k) in itertools.product(ms, shapes):
        progress(f"kernels M={m} N={n} K={k}")
        gemm.append(kernel_row(m, n, k))
    linear = []
    for m, (n, k) in itertools.product(linear_ms, linear_shapes):
        progress(f"compiled linear M={m} N={n} K={k}")
        linear.append(linear_row(m, n, k))
    print_summary(gemm, linear, ms)
    write(out, gemm + linear, platform=cuda_platform)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
