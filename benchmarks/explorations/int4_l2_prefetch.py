"""The CUDA W4A16 decode kernel with its weight brought into the L2 ahead of the loads (an exploration).

    python benchmarks/explorations/int4_l2_prefetch.py [--ms 1,16] [--prefetch 0,4,8,16,32] [--out FILE.json]

Each warp's lane 0 asks the L2 for the weight of the chunks `prefetch` ahead of those its warp loads
(`cp.async.bulk.prefetch.L2` on Hopper: one instruction, no register, no wait), so the loads find the L2
rather than wait on HBM. Per Llama-3-8B linear (q/k/v and gate/up joined), at the launch rule's warps and
unroll and at a few others, GPU µs in one CUDA graph over weights past the L2, timed in turns (three rounds,
the best of each), with the bf16 matmul and tinygemm of the same run, the achieved share of the copy
bandwidth, and whether each output equals the kernel's without prefetch bit for bit.
"""

from __future__ import annotations

import argparse

import torch

from gpu_int4_mma import DECODER_SHAPES, GROUP, Int4Weight, copy_bandwidth, stack_size
from qfuse.bench import add_output_arguments, format_table, graph_ms_per_call, machine, out_path, progress, write
from qfuse.kernels import int4_tinygemm
from qfuse.kernels.cuda.int4_mma import int4_mma, launch_shape, why_not_launch

ROUNDS = 3
SHAPES = ((4, 4), (8, 4), (16, 2), (16, 4))  # (warps, unroll) tried beside the launch rule's


def calls(weights: list[Int4Weight], x: torch.Tensor, prefetches: list[int]) -> dict:
    n, k = weights[0].scale.shape[1], x.shape[1]
    shapes = {launch_shape(x.shape[0], n, k), *(s for s in SHAPES if not why_not_launch(x.shape[0], s[0]))}
    found = {f"cuda {warps}w u{unroll} p{prefetch}": [
        lambda w=w, shape=(warps, unroll), prefetch=prefetch: int4_mma(x, *w.mma, None, GROUP, torch.bfloat16, shape,
                                                                       prefetch=prefetch) for w in weights]
        for warps, unroll in sorted(shapes) for prefetch in prefetches}
    found["tinygemm"] = [lambda w=w: int4_tinygemm.int4pack_mm(x, w.tinygemm, None, torch.bfloat16) for w in weights]
    return found


def run(ms: list[int], prefetches: list[int]) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth()
    progress(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for n, k in DECODER_SHAPES:
        layers = stack_size(n * k // 2)
        weights = [Int4Weight(n, k, False, generator) for _ in range(layers)]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, layers // 4))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            candidates = calls(weights, x, prefetches)
            candidates["bf16 mm"] = [lambda w=w: x @ w.t() for w in dense]
            rule = launch_shape(m, n, k)
            plain = int4_mma(x, *weights[0].mma, None, GROUP, torch.bfloat16, rule, prefetch=0)
            same = {name: bool(torch.equal(group[0](), plain)) for name, group in candidates.items() if name.startswith("cuda")}
            best = {name: float("inf") for name in candidates}
            for _ in range(ROUNDS):
                for name, group in candidates.items():
                    best[name] = min(best[name], graph_ms_per_call(group) * 1e3)
            for name, us in best.items():
                rows.append(dict(n=n, k=k, m=m, kernel=name, rule=name.startswith(f"cuda {rule[0]}w u{rule[1]} "),
                                 gpu_us=round(us, 2), vs_bf16=round(best["bf16 mm"] / us, 2),
                                 hbm_fraction=round(weights[0].bytes / (us * 1e-6) / bandwidth, 3) if name != "bf16 mm" else "",
                                 equal_to_no_prefetch=same.get(name, "")))
            progress(f"N={n} K={k} M={m}: " + ", ".join(f"{name} {us:.1f}" for name, us in sorted(best.items(), key=lambda i: i[1])[:6]))
        del weights, dense
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default="1,16")
    parser.add_argument("--prefetch", default="0,4,8,16,32")
    add_output_arguments(parser, "gpu_int4_l2_prefetch")
    args = parser.parse_args()
    rows = run([int(m) for m in args.ms.split(",")], [int(p) for p in args.prefetch.split(",")])
    header = ["n", "k", "m", "kernel", "rule", "gpu_us", "vs_bf16", "hbm_fraction", "equal_to_no_prefetch"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_int4_l2_prefetch"), rows, machine=machine())


if __name__ == "__main__":
    main()
