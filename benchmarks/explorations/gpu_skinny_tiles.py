"""Skinny W8A8 GEMMs (16 < M <= 128) on the GPU: which tile of qfuse's Triton kernel to run there.

Between decode (M <= 16, `scaled_mm.DECODE_TILES`) and prefill, the M-bucket table (`scaled_mm.CONFIGS`)
has a 64 x 128 tile. At N = 4096 that is 32 column blocks on a GPU of 132 multiprocessors: the
template's GEMM took 50 µs at M = 17-64, N = 4096, K = 14336 on an H100, against 33 µs for cuBLAS's
`_int_mm` (docs/benchmarks.md, issue #13), which led to `scaled_mm.SKINNY_TILE`. This script times,
per dtype, M and (N, K) of `gemm_cases.SHAPES`, the eager kernel (`triton_scaled_mm`, per-token x
per-channel scales, bf16 out) at the table's tile and at candidate tiles that fill the GPU with
more blocks, beside the raw GEMM (`_int_mm` / row-wise `_scaled_mm`): GPU µs per call of 20 calls
in one CUDA graph (`qfuse.bench.gpu_time`, as gpu_linear's GPU column; a weight that fits the L2
stays there). Under `do_bench` the eager launcher's Python (40-100 µs) showed through every Triton
row. fp8 tiles promote their accumulator every `scaled_mm.PROMOTE_K` of K.

    python benchmarks/explorations/gpu_skinny_tiles.py [--dtypes int8,fp8] [--ms 17,32,64,128] [--out FILE.json]
    python benchmarks/explorations/gpu_skinny_tiles.py --table FILE.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gemm_cases import FP8, SHAPES, operands
from gpu_linear import raw_gemm
from qfuse.bench import add_output_arguments, format_table, gpu_time, out_path, progress, write

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages)
CANDIDATES = (
    (16, 32, 512, 8, 4, 6), (16, 64, 256, 8, 4, 4), (32, 32, 512, 8, 4, 4), (32, 64, 256, 8, 4, 4),
    (32, 128, 128, 8, 4, 4), (64, 64, 128, 8, 4, 4), (64, 64, 256, 8, 4, 3), (64, 128, 128, 8, 8, 4),
)


def case_rows(dtype: torch.dtype, m: int, n: int, k: int) -> list[dict]:
    from qfuse.kernels.triton.scaled_mm import CONFIGS, triton_scaled_mm

    a, w, sa, sb = operands(m, n, k, dtype)
    label = {"dtype": "int8" if dtype == torch.int8 else "fp8", "m": m, "n": n, "k": k}
    table_tile = next(config for bound, config in sorted(CONFIGS[label["dtype"]].items()) if m <= bound)
    expected = triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16, config=table_tile)
    rows = [label | {"variant": "raw GEMM", "us": gpu_time(raw_gemm(m, n, k, dtype))}]
    for tile in (table_tile, *(tile for tile in CANDIDATES if tile != table_tile)):
        out = triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16, config=tile)
        if dtype == torch.int8:  # int32 sums are exact: every tile gives the same bits
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
        us = gpu_time(lambda: triton_scaled_mm(a, w.t(), sa, sb, None, torch.bfloat16, config=tile))
        rows.append(label | {"variant": "table tile" if tile == table_tile else "candidate", "tile": tile, "us": us})
    return rows


def table(rows: list[dict]) -> str:
    from qfuse.kernels.triton.scaled_mm import SKINNY_TILE

    lines = []
    for case in dict.fromkeys((r["dtype"], r["m"], r["n"], r["k"]) for r in rows):
        mine = [r for r in rows if (r["dtype"], r["m"], r["n"], r["k"]) == case]
        raw = next(r["us"] for r in mine if r["variant"] == "raw GEMM")
        table_row = next(r for r in mine if r["variant"] == "table tile")
        skinny = next((f"{r['us']:.1f}" for r in mine if tuple(r.get("tile", ())) == SKINNY_TILE), "-")
        best = min((r for r in mine if "tile" in r), key=lambda r: r["us"])
        lines.append([*case, f"{raw:.1f}", f"{table_row['us']:.1f} {tuple(table_row['tile'][:3])}", skinny,
                      f"{best['us']:.1f} {tuple(best['tile'])}"])
    return format_table(lines, ["dtype", "M", "N", "K", "raw GEMM µs", "table tile µs", f"{SKINNY_TILE[:3]} µs",
                                "best tile µs"], markdown=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="int8,fp8")
    parser.add_argument("--ms", default="17,32,64,128")
    parser.add_argument("--table", default=None, help="print the markdown table of a result file and stop")
    add_output_arguments(parser, "gpu_skinny_tiles")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())["rows"]))
        return
    rows, out = [], out_path(args, "gpu_skinny_tiles")
    for dtype in (torch.int8 if name == "int8" else FP8 for name in args.dtypes.split(",")):
        for m in (int(m) for m in args.ms.split(",")):
            for n, k in SHAPES:
                progress(f"{dtype} M={m} N={n} K={k}")
                rows += case_rows(dtype, m, n, k)
                write(out, rows)
    print(table(rows))


if __name__ == "__main__":
    main()
