"""`Tile`: the block sizes and launch settings of one Triton GEMM program, as the tile tables write them.

A tile is data: each kernel module keeps its tables of measured tiles (by M bucket, by N, for
max-autotune) beside the measurement that chose them (docs/benchmarks.md has the numbers).
"""

from __future__ import annotations

from typing import NamedTuple


class Tile(NamedTuple):
    block_m: int  # output rows a program computes (at decode: the MMA's smallest M)
    block_n: int  # output columns a program computes
    block_k: int  # K elements a step of the main loop reads
    group_m: int  # row blocks that share a column block in the launch order (1: none)
    num_warps: int
    num_stages: int  # software-pipelining depth of the main loop's loads
