"""CPU micro-benchmark behind the `torch` kernel's CPU choices (qfuse/kernels/torch_native.py).

For one GEMM shape (default M=256, K=1024, N=2048) it times, in one process and in turns:

    fp32     torch.mm of float32 operands (what a float linear costs)
    int8     torch._int_mm of int8 operands (the int8 path)
    fp8      torch._scaled_mm(fp8, fp8, unit scales, out float32)
             fp8 upcast to bf16 + torch.mm      (bf16 accumulator output)
             fp8 upcast to float32 + torch.mm   (the path qfuse takes on CPU)

Median (and quartiles) of --runs calls after warm-up (`qfuse.bench.time_in_turns`); prints a
table, writes JSON to --out and, with --plot, a bar chart of the medians.

    .venv/bin/python benchmarks/cpu_kernel_choice.py [--m 256 --k 1024 --n 2048] [--runs 30]
        [--out benchmarks/results/cpu_kernel_choice.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from qfuse.bench import add_output_arguments, format_table, out_path, plot, time_in_turns, write

FP8 = torch.float8_e4m3fn


def candidates(m: int, k: int, n: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=generator), torch.randn(n, k, generator=generator)
    x_int8 = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=generator)
    w_int8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    x_fp8, w_fp8 = x.to(FP8), w.to(FP8)
    unit = torch.ones((), dtype=torch.float32)
    return {
        "fp32 torch.mm": lambda: torch.mm(x, w.t()),
        "int8 torch._int_mm": lambda: torch._int_mm(x_int8, w_int8.t()),
        "fp8 torch._scaled_mm": lambda: torch._scaled_mm(x_fp8, w_fp8.t(), unit, unit, out_dtype=torch.float32),
        "fp8 upcast bf16 + mm": lambda: torch.mm(x_fp8.to(torch.bfloat16), w_fp8.t().to(torch.bfloat16)),
        "fp8 upcast fp32 + mm": lambda: torch.mm(x_fp8.float(), w_fp8.t().float()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=256)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=30)
    add_output_arguments(parser, "cpu_kernel_choice", plot=True)
    args = parser.parse_args()
    times = time_in_turns(candidates(args.m, args.k, args.n), "cpu", runs=args.runs)
    baseline = times["fp32 torch.mm"].median_ms
    rows = [{"candidate": name, **dataclasses.asdict(timing), "vs_fp32_mm": timing.median_ms / baseline}
            for name, timing in times.items()]
    print(f"M={args.m} K={args.k} N={args.n}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(format_table([[row["candidate"], f"{row['median_ms']:.3f}", f"{row['vs_fp32_mm']:.2f}x"] for row in rows],
                       ["candidate", "median ms", "vs fp32 mm"]))
    print(f"wrote {write(out_path(args, 'cpu_kernel_choice'), rows, m=args.m, k=args.k, n=args.n, runs=args.runs)}")
    if args.plot:
        plot(args.plot, rows, x="candidate", y="median_ms", title=f"M={args.m} K={args.k} N={args.n}: median ms")


if __name__ == "__main__":
    main()
