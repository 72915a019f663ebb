"""What this machine is: the facts kernels need to say whether they can run.

`Platform` is a frozen snapshot for one device type ("cpu", "cuda", "xpu"). It is computed once
per device type and cached; tests build their own instances to exercise other machines.
`libraries` names the optional kernel libraries that are importable here (see `OPTIONAL_LIBRARIES`);
they are looked up without being imported.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass

import torch

#: torch._int_mm on CUDA refuses M <= 16 ("self.size(0) needs to be greater than 16")
CUDA_INT_MM_MIN_ROWS = 17


@dataclass(frozen=True)
class Platform:
    device_type: str  # "cpu", "cuda" (NVIDIA or ROCm), "xpu"
    is_rocm: bool = False
    cuda_capability: tuple[int, int] | None = None  # (major, minor) on NVIDIA and ROCm GPUs
    cpu_has_avx512_vnni: bool = False
    cpu_has_amx: bool = False
    cpu_has_avx512_bf16: bool = False  # bf16 dot products (AMX has its own)
    cpu_is_amd_zen: bool = False
    gpu_arch: str = ""  # ROCm: the gfx name (gfx942 is MI300); empty elsewhere
    libraries: frozenset[str] = frozenset()  # importable optional libraries, e.g. {"triton", "vllm"}, and "nvrtc"

    def has(self, library: str) -> bool:
        return library in self.libraries

    @property
    def cpu_has_int8_dot_products(self) -> bool:
        """int8 dot-product instructions (AVX-512 VNNI, AMX); without them an int8 GEMM is emulated."""
        return self.cpu_has_avx512_vnni or self.cpu_has_amx

    @property
    def cpu_has_bf16_dot_products(self) -> bool:
        """bf16 dot-product instructions (AVX-512 BF16, AMX); without them a bf16 GEMM is emulated, several times
        slower than the float32 one (docs/benchmarks.md, "int8 weight-only prefill without bf16 arithmetic")."""
        return self.cpu_has_avx512_bf16 or self.cpu_has_amx

    @property
    def capability(self) -> int:
        """Compute capability as one number (sm_90 -> 90); 0 when not a GPU."""
        if self.cuda_capability is None:
            return 0
        major, minor = self.cuda_capability
        return major * 10 + minor

    def describe(self) -> str:
        if self.device_type == "cuda":
            vendor = "ROCm" if self.is_rocm else "CUDA"
            return f"{vendor} GPU (capability {self.capability})"
        if self.device_type == "cpu":
            flags = [name for name, on in (("AMX", self.cpu_has_amx), ("AVX-512 VNNI", self.cpu_has_avx512_vnni),
                                           ("AMD Zen", self.cpu_is_amd_zen)) if on]
            return "CPU" + (f" ({', '.join(flags)})" if flags else "")
        return self.device_type.upper()


def _cpu_is_amd_zen() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            text = cpuinfo.read(65536)
    except OSError:
        return False
    family = re.search(r"^cpu family\s*:\s*(\d+)", text, re.MULTILINE)
    return "AuthenticAMD" in text and family is not None and int(family.group(1)) >= 23  # Zen is family 17h+


#: Optional libraries that kernels build on (import names): Triton, vLLM (CUTLASS, CPU fp8 GEMM),
#: AITER (ROCm), zentorch (AMD Zen CPUs), vllm-xpu-kernels (Intel GPU W4A8).
OPTIONAL_LIBRARIES = ("triton", "vllm", "aiter", "zentorch", "vllm_xpu_kernels")


def _importable_libraries() -> frozenset[str]:
    return frozenset(name for name in OPTIONAL_LIBRARIES if importlib.util.find_spec(name) is not None)


def _runtime_libraries(device_type: str) -> frozenset[str]:
    """Runtime libraries a kernel can need besides Python packages, found by loading them: "nvrtc", CUDA's
    runtime compiler (through torch's own loader), with torch's static CUDA launcher, for qfuse's CUDA C++
    kernels (`qfuse.kernels.cuda.launch`)."""
    if (device_type != "cuda" or torch.version.cuda is None or not hasattr(torch.cuda, "_compile_kernel")
            or not hasattr(torch._C, "_StaticCudaLauncher")):
        return frozenset()
    try:
        from torch.cuda._utils import _get_nvrtc_library

        _get_nvrtc_library()
    except (ImportError, OSError, RuntimeError, AttributeError):
        return frozenset()
    return frozenset({"nvrtc"})


def _rocm_arch() -> str:
    if torch.version.hip is None or not torch.cuda.is_available():
        return ""
    return torch.cuda.get_device_properties().gcnArchName.split(":")[0]


@functools.cache
def current_platform(device_type: str) -> Platform:
    """The platform of this process for `device_type`."""
    libraries = _importable_libraries()
    if device_type == "cuda":
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        return Platform("cuda", is_rocm=torch.version.hip is not None, cuda_capability=capability,
                        gpu_arch=_rocm_arch(), libraries=libraries | _runtime_libraries("cuda"))
    if device_type == "cpu":
        return Platform(
            "cpu",
            cpu_has_avx512_vnni=torch.cpu._is_vnni_supported(),
            cpu_has_amx=torch.cpu._is_amx_tile_supported(),
            cpu_has_avx512_bf16=torch.cpu._is_avx512_bf16_supported(),
            cpu_is_amd_zen=_cpu_is_amd_zen(),
            libraries=libraries,
        )
    return Platform(device_type, libraries=libraries)
