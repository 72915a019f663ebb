"""`Tile`: the block sizes and launch settings of one Triton GEMM program, as the tile tables write them.

A tile is data: each kernel module keeps its tables of measured tiles (by M bucket, by N, for
max-autotune) beside the measurement that chose them (docs/benchmarks.md has the numbers). A table chosen by
measuring on a GPU is a `GpuTable`: one table per GPU it was measured on, the running GPU's read.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import NamedTuple

import torch


class Tile(NamedTuple):
    block_m: int  # output rows a program computes (at decode: the MMA's smallest M)
    block_n: int  # output columns a program computes
    block_k: int  # K elements a step of the main loop reads
    group_m: int  # row blocks that share a column block in the launch order (1: none)
    num_warps: int
    num_stages: int  # software-pipelining depth of the main loop's loads


class GpuTable(Mapping):
    """A table of measured choices (tiles by M bucket, say) per GPU it was measured on, as data:

        PLANE_TILES = GpuTable(H100={16: Tile(...), 32: Tile(...)}, H200={...})

    `table[key]` reads the table of the GPU this process runs on (a key is a substring of its name, as torch
    gives it: "NVIDIA H100 80GB HBM3"), else the first one: the GPU its choices were first measured on. Every
    GPU's table has the same keys (the buckets), so iterating and `max(table)` need no GPU. A new GPU's
    measurements are one more keyword, its commands and numbers in docs/benchmarks.md."""

    def __init__(self, **by_gpu: Mapping):
        self.by_gpu = by_gpu
        self.first = next(iter(by_gpu.values()))
        for gpu, table in by_gpu.items():
            if list(table) != list(self.first):
                raise ValueError(f"the {gpu} table's keys {list(table)} are not the first table's {list(self.first)}")

    def gpu_of(self, device_name: str) -> str:
        """The GPU whose table applies on the device named `device_name` ('' for no GPU): the longest key in
        its name (an H200 is no H20), else the first."""
        named = [gpu for gpu in self.by_gpu if gpu in device_name]
        return max(named, key=len) if named else next(iter(self.by_gpu))

    def here(self) -> Mapping:
        """The table of the current CUDA device's GPU (the first where there is none or no table of its own)."""
        return self.by_gpu[self.gpu_of(_current_device_name())]

    def measured_here(self) -> str:
        """Which GPU's measurements apply here, in words (for a record or a debug log)."""
        name = _current_device_name()
        gpu = self.gpu_of(name)
        return f"measured on an {gpu}" + ("" if gpu in name or not name else f" (none on this {name})")

    def __getitem__(self, key):
        return self.here()[key]

    def __iter__(self):
        return iter(self.first)

    def __len__(self) -> int:
        return len(self.first)


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _current_device_name() -> str:
    """The current CUDA device's name, '' without one (the Triton interpreter on a CPU, say)."""
    if not torch.cuda.is_available():
        return ""
    return _device_name(torch.cuda.current_device())
