"""The nibble-plane W4A16 template by M bucket: which tile, and how many K splits (`int4_planes`).

Two sweeps on the GPTQ g128 form (`gpu_weight_only.GptqLinear`'s math, written as a function of
its tensors so that one compile serves every weight of the stack), GPU µs per linear from one CUDA
graph over a stack of weights past the L2 (`qfuse.bench.graph_ms_per_call`):

    --part tiles    the eager launch (`triton_int4_planes_mm`) at each tile of M's bucket and
                    splits 1-8; its time includes the activation's plane copy and the split sum
    --part splits   the template, compiled with backend="qfuse" at a static M, at the bucket's
                    tile with each split forced (the FX graph cache is off: the split is not part of
                    its key); Inductor on the same form and the bf16 matmul in the same run; at M = 1
                    also ATen's tinygemm (what CUDA graphs run at M = 1)

Each row block is one M; the chosen rule (`plane_splits`) is marked in the table.

    python benchmarks/explorations/gpu_int4_planes_batched.py --part splits [--ms 1,16,17,32,64,128,256,512] [--out FILE.json]
    python benchmarks/explorations/gpu_int4_planes_batched.py --part tiles [--ms 17,32,64,128] [--out FILE.json]
    python benchmarks/explorations/gpu_int4_planes_batched.py --table FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gemm_cases import SHAPES  # noqa: E402
from gpu_weight_only import GROUP, quantized_stack  # noqa: E402
from qfuse.bench import add_output_arguments, format_table, graph_ms_per_call, out_path, progress, write  # noqa: E402


def gptq(x, qweight, shifts, scales):
    """`GptqLinear.forward` on its tensors."""
    n = qweight.shape[0]
    q = (qweight.unsqueeze(-1) >> shifts) & 0xF
    w = (q.reshape(n, -1, GROUP) - 8).to(x.dtype) * scales.unsqueeze(-1)
    return F.linear(x, w.reshape(n, -1))


def per_linear_us(stack, call) -> float:
    return graph_ms_per_call([lambda linear=linear: call(linear) for linear in stack.linears]) * 1e3


def tiles_for(m: int) -> list[tuple]:
    """The bucket's BLOCK_M (and half of it from 64 rows) at widths 64 and 128, 4 and 8 warps."""
    cover = max(16, 1 << (m - 1).bit_length())
    return [(block_m, width, 128, 1, warps, stages) for block_m in [cover] + ([cover // 2] if cover >= 64 else [])
            for width in (64, 128) for warps in (4, 8) for stages in ((3, 4) if width == 64 else (3,))]


def tile_rows(stack, x, n: int, k: int) -> list[dict]:
    from qfuse.kernels.triton.int4_planes import triton_int4_planes_mm
    from qfuse.kernels.triton.scaled_mm import multiprocessors

    sms, m = multiprocessors(x.device), x.shape[0]
    rows = []
    for tile in tiles_for(m):
        for splits in (1, 2, 4, 8) if m <= 32 else (1, 2, 4):
            def call(linear, tile=tile, splits=splits):
                return triton_int4_planes_mm(x, linear.qweight, linear.shifts, linear.scales, None, None, GROUP,
                                             torch.bfloat16, sms, config=tile, splits=splits)
            rows.append({"variant": "planes (eager)", "tile": list(tile), "splits": splits,
                         "gpu_us": per_linear_us(stack, call)})
    return rows


def split_rows(stack, x, n: int, k: int) -> list[dict]:
    import qfuse.kernels.triton.int4_planes as planes
    from qfuse.kernels import int4_tinygemm
    from qfuse.kernels.triton.scaled_mm import multiprocessors

    m, first = x.shape[0], stack.linears[0]
    rows = []
    inductor = torch.compile(gptq, dynamic=False)
    expected = inductor(x, first.qweight, first.shifts, first.scales).float()
    rows.append({"variant": "inductor", "gpu_us": per_linear_us(stack, lambda l: inductor(x, l.qweight, l.shifts, l.scales))})
    if m == 1:
        packs = {id(l): int4_tinygemm.pack(((((l.qweight.unsqueeze(-1) >> l.shifts) & 0xF).reshape(n, k) - 8)
                                            .t().contiguous().to(torch.int8)), l.scales.t().contiguous())
                 for l in stack.linears}
        rows.append({"variant": "tinygemm (eager)", "gpu_us": per_linear_us(stack, lambda l: torch.ops.aten._weight_int4pack_mm(
            x, packs[id(l)].data, GROUP, packs[id(l)].scale))})
        del packs
    tile = planes.plane_tile(min(m, planes.PLANE_MAX_ROWS))  # above: the largest bucket's
    rule = planes.plane_splits(m, n, k, tile[0], tile[1], multiprocessors(x.device))
    chosen, bounds = planes.plane_splits, dict(planes.PLANE_TILES)
    if m > max(bounds):  # above PLANE_MAX_ROWS: the largest bucket's tile, to see where the template stops winning
        for table in planes.PLANE_TILES.by_gpu.values():  # every GPU's (a GpuTable's buckets are the same on all)
            table[m] = tile
    try:
        for splits in (1, 2, 4, 8) if n <= 4096 else (1, 2, 4):
            planes.plane_splits = lambda *args, splits=splits: splits
            torch._dynamo.reset()
            compiled = torch.compile(gptq, backend="qfuse", dynamic=False)
            out = compiled(x, first.qweight, first.shifts, first.scales).float()
            rows.append({"variant": "qfuse", "tile": list(tile), "splits": splits, "rule": splits == rule,
                         "max_rel_err": ((out - expected).abs().max() / expected.abs().max()).item(),
                         "gpu_us": per_linear_us(stack, lambda l: compiled(x, l.qweight, l.shifts, l.scales))})
    finally:
        planes.plane_splits = chosen
        if m not in bounds:  # the bucket added above
            for table in planes.PLANE_TILES.by_gpu.values():
                del table[m]
    return rows


def table(path: str) -> str:
    cases = defaultdict(list)
    for row in json.loads(open(path).read())["rows"]:
        cases[(row["n"], row["k"], row["m"])].append(row)
    lines = []
    for (n, k, m), rows in cases.items():
        by = {row["variant"]: row["gpu_us"] for row in rows if "splits" not in row}
        timed = sorted((row["gpu_us"], row) for row in rows if "splits" in row)
        best_us, best = timed[0]
        rule = next((row for _, row in timed if row.get("rule")), None)
        picked = rule or best
        lines.append([f"M={m} N={n} K={k}", f"{by['bf16']:.1f}", f"{by['inductor']:.1f}" if "inductor" in by else "",
                      f"{by['tinygemm (eager)']:.1f}" if "tinygemm (eager)" in by else "",
                      ", ".join(f"{tuple(row['tile'][:2] + row['tile'][4:])} x{row['splits']}{'*' if row.get('rule') else ''} {us:.1f}"
                                for us, row in timed[:3]),
                      f"{picked['gpu_us'] / best_us:.2f}",
                      f"{by['inductor'] / picked['gpu_us']:.2f}x" if "inductor" in by else "",
                      f"{by['bf16'] / picked['gpu_us']:.2f}x"])
    return format_table(lines, ["case (GPU µs per linear)", "bf16", "inductor", "tinygemm", "fastest three (tile, splits; * rule)",
                                "rule / fastest", "vs inductor", "vs bf16"], markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default=None)
    parser.add_argument("--part", choices=("splits", "tiles"), default="splits")
    parser.add_argument("--ms", default=None, help="comma-separated M values")
    add_output_arguments(parser, "gpu_int4_planes_batched")
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    default = "1,16,17,32,64,128,256,512" if args.part == "splits" else "17,32,64,128"
    ms = [int(m) for m in (args.ms or default).split(",")]
    out, rows = out_path(args, f"gpu_int4_planes_{args.part}"), []
    with torch.no_grad():
        for n, k in SHAPES:
            stack = quantized_stack(n, k, "gptq")
            for m in ms:
                progress(f"{args.part} M={m} N={n} K={k}")
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                floats = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in stack.linears]
                label = {"m": m, "n": n, "k": k}
                rows.append(label | {"variant": "bf16", "gpu_us": graph_ms_per_call(
                    [lambda w=w: F.linear(x, w) for w in floats]) * 1e3})
                del floats
                part = split_rows if args.part == "splits" else tile_rows
                rows += [label | row for row in part(stack, x, n, k)]
                write(out, rows)
    print(table(str(out)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
