"""The CUDA W4A16 decode kernel with x staged once by persistent blocks, at 1-64 rows (an exploration, issue #38).

    python benchmarks/explorations/int4_persistent_decode.py [--ms 1,16,32] [--shapes 28672x4096,...] [--out F.json]

At 16 rows and more every warp of the launch rule's kernel (`qfuse_int4_mma`: a block a 16-row tile, its warps
splitting K) loads x's rows for every chunk of its weight through L1, and each block reads all of x from the L2:
those loads, not the weight's stream, bound it (docs/benchmarks.md, "Why the int4 kernel stops at 2.2x bf16 at 16
rows"). `qfuse_int4_mma_persistent` (int4_mma_persistent.cu) keeps a few blocks a multiprocessor resident, each
copying its slice of x's K into shared memory once and streaming many tiles through it. GPU µs per linear in one
CUDA graph over weights past the L2 (best of three rounds in turns) and each call's relative error against the
float product, beside the launch rule, the nibble-plane template, tinygemm and the bf16 matmul
(`int4_batched_decode.timed_against_the_rule`).
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from int4_batched_decode import command_line, timed_against_the_rule  # noqa: E402

from gpu_int4_mma import GROUP  # noqa: E402
from qfuse.kernels.cuda import int4_mma, launch  # noqa: E402
from qfuse.kernels.triton.scaled_mm import multiprocessors  # noqa: E402

MOST_SHARED = 227 * 2**10  # a block's shared memory on Hopper
PERSISTENT_SOURCE = Path(__file__).with_name("int4_mma_persistent.cu")
ARGUMENT_TYPES = "OOOOOOOiiii"  # words, x, pairs, bias, out, workspace, counters; M, N, K, has_bias


@functools.cache
def persistent_source() -> Path:
    """int4_mma.cu's helpers (its text up to `multiply_tile`) followed by int4_mma_persistent.cu, in one file."""
    helpers = int4_mma.SOURCE.read_text().split("// The block's 16-row tile on `lane`'s weight")[0]
    path = Path(tempfile.mkdtemp()) / "int4_mma_persistent_full.cu"
    path.write_text(helpers + PERSISTENT_SOURCE.read_text())
    return path


def shared_bytes(m: int, warps: int, slice_chunks: int) -> int:
    """x's staged rows (M of them, 16 bytes of padding a row) and the warps' partial sums."""
    m_tiles = int4_mma.column_tiles(m)
    return min(m, 8 * m_tiles) * (8 * slice_chunks + 1) * 16 + warps * 32 * 4 * m_tiles * 4


def sliced(chunks: int, slices: int) -> int:
    """Chunks a slice of K: a whole number of groups (the kernel reads a group's scales from its first chunk; the
    first run had slices of 75 chunks on g128, and their results were wrong)."""
    group_chunks = GROUP // int4_mma.K_PER_CHUNK
    return math.ceil(chunks / slices / group_chunks) * group_chunks


def variants(m: int, k: int) -> list[dict]:
    """Launch settings tried: warps a block, warps a group (splitting a tile's slice), chunks ahead, blocks a
    multiprocessor, slices of K (the fewest whose x fits, and twice as many)."""
    chunks = k // int4_mma.K_PER_CHUNK
    tried = []
    for warps, group_warps, unroll, blocks_per_sm in itertools.product((32, 16), (2, 4, 8), (4, 8), (1, 2)):
        if warps * blocks_per_sm > 32 or warps == 16 and blocks_per_sm == 1 or warps // group_warps > 15:
            continue  # (15 named barriers a block: one a group)
        fewest = next(s for s in range(1, chunks + 1)
                      if shared_bytes(m, warps, sliced(chunks, s)) <= MOST_SHARED // blocks_per_sm)
        for slices in (fewest, 2 * fewest):
            slice_chunks = sliced(chunks, slices)
            if slice_chunks // group_warps >= unroll:
                tried.append(dict(warps=warps, group_warps=group_warps, unroll=unroll, blocks_per_sm=blocks_per_sm,
                                  slices=slices, slice_chunks=slice_chunks))
    return tried


class Scratch:
    """The float32 workspace of the slices' sums and the tiles' counters (zero between launches), one a shape."""

    def __init__(self, m: int, n: int, slices: int):
        self.workspace = torch.empty(slices * n // 16 * 32 * 4 * int4_mma.column_tiles(m), device="cuda")
        self.counters = torch.zeros(n // 16, device="cuda", dtype=torch.int32)


def persistent_call(x, weight, out, scratch: Scratch, setting: dict):
    m, k = x.shape
    words, pairs = weight.mma
    n = pairs.shape[1]
    options = (f"-DM_TILES={int4_mma.column_tiles(m)}", f"-DWARPS={setting['warps']}",
               f"-DGROUP_WARPS={setting['group_warps']}", f"-DUNROLL={setting['unroll']}",
               f"-DBLOCKS_PER_SM={setting['blocks_per_sm']}", f"-DSLICES={setting['slices']}",
               f"-DSLICE_CHUNKS={setting['slice_chunks']}", f"-DGROUP_SHIFT={int4_mma.group_shift(k, GROUP)}",
               "-DHALF_BF16")
    kernel = launch.compiled(persistent_source(), "qfuse_int4_mma_persistent", options, ARGUMENT_TYPES, 0,
                             shared_bytes(m, setting["warps"], setting["slice_chunks"]))
    blocks = multiprocessors(x.device) * setting["blocks_per_sm"] // setting["slices"] * setting["slices"]
    arguments = (words, x, pairs, pairs, out, scratch.workspace, scratch.counters, m, n, k, 0)
    return lambda: kernel.launch(blocks, setting["warps"], arguments, x.device)


def name_of(setting: dict) -> str:
    return ("persistent {warps} warps / {group_warps}, unroll {unroll}, {blocks_per_sm} a SM, {slices} slices"
            .format(**setting))


def run(ms: list[int], shapes) -> list[dict]:
    def persistent(x, weights, outs):
        n = weights[0].mma[1].shape[1]
        calls = {}
        for setting in variants(x.shape[0], x.shape[1]):
            scratch = Scratch(x.shape[0], n, setting["slices"])
            calls[name_of(setting)] = [persistent_call(x, w, out, scratch, setting) for w, out in zip(weights, outs)]
        return calls
    return timed_against_the_rule(ms, shapes, persistent, tinygemm=False)


def main() -> None:
    command_line(__doc__, run, "1,16,32", "gpu_int4_persistent_decode")


if __name__ == "__main__":
    main()
