"""The CUDA W4A16 decode kernel with x staged in shared memory, at 9-64 rows (an exploration, issue #38).

    python benchmarks/explorations/int4_batched_decode.py [--ms 16,32,64] [--out FILE.json]

`qfuse_int4_mma` gives each block one 16-row tile of the weight and lets its warps split K, so every block reads
all of x: at 16 rows and more, x's trips through the L2 and L1, not the weight's, bound a launch
(docs/benchmarks.md, "The int4 decode kernel's stream"). `qfuse_int4_mma_rows` (int4_mma_rows.cu, not kept) gives a block
ROW_TILES tiles and stages x in shared memory once a step for all of them. GPU µs per linear in one CUDA graph over weights past the
L2 (best of three rounds in turns), each call's relative error against the float product, for:
- the current launch rule (`int4_mma`: `qfuse_int4_mma`);
- `qfuse_int4_mma_rows` at row tiles x warps along K x chunks a step (and `__launch_bounds__`' warps a
  multiprocessor, where given);
- the nibble-plane Triton template (what kernel choice runs above 16 rows), tinygemm and the bf16 matmul.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from gpu_int4_mma import DECODER_SHAPES, GROUP, Int4Weight, stack_size  # noqa: E402

from qfuse.bench import add_output_arguments, format_table, graph_us_in_turns, machine, out_path, progress, write  # noqa: E402
from qfuse.kernels import int4_tinygemm  # noqa: E402
from qfuse.kernels.cuda import int4_mma, launch  # noqa: E402
from qfuse.kernels.triton.int4_planes import triton_int4_planes_mm  # noqa: E402
from qfuse.kernels.triton.scaled_mm import multiprocessors  # noqa: E402

MOST_SHARED = 200 * 2**10
ROWS_SOURCE = Path(__file__).with_name("int4_mma_rows.cu")


def stage_bytes(m_tiles: int, warps: int, row_tiles: int, unroll: int) -> int:
    """Dynamic shared memory of a `qfuse_int4_mma_rows` block: two stages of x (8 rows a tile of B, each the step's
    chunks of K and 16 bytes of padding), which hold the warps' partial sums after the loop."""
    step_chunks = warps // row_tiles * unroll
    return max(2 * 8 * m_tiles * (8 * step_chunks + 1) * 16, warps * 32 * 4 * m_tiles * 4)


@functools.cache
def rows_source() -> Path:
    """int4_mma.cu's helpers (its text up to `multiply_tile`) followed by int4_mma_rows.cu, in one file."""
    helpers = int4_mma.SOURCE.read_text().split("// The block's 16-row tile on `lane`'s weight")[0]
    path = Path(tempfile.mkdtemp()) / "int4_mma_rows_full.cu"
    path.write_text(helpers + ROWS_SOURCE.read_text())
    return path


def variants(m: int, n: int) -> list[tuple[int, int, int, int]]:
    """(row tiles, warps along K, chunks a step, warps a multiprocessor for __launch_bounds__: 0 the kernel's own)."""
    m_tiles = int4_mma.column_tiles(m)
    bounds = {1: (0,), 2: (0, 16), 4: (0, 16), 8: (0, 8)}[m_tiles]
    tried = []
    for row_tiles, k_warps, unroll, warps_per_sm in itertools.product((2, 4, 8), (1, 2, 4), (2, 4), bounds):
        warps = row_tiles * k_warps
        if (n // 16) % row_tiles or not 2 <= warps <= 16:
            continue
        if stage_bytes(m_tiles, warps, row_tiles, unroll) > MOST_SHARED:
            continue
        tried.append((row_tiles, k_warps, unroll, warps_per_sm))
    return tried


def rows_call(x, weight: Int4Weight, out, row_tiles: int, k_warps: int, unroll: int, warps_per_sm: int):
    m, k = x.shape
    words, pairs = weight.mma
    n = pairs.shape[1]
    warps = row_tiles * k_warps
    m_tiles = int4_mma.column_tiles(m)
    options = (f"-DM_TILES={m_tiles}", f"-DWARPS={warps}", f"-DUNROLL={unroll}", f"-DROW_TILES={row_tiles}",
               f"-DGROUP_SHIFT={int4_mma.group_shift(k, GROUP)}", "-DHALF_BF16")
    options += (f"-DMIN_BLOCKS=MIN_BLOCKS_FOR({warps_per_sm})",) if warps_per_sm else ()
    kernel = launch.compiled(rows_source(), "qfuse_int4_mma_rows", options, int4_mma.ARGUMENT_TYPES, 0,
                             stage_bytes(m_tiles, warps, row_tiles, unroll))
    return lambda: kernel.launch(n // 16 // row_tiles, warps, (words, x, pairs, pairs, out, m, n, k, 0), x.device)


def timed_against_the_rule(ms: list[int], shapes, variant_calls, tinygemm: bool = True) -> list[dict]:
    """For each N x K of `shapes` and M of `ms`, a row a kernel: GPU µs per linear in one CUDA graph over weights past
    the L2 (best of three rounds in turns) and the first call's relative error against the float product, for the
    launch rule of `qfuse_int4_mma`, the nibble-plane template, tinygemm (where asked), bf16's matmul and the named
    lists of calls `variant_calls(x, weights, outs)` gives (a call a weight; one that returns None writes its out)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    sms = multiprocessors(torch.device("cuda"))
    rows = []
    for n, k in shapes:
        weights = [Int4Weight(n, k, False, generator) for _ in range(stack_size(n * k // 2))]
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, len(weights) // 4))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
            calls = {
                "cuda (launch rule)": [lambda w=w: int4_mma.int4_mma(x, *w.mma, None, GROUP, torch.bfloat16)
                                       for w in weights],
                "triton planes": [lambda w=w: triton_int4_planes_mm(x, w.words, None, w.scales_nk, w.zeros_packed, None,
                                                                    GROUP, torch.bfloat16, sms) for w in weights],
                "bf16 mm": [lambda w=w: x @ w.t() for w in dense],
            }
            if tinygemm:
                calls["tinygemm"] = [lambda w=w: int4_tinygemm.int4pack_mm(x, w.tinygemm, None, torch.bfloat16)
                                     for w in weights]
            calls.update(variant_calls(x, weights, outs))
            expected = x.double() @ weights[0].dequantized().double()
            errors = {}
            for name, graph in calls.items():
                if name != "bf16 mm":
                    result = graph[0]()
                    result = outs[0] if result is None else result
                    errors[name] = ((result.double() - expected).norm() / expected.norm()).item()
            times = graph_us_in_turns(calls)
            ranked = sorted(times.items(), key=lambda item: item[1])
            for name, us in ranked:
                rows.append(dict(n=n, k=k, m=m, kernel=name, us=round(us, 2), vs_bf16=round(times["bf16 mm"] / us, 2),
                                 tb_per_s=round(weights[0].bytes / us / 1e6, 2), rel_error=errors.get(name)))
            progress(f"N={n} K={k} M={m}: " + ", ".join(f"{name} {us:.2f}" for name, us in ranked[:5])
                     + f"; rule {times['cuda (launch rule)']:.2f}, planes {times['triton planes']:.2f},"
                       f" bf16 {times['bf16 mm']:.2f}")
        del weights, dense
    return rows


def run(ms: list[int], shapes) -> list[dict]:
    def staged(x, weights, outs):
        calls = {}
        for shape in variants(x.shape[0], weights[0].mma[1].shape[1]):
            name = "rows {} x {} warps, unroll {}".format(*shape[:3]) + (f", {shape[3]} a SM" if shape[3] else "")
            calls[name] = [rows_call(x, w, out, *shape) for w, out in zip(weights, outs)]
        return calls
    return timed_against_the_rule(ms, shapes, staged)


def command_line(doc: str, run, default_ms: str, results_name: str) -> None:
    """The command line of this script and of the explorations built on `timed_against_the_rule`: --ms, --shapes and
    the output arguments, `run(ms, shapes)`'s rows printed as a table and written under `results_name`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", default=default_ms, help="rows of x, comma-separated")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in DECODER_SHAPES), help="N x K, comma-separated")
    add_output_arguments(parser, results_name)
    args = parser.parse_args()
    shapes = [tuple(int(size) for size in shape.split("x")) for shape in args.shapes.split(",")]
    rows = run([int(m) for m in args.ms.split(",")], shapes)
    header = ["n", "k", "m", "kernel", "us", "vs_bf16", "tb_per_s", "rel_error"]
    print(format_table([[row.get(column, "") for column in header] for row in rows], header))
    write(out_path(args, results_name), rows, machine=machine())


def main() -> None:
    command_line(__doc__, run, "16,32,64", "gpu_int4_batched_decode")


if __name__ == "__main__":
    main()
