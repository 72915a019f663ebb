"""CPU W8A8 GEMM backends side by side: int8 dynamic per-token x per-channel, bfloat16 activations.

For each M (default 1, 32, 256) and N = K = 4096 it times, in turns (`qfuse.bench.time_in_turns`:
warm-up, then the median and quartiles of --runs calls timed with time.perf_counter):

    zentorch    the qfuse `zentorch` kernel's quant_apply: zentorch_dynamic_qlinear quantizes the
                bfloat16 activation per token and runs the int8 GEMM; the weight prepared once
    onednn      the qfuse `onednn` kernel, when the registry has one (quant_apply if it fuses the
                activation quantization, else qfuse's quantizer + apply); the weight prepared once
    torch       the qfuse `torch` kernel: qfuse's dynamic per-token quantizer, torch._int_mm, and
                the float32 rescale epilogue
    fp32 mm     torch.mm of float32 activations and the dequantized float32 weight (the baseline)
    bf16 mm     torch.mm of the bfloat16 activations and the dequantized bfloat16 weight

Every candidate's result is also compared with the fp32 one (relative Frobenius error), so a fast
wrong backend shows. A backend that cannot run here is listed with the reason. Prints a markdown
table (median ms, time relative to fp32 mm, error); writes the results with the CPU model, flags,
thread count and versions to --out, and plots the medians against M to --plot.

    .venv/bin/python benchmarks/cpu_gemm_backends.py [--m 1 32 256] [--n 4096 --k 4096]
        [--threads N] [--runs 20] [--out benchmarks/results/cpu_gemm_backends.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from collections.abc import Callable

import torch

from qfuse.bench import add_output_arguments, format_table, machine, out_path, plot, relative_error, time_in_turns, write
from qfuse.kernels import KERNELS
from qfuse.kernels.base import GemmKey
from qfuse.kernels.registry import why_not_implemented
from qfuse.platform import current_platform
from qfuse.schemes import Granularity, QuantScheme

SCHEME = QuantScheme(torch.int8, torch.int8, Granularity.PER_TOKEN, Granularity.PER_CHANNEL, dynamic=True)
ACTIVATION_DTYPE = torch.bfloat16
EPS = 1e-5


def operands(m: int, n: int, k: int):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=generator).to(ACTIVATION_DTYPE)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    w_scale = torch.rand(n, generator=generator) * 0.01 + 0.001
    return x, w, w_scale


def why_kernel_cannot_run(name: str, n: int, k: int) -> str:
    """'' if the qfuse kernel `name` can run this GEMM here, else the reason."""
    if name not in KERNELS:
        return f"no {name!r} kernel in qfuse.kernels.KERNELS"
    if name == "zentorch" and importlib.util.find_spec("zentorch") is None:
        return "zentorch is not installed (pip install 'qfuse[zentorch]')"
    kernel, platform = KERNELS[name], current_platform("cpu")
    key = GemmKey(SCHEME, n=n, k=k, out_dtype=ACTIVATION_DTYPE, bias_dtype=None, device_type="cpu")
    ok, reason = kernel.is_supported(platform)
    return reason if not ok else why_not_implemented(kernel, key, platform)


def qfuse_kernel_call(name: str, x, w, w_scale) -> Callable[[], torch.Tensor]:
    """One call of a qfuse kernel on bfloat16 x, its weight prepared here, once."""
    kernel = KERNELS[name]
    weight = kernel.prepare_weight(w.t(), w_scale.reshape(1, -1), None)
    if kernel.fuses_activation_quant:
        return lambda: kernel.quant_apply(x, weight, None, None, torch.int8, EPS, ACTIVATION_DTYPE)

    def quantize_then_apply():
        q, scale = kernel.dynamic_quant(x, torch.int8, Granularity.PER_TOKEN, EPS)
        return kernel.apply(q, weight, scale, None, None, ACTIVATION_DTYPE)

    return quantize_then_apply


def candidates(m: int, n: int, k: int) -> tuple[dict[str, Callable], dict[str, str]]:
    """(name -> call, name -> why it is skipped)."""
    x, w, w_scale = operands(m, n, k)
    dequantized = (w.float() * w_scale.reshape(-1, 1)).t().contiguous()  # [K, N] float32
    dequantized_bf16, x_fp32 = dequantized.to(torch.bfloat16), x.float()
    calls = {"fp32 mm": lambda: torch.mm(x_fp32, dequantized), "bf16 mm": lambda: torch.mm(x, dequantized_bf16)}
    skipped = {}
    for name in ("zentorch", "onednn", "torch"):
        reason = why_kernel_cannot_run(name, n, k)
        if reason:
            skipped[name] = reason
        else:
            calls[name] = qfuse_kernel_call(name, x, w, w_scale)
    return calls, skipped


def measure(m: int, n: int, k: int, runs: int) -> list[dict]:
    calls, skipped = candidates(m, n, k)
    reference = calls["fp32 mm"]()
    errors = {name: relative_error(call(), reference) for name, call in calls.items()}
    times = time_in_turns(calls, "cpu", runs=runs)
    baseline = times["fp32 mm"].median_ms
    rows = [{"m": m, "n": n, "k": k, "backend": name, **dataclasses.asdict(times[name]),
             "vs_fp32_mm": times[name].median_ms / baseline, "relative_error": errors[name], "skipped": None}
            for name in ("zentorch", "onednn", "torch", "fp32 mm", "bf16 mm") if name in calls]
    rows += [{"m": m, "n": n, "k": k, "backend": name, "skipped": reason} for name, reason in skipped.items()]
    return rows


def markdown(rows: list[dict]) -> str:
    cells = [[row["m"], row["backend"], f"skipped: {row['skipped']}", "", ""] if row["skipped"] else
             [row["m"], row["backend"], f"{row['median_ms']:.3f}", f"{row['vs_fp32_mm']:.2f}x", f"{row['relative_error']:.1e}"]
             for row in rows]
    return format_table(cells, ["M", "backend", "median ms", "vs fp32 mm", "rel. error vs fp32"], markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--runs", type=int, default=20)
    add_output_arguments(parser, "cpu_gemm_backends", plot=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    info = machine()
    rows = [row for m in args.m for row in measure(m, args.n, args.k, args.runs)]
    print(f"{info['cpu']} ({info['platform']}), {info['torch_threads']} threads, torch {info['torch']}, "
          f"zentorch {info['zentorch']}; N={args.n} K={args.k}, bf16 activations, median of {args.runs}\n")
    print(markdown(rows))
    print(f"\nwrote {write(out_path(args, 'cpu_gemm_backends'), rows, runs=args.runs)}")
    if args.plot:
        plot(args.plot, rows, x="m", y="median_ms", series="backend",
             title=f"W8A8 GEMM on {info['cpu']}, N={args.n} K={args.k}, {info['torch_threads']} threads: median ms")


if __name__ == "__main__":
    main()
