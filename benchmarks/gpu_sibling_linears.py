"""Linears that share an activation (q / k / v, gate / up), one launch each against one launch for all,
on qfuse's CUDA decode kernels and on the bf16 matmul, in one run.

    python benchmarks/gpu_sibling_linears.py [--ms 1,8,16] [--out FILE.json]

Groups at Llama-3-8B sizes (N x K): q / k / v 4096 / 1024 / 1024 x 4096 against one 6144 x 4096 weight,
gate / up 2 x 14336 x 4096 against one 28672 x 4096 weight. GPU time of a group from one CUDA graph over a
stack of weight sets past the L2 (`graph_ms_per_call`), µs; bandwidth: the group's weight bytes / time
against a 1 GiB copy's rate measured in the same run.
"""

from __future__ import annotations

import argparse

import torch

from gpu_int4_mma import GROUP, STACK_BYTES, Int4Weight, copy_bandwidth
from gpu_w8_mma import Weight, random_values
from qfuse.bench import add_output_arguments, format_table, graph_ms_per_call, machine, out_path, progress, write
from qfuse.kernels.cuda import w8_mma
from qfuse.kernels.cuda.int4_mma import int4_mma

FP8 = torch.float8_e4m3fn
GROUPS = {"qkv": [4096, 1024, 1024], "gate_up": [14336, 14336]}  # member N, K = 4096
K = 4096
FORMS = ("int4 W4A16", "int8 W8A16", "fp8 W8A8", "bf16")


def _weight(form: str, n: int, generator):
    if form == "int4 W4A16":
        return Int4Weight(n, K, False, generator)
    if form == "bf16":
        return torch.randn(n, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    return Weight(n, K, torch.int8 if form == "int8 W8A16" else FP8, generator)


def _call(form: str, weight, x, scale_a):
    if form == "int4 W4A16":
        return lambda: int4_mma(x, *weight.mma, None, GROUP, torch.bfloat16)
    if form == "bf16":
        return lambda: x @ weight.t()
    dtype = torch.int8 if form == "int8 W8A16" else FP8
    return lambda: w8_mma.w8_mma(x, weight.cuda.data, dtype, scale_a, weight.scale, None, torch.bfloat16)


def _bytes(form: str, n: int) -> int:
    if form == "int4 W4A16":
        return n * K // 2 + 2 * n * K // GROUP
    return n * K * (2 if form == "bf16" else 1) + (0 if form == "bf16" else 4 * n)


def _time(form: str, widths: list[int], m: int, generator) -> float:
    """µs of one launch a member of `widths`, all members in turn, per weight set."""
    sets = max(2, STACK_BYTES // sum(_bytes(form, n) for n in widths))
    weights = [[_weight(form, n, generator) for n in widths] for _ in range(sets)]
    x = random_values(m, K, FP8 if form == "fp8 W8A8" else torch.bfloat16, generator)
    scale_a = torch.rand(m, 1, device="cuda") / 100 if form == "fp8 W8A8" else None
    calls = [[_call(form, weight, x, scale_a) for weight in members] for members in weights]
    return graph_ms_per_call([lambda members=members: [call() for call in members] for members in calls]) * 1e3


def run(ms) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    rows = []
    for group, widths in GROUPS.items():
        for form in FORMS:
            for m in ms:
                apart, together = _time(form, widths, m, generator), _time(form, [sum(widths)], m, generator)
                weight_bytes = sum(_bytes(form, n) for n in widths)
                for launches, us in (("one a member", apart), ("one for all", together)):
                    rows.append(dict(group=group, form=form, m=m, launches=launches, gpu_us=round(us, 2),
                                     hbm_fraction=round(weight_bytes / (us * 1e-6) / bandwidth, 3),
                                     speedup=round(apart / us, 3)))
                progress(f"{group} {form} M={m}: apart {apart:.1f} µs, together {together:.1f} µs")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,8,16")
    add_output_arguments(parser, "gpu_sibling_linears", quick="M = 1 only")
    args = parser.parse_args()
    rows = run([1] if args.quick else [int(m) for m in args.ms.split(",")])
    header = ["group", "form", "m", "launches", "gpu_us", "hbm_fraction", "speedup"]
    print(format_table([[row[column] for column in header] for row in rows], header))
    write(out_path(args, "gpu_sibling_linears"), rows, machine=machine())


if __name__ == "__main__":
    main()
