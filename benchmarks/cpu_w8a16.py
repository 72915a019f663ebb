"""CPU micro-benchmark behind the `onednn` kernel's choices (qfuse/kernels/onednn.py).

W8A16 (fp8 e4m3fn weight with 128x128 block scales, bf16 activation not quantized), the torch paths
this CPU has when vLLM's fp8_scaled_mm_cpu is not installed:

    bf16 once, oneDNN pack   dequantized to bf16 and mkldnn._reorder_linear_weight once,
                             mkldnn._linear_pointwise per call (the onednn kernel's call)
    bf16 once, F.linear      the weight dequantized to bf16 [N, K] once, F.linear
    bf16 once, mm [K, N]     the same weight stored [K, N] contiguous, torch.mm
    fp32 once, F.linear      the weight dequantized to fp32 once, the activation upcast per call
    dequantize per call      b * scale_b to bf16 on every call, then torch.mm

With --w8a8, also the int8 / fp8 W8A8 GEMMs (per-tensor activation scale, per-channel weight):

    onednn kernel            qlinear on the activation shifted to uint8 (one call does it all)
    onednn per-token         the same with a per-token scale: qlinear fp32 + torch epilogue
    int8 as int8 (ref)       qlinear on the int8 activation: oneDNN's reference kernel on VNNI
                             (timed for M <= --ref-max-m only: seconds per call)
    torch kernel             torch._int_mm + float epilogue (the `torch` kernel)
    fp8 qlinear              onednn.qlinear_pointwise on fp8 activation and weight
    torch kernel fp8         fp8 upcast to bf16 + torch.mm (the `torch` kernel on CPU)

Median wall time (time.perf_counter) of --runs calls after warm-up, the candidates timed in turns
(`qfuse.bench.time_in_turns`). Before each timed call a 256 MiB buffer is written, so no weight is
left in the caches (a model's many layers do not stay there; a warm 16 MiB weight at M = 1 would
time the L3, not the GEMM); --warm skips that. Prints a table per section, writes the medians and
quartiles to --out and, with --plot, the medians against M. No assertions: the numbers go to the
onednn module docstring.

    .venv/bin/python benchmarks/cpu_w8a16.py [--m 1 32 256] [--k 4096 --n 4096] [--runs 7] [--w8a8]
        [--out benchmarks/results/cpu_w8a16.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qfuse.bench import add_output_arguments, format_table, machine, out_path, plot, progress, time_in_turns, write

from qfuse.kernels.onednn import OneDnnKernel, dequantize_weight
from qfuse.kernels.torch_native import TorchKernel
from qfuse.schemes import FP8_DTYPE, GROUP_SIZE

ONEDNN, TORCH = OneDnnKernel(), TorchKernel()


def w8a16_candidates(m: int, k: int, n: int, generator: torch.Generator) -> dict:
    b = (torch.randn(n, k, generator=generator) * 40).to(FP8_DTYPE).t()  # [K, N] view of a stored [N, K]
    scale_b = torch.rand(math.ceil(k / GROUP_SIZE), math.ceil(n / GROUP_SIZE), generator=generator) * 0.01
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    prepared = ONEDNN.prepare_weight(b, scale_b, None)
    weight_kn = dequantize_weight(b, scale_b, torch.bfloat16).contiguous()
    weight_nk = weight_kn.t().contiguous()
    weight_fp32 = dequantize_weight(b, scale_b, torch.float32).t().contiguous()
    return {
        "bf16 once, oneDNN pack": lambda: ONEDNN.weight_only_apply(x, prepared, None, torch.bfloat16),
        "bf16 once, F.linear": lambda: F.linear(x, weight_nk),
        "bf16 once, mm [K, N]": lambda: torch.mm(x, weight_kn),
        "fp32 once, F.linear": lambda: F.linear(x.float(), weight_fp32),
        "dequantize per call": lambda: torch.mm(x, dequantize_weight(b, scale_b, torch.bfloat16)),
    }


def w8a8_candidates(m: int, k: int, n: int, generator: torch.Generator, time_reference: bool) -> dict:
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=generator)
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator).t()
    scale_a, token_scales = torch.tensor(0.02), torch.rand(m, 1, generator=generator)
    scale_b = torch.rand(1, n, generator=generator) * 0.01
    packed, plain = ONEDNN.prepare_weight(b, scale_b, None), TORCH.prepare_weight(b, scale_b, None)
    a_fp8 = (torch.randn(m, k, generator=generator) * 40).to(FP8_DTYPE)
    b_fp8 = (torch.randn(n, k, generator=generator) * 40).to(FP8_DTYPE)
    packed_fp8 = torch.ops.onednn.qlinear_prepack(b_fp8, None)
    channel_scales, zero_points = scale_b.reshape(n), torch.zeros(n, dtype=torch.int32)
    plain_fp8 = TORCH.prepare_weight(b_fp8.t(), scale_b, None)
    candidates = {
        "onednn kernel": lambda: ONEDNN.apply(a, packed, scale_a, None, None, torch.bfloat16),
        "onednn per-token": lambda: ONEDNN.apply(a, packed, token_scales, None, None, torch.bfloat16),
        "torch kernel": lambda: TORCH.apply(a, plain, token_scales, None, None, torch.bfloat16),
        "fp8 qlinear": lambda: torch.ops.onednn.qlinear_pointwise(
            a_fp8, 0.02, 0, packed_fp8, channel_scales, zero_points, None, 1.0, 0, torch.bfloat16, "none", [], ""),
        "torch kernel fp8": lambda: TORCH.apply(a_fp8, plain_fp8, scale_a, None, None, torch.bfloat16),
    }
    if time_reference:
        candidates["int8 as int8 (ref)"] = lambda: torch.ops.onednn.qlinear_pointwise(
            a, 0.02, 0, packed.packed, packed.scale, packed.zero_point, None, 1.0, 0, torch.bfloat16, "none", [], "")
    return candidates


def cache_flush() -> Callable[[], None]:
    """A call that writes a 256 MiB buffer (a new value each time): no operand stays in the caches."""
    buffer, count = torch.empty(64 * 2**20, dtype=torch.float32), itertools.count()
    return lambda: buffer.fill_(next(count))


def section_rows(section: str, candidates: Callable[[int], dict], ms: list[int], runs: int, warmup: int,
                 flush: Callable[[], None] | None) -> list[dict]:
    rows = []
    for m in ms:
        progress(f"{section} M={m}")
        times = time_in_turns(candidates(m), "cpu", runs=runs, warmup=warmup, before_each=flush)
        rows += [{"section": section, "m": m, "candidate": name, **dataclasses.asdict(timing)} for name, timing in times.items()]
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    names = list(dict.fromkeys(row["candidate"] for row in rows))
    medians = {(row["m"], row["candidate"]): row["median_ms"] for row in rows}
    ms = list(dict.fromkeys(row["m"] for row in rows))
    cells = [[m, *(f"{medians[m, name]:.3f}" if (m, name) in medians else "-" for name in names)] for m in ms]
    print(f"\n{title} (median ms)")
    print(format_table(cells, ["M", *names]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--w8a8", action="store_true", help="also time the int8 / fp8 W8A8 candidates")
    parser.add_argument("--ref-max-m", type=int, default=1, help="largest M at which to time int8-as-int8")
    parser.add_argument("--warm", action="store_true", help="leave the caches warm between calls")
    add_output_arguments(parser, "cpu_w8a16", plot=True)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    info = machine()
    print(f"K={args.k} N={args.n}, torch {info['torch']}, {info['torch_threads']} threads, "
          f"AVX-512 VNNI {torch.cpu._is_vnni_supported()}, AMX {torch.cpu._is_amx_tile_supported()}, "
          f"caches {'warm' if args.warm else 'flushed before each call'}")
    flush = None if args.warm else cache_flush()
    rows = section_rows("w8a16", lambda m: w8a16_candidates(m, args.k, args.n, generator), args.m, args.runs, 2, flush)
    print_table("W8A16: fp8 block weight, bf16 activation, bf16 out", rows)
    if args.w8a8:
        w8a8 = section_rows("w8a8", lambda m: w8a8_candidates(m, args.k, args.n, generator, m <= args.ref_max_m),
                            args.m, args.runs, 1, flush)
        print_table("W8A8: int8 / fp8 activation and weight, bf16 out", w8a8)
        rows += w8a8
    out = write(out_path(args, "cpu_w8a16"), rows, k=args.k, n=args.n, runs=args.runs, caches="warm" if args.warm else "flushed")
    print(f"\nwrote {out}")
    if args.plot:
        plot(args.plot, rows, x="m", y="median_ms", series="candidate", panels=("section",),
             title=f"K={args.k} N={args.n} on {info['cpu']}: median ms")


if __name__ == "__main__":
    main()
