"""How the CUDA W4A16 decode kernel streams its weight, per Llama-3-8B linear (an exploration).

    mkdir -p /tmp/before && for f in int4_mma.py int4_mma.cu; do
        git show COMMIT:qfuse/kernels/cuda/$f > /tmp/before/$f; done
    python benchmarks/explorations/int4_decode_stream.py --before /tmp/before [--ms 1,16] [--out FILE.json]

GPU µs per linear in one CUDA graph over weights past the L2 (three rounds in turns, the best of each), each
call's relative error against the float product, for:
- the kernel of `--before` and the current one, each at its launch rule's pick;
- the current source at other launch shapes (warps a block, chunks loaded ahead, `__launch_bounds__`'s
  blocks a multiprocessor, `-DMIN_BLOCKS`);
- tinygemm and the bf16 matmul.
The hbm column is the weight's bytes over the time, against the bf16 matmul's read bandwidth of the same run.

The recorded run (benchmarks/results/gpu_int4_decode_stream_h200.json, session 34) also holds ablation rows made with
-D switches since removed from the kernel: "no dequantize" (each pair's dequantize one xor), "no mma" (the MMAs xors),
"loads only" (both); their results are wrong and only timed (docs/benchmarks.md, "The int4 decode kernel's stream").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_int4_mma import DECODER_SHAPES, GROUP, Int4Weight, stack_size  # noqa: E402
from int4_kernel_before_after import load_before  # noqa: E402

from qfuse.bench import add_output_arguments, format_table, graph_us_in_turns, machine, out_path, progress, write  # noqa: E402
from qfuse.kernels import int4_tinygemm  # noqa: E402
from qfuse.kernels.cuda import int4_mma as current  # noqa: E402
from qfuse.kernels.cuda import launch  # noqa: E402

def shapes(m: int, n: int, k: int) -> list[tuple[int, int, int]]:
    """(warps, unroll, blocks a multiprocessor the compiler must fit: 1, or 32 warps' worth, at most 64 registers) to
    try: the launch rule's warps and its neighbours."""
    warps, _ = current.launch_shape(m, n, k)
    tried = {(w, unroll, blocks) for w in (warps // 2, warps, 2 * warps) if 4 <= w <= 16 for unroll in (4, 8)
             for blocks in (1, 32 // w)}
    return sorted(shape for shape in tried if not current.why_not_launch(m, shape[0]))


def compiled(m: int, k: int, warps: int, unroll: int, extra: tuple[str, ...] = ()):
    options = (f"-DM_TILES={current.column_tiles(m)}", f"-DWARPS={warps}", f"-DUNROLL={unroll}",
               f"-DGROUP_SHIFT={current.group_shift(k, GROUP)}", "-DHALF_BF16", *extra)
    return launch.compiled(current.SOURCE, "qfuse_int4_mma", options, current.ARGUMENT_TYPES, 0)


def variant_call(kernel, warps: int, x: torch.Tensor, weight: Int4Weight, out: torch.Tensor):
    words, pairs = weight.mma
    m, k = x.shape
    n = pairs.shape[1]
    return lambda: kernel.launch(n // 16, warps, (words, x, pairs, pairs, out, m, n, k, 0), x.device)


def run(ms: list[int], before) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n, k in DECODER_SHAPES:
        weights = [Int4Weight(n, k, False, generator) for _ in range(stack_size(n * k // 2))]
        earlier = [before.repack(weight.values, weight.scale, weight.zero) for weight in weights]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, len(weights) // 4))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            calls = {
                "before (launch rule)": [lambda w=w: before.int4_mma(x, *w, None, GROUP, torch.bfloat16) for w in earlier],
                "after (launch rule)": [lambda w=w: current.int4_mma(x, *w.mma, None, GROUP, torch.bfloat16)
                                        for w in weights],
                "tinygemm": [lambda w=w: int4_tinygemm.int4pack_mm(x, w.tinygemm, None, torch.bfloat16) for w in weights],
                "bf16 mm": [lambda w=w: x @ w.t() for w in dense],
            }
            for warps, unroll, blocks in shapes(m, n, k):
                kernel = compiled(m, k, warps, unroll, (f"-DMIN_BLOCKS={blocks}",))
                calls[f"{warps} warps, unroll {unroll}, {blocks} blocks"] = [variant_call(kernel, warps, x, w, out)
                                                                             for w in weights]
            expected = x.float() @ weights[0].dequantized().float()
            errors = {}
            for name, graph in calls.items():
                if name != "bf16 mm":
                    result = graph[0]()
                    result = out if result is None else result
                    errors[name] = ((result.float() - expected).norm() / expected.norm()).item()
            times = graph_us_in_turns(calls)  # best of three rounds in turns
            bandwidth = n * k * 2 / (times["bf16 mm"] * 1e-6)  # the bf16 matmul's read of its weight
            for name, us in sorted(times.items(), key=lambda item: item[1]):
                rows.append(dict(n=n, k=k, m=m, kernel=name, us=round(us, 2), vs_bf16=round(times["bf16 mm"] / us, 2),
                                 hbm_vs_bf16_read=round(weights[0].bytes / (us * 1e-6) / bandwidth, 3),
                                 rel_error=errors.get(name)))
            progress(f"N={n} K={k} M={m}: " + ", ".join(f"{name} {us:.2f}" for name, us in
                                                          sorted(times.items(), key=lambda item: item[1])[:6]))
        del weights, earlier, dense
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="a folder with the earlier int4_mma.py and .cu")
    parser.add_argument("--ms", default="1,16", help="rows of x, comma-separated")
    add_output_arguments(parser, "gpu_int4_decode_stream")
    args = parser.parse_args()
    rows = run([int(m) for m in args.ms.split(",")], load_before(args.before))
    header = ["n", "k", "m", "kernel", "us", "vs_bf16", "hbm_vs_bf16_read", "rel_error"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, "gpu_int4_decode_stream"), rows, machine=machine())


if __name__ == "__main__":
    main()
