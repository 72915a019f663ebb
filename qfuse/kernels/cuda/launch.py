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

While a CUDA graph is captured on Hopper or later, a kernel that waits for the kernel before it
(`wait_for_the_previous_kernel` in `common.cuh`, first thing) is launched with programmatic stream serialization
(`cuLaunchKernelEx` through ctypes: the static launcher takes no launch attributes): its blocks may start while the
kernel before ends, and a kernel of Inductor's compiled with `triton.enable_pdl` lets it start before its stores
(docs/benchmarks.md, "Programmatic dependent launch"). Outside a capture the static launcher runs it: ctypes'
host time a call would cost more than a decode step in default mode saves.
"""

from __future__ import annotations

import ctypes
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
    #: it waits for the kernel before it, on a device with programmatic dependent launch (sm_90 on)
    programmatic: bool = False

    def launch(self, blocks: int, warps: int, arguments: tuple, device: torch.device) -> None:
        current = torch._C._cuda_getDevice()  # (CUDA is initialised: the arguments are CUDA tensors)
        index = current if device.index is None else device.index
        if index != current:  # the module was loaded in the device's context
            with torch.cuda.device(index):
                return self.launch(blocks, warps, arguments, device)
        stream = torch._C._cuda_getCurrentRawStream(index)
        if self.programmatic and torch._C._cuda_isCurrentStreamCapturing():
            return launch_programmatic(self, blocks, warps, arguments, stream)
        torch._C._StaticCudaLauncher._launch_kernel(self.function, blocks, 1, 1, warps, self.shared_bytes,
                                                     self.argument_types, arguments, stream)


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id and a 64-byte union of values
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_LaunchAttribute)),
                ("attribute_count", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PARAMETER_TYPES = {"i": ctypes.c_int32, "l": ctypes.c_int64, "f": ctypes.c_float}


@functools.cache
def _driver() -> ctypes.CDLL:
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return driver


def _parameter(code: str, value) -> ctypes._SimpleCData:
    if code == "O":
        return ctypes.c_void_p(0 if value is None else value.data_ptr())
    return _PARAMETER_TYPES[code](value)


def launch_programmatic(kernel: CompiledKernel, blocks: int, warps: int, arguments: tuple, stream: int) -> None:
    """`kernel` on `stream` with programmatic stream serialization: its blocks may start before the kernel before it
    has ended (it must wait for it before it reads or writes what that kernel touches)."""
    parameters = [_parameter(code, value) for code, value in zip(kernel.argument_types, arguments, strict=True)]
    addresses = (ctypes.c_void_p * len(parameters))(*(ctypes.addressof(parameter) for parameter in parameters))
    allowed = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION, b"", (1).to_bytes(4, "little"))
    config = _LaunchConfig((blocks, 1, 1), (32 * warps, 1, 1), kernel.shared_bytes, stream, ctypes.pointer(allowed), 1)
    if error := _driver().cuLaunchKernelEx(ctypes.byref(config), kernel.function, addresses, None):
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {error}")


@functools.cache
def compiled(source: Path, name: str, options: tuple[str, ...], argument_types: str, device_index: int,
             shared_bytes: int = 0, architecture: str | None = None,
             waits_for_the_previous_kernel: bool = False) -> CompiledKernel:
    """The kernel `name` of `source`, compiled with `options` (NVRTC's -D switches) for the device (or for
    `architecture`, "90a" say: Hopper's wgmma needs the arch-specific target), once, launched with `shared_bytes` of
    dynamic shared memory a block; programmatically (under a capture) where it `waits_for_the_previous_kernel` before
    it touches memory and the device has programmatic dependent launch."""
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
    major = int(architecture.rstrip("af")) // 10 if architecture else torch.cuda.get_device_capability(device_index)[0]
    programmatic = waits_for_the_previous_kernel and major >= 9 and _driver_captures_programmatic_launches()
    return CompiledKernel(int(loaded[-3]), argument_types, shared_bytes, programmatic)


@functools.cache
def _driver_captures_programmatic_launches() -> bool:
    """Whether the driver keeps programmatic launches in a captured graph (CUDA 12.3 on)."""
    version = ctypes.c_int()
    return _driver().cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value >= 12030
