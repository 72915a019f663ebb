"""Where the GPU time of the compiled Llama MLP block goes, per kernel: Inductor against qfuse (GPU).

    python benchmarks/explorations/profile_block.py [--m 4096] [--dtypes int8,fp8] [--linear N,K] [--quick] [--out FILE.json]

Compiles `gpu_linear.LlamaMLP` (or, with --linear, one `gpu_linear.QuantLinear` of that N and K) with each backend, profiles three warm calls (torch.profiler, CUDA
activity) and prints the kernels by total GPU time (the 14 largest, µs per call; the registers of
the Triton kernels, and why they matter for the template: `template_code.py`). --quick: M = 16,
int8 only. Writes profile_block.json.
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_linear import FP8, LlamaMLP, QuantLinear, compiled
from qfuse.bench import add_output_arguments, machine, out_path, progress, warm, write

CALLS = 3
TOP = 14


def kernel_rows(model, x, variant: str) -> list[dict]:
    """The TOP kernels of `model(x)` compiled by `variant`, by GPU time per call."""
    with torch.no_grad():
        fn = compiled(model, variant)
        warm(fn, x)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(CALLS):
                fn(x)
            torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda event: -event.device_time_total)
    return [{"variant": variant, "kernel": event.key, "us_per_call": event.device_time_total / CALLS,
             "launches_per_call": event.count // CALLS} for event in events[:TOP]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--linear", default=None, help="N,K: profile one linear of this shape instead of the block")
    add_output_arguments(parser, "profile_block", quick="M = 16, int8 only")
    args = parser.parse_args()
    m, dtypes = (16, ["int8"]) if args.quick else (args.m, args.dtypes.split(","))
    torch._inductor.config.use_static_cuda_launcher = False
    print(machine())
    rows = []
    for name in dtypes:
        dtype = {"int8": torch.int8, "fp8": FP8}[name]
        if args.linear:
            n, k = map(int, args.linear.split(","))
            model, case = QuantLinear(n, k, dtype).cuda(), f"{name} linear M={m} N={n} K={k}"
        else:
            model, k, case = LlamaMLP(dtype), 4096, f"{name} llama_mlp M={m}"
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for variant in ("inductor", "qfuse"):
            progress(f"{case} {variant}")
            kernels = kernel_rows(model, x, variant)
            print(f"== {case} {variant}")
            for row in kernels:
                print(f"  {row['us_per_call']:9.1f} us  x{row['launches_per_call']}  {row['kernel'][:110]}")
            rows += [{"dtype": name, "m": m, "case": case, **row} for row in kernels]
    print(f"wrote {write(out_path(args, 'profile_block'), rows)}")


if __name__ == "__main__":
    main()
