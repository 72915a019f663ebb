"""Compiling and launching qfuse's CUDA C++ kernels.

NVRTC compiles a kernel's source (with the shared `common.cuh` in front) to a cubin at first use, for the
device's architecture; the driver loads it and the launch goes through Inductor's static CUDA launcher
(`torch._C._StaticCudaLauncher`, the C++ launcher Inductor runs its Triton kernels with): the arguments are
read in C++ by their type codes, with no Python per argument. torch.cuda's own `_compile_kernel` launcher
builds a ctypes array a call, about ten times the host time (docs/benchmarks.md, "The CUDA kernels without
CUDA graphs"), which is all of a decode kernel's GPU time again.

Kernel choice takes these kernels where the platform has both ("nvrtc" among its runtime libraries,
`qfuse.platform`). A launch is 1-D: `blocks` blocks of `warps` warps, with the kernel's dynamic shared memory
(fixed when it is compiled; the launcher raises the kernel's limit above 48 KiB where it asks for more), on the
current stream of the tensors' device (so a CUDA graph capture records it).
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

COMMON = Path(__file__).with_name("common.cuh")  # what qfuse's CUDA kernels share, prepended to each source


@dataclass(frozen=True)
class CompiledKernel:
    """One compiled kernel, loaded on one device."""

    function: int  # the driver's CUfunction
    #: the static launcher's code for each argument: 'O' a tensor (its address), 'i' an int32
    argument_types: str
    shared_bytes: int = 0  # dynamic shared memory a block

    def launch(self, blocks: int, warps: int, arguments: tuple, device: torch.device) -> None:
        current = torch._C._cuda_getDevice()  # (CUDA is initialised: the arguments are CUDA tensors)
        index = current if device.index is None else device.index
        if index != current:  # the module was loaded in the device's context
            with torch.cuda.device(index):
                return self.launch(blocks, warps, arguments, device)
        torch._C._StaticCudaLauncher._launch_kernel(self.function, blocks, 1, 1, warps, self.shared_bytes,
                                                     self.argument_types, arguments,
                                                     torch._C._cuda_getCurrentRawStream(index))


@functools.cache
def compiled(source: Path, name: str, options: tuple[str, ...], argument_types: str, device_index: int,
             shared_bytes: int = 0, architecture: str | None = None) -> CompiledKernel:
    """The kernel `name` of `source`, compiled with `options` (NVRTC's -D switches) for the device (or for
    `architecture`, "90a" say: Hopper's wgmma needs the arch-specific target), once, launched with `shared_bytes` of
    dynamic shared memory a block."""
    from torch.cuda._utils import _nvrtc_compile

    with torch.cuda.device(device_index):  # compiled for its architecture, loaded into its context
        cubin, lowered_name = _nvrtc_compile(COMMON.read_text() + source.read_text(), name,
                                             compute_capability=architecture, nvcc_options=list(options))
        descriptor, path = tempfile.mkstemp(suffix=".cubin", prefix=f"qfuse_{name}_")
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(cubin)
            loaded = torch._C._StaticCudaLauncher._load_kernel(path, lowered_name or name, shared_bytes,
                                                                 device_index)
        finally:
            os.unlink(path)
    # (function, registers, spills), or (module, function, registers, spills) in later torch
    return CompiledKernel(int(loaded[-3]), argument_types, shared_bytes)
