"""GEMM / quant backends and the registry that picks among them (see `base.Kernel`)."""

from qfuse.kernels.base import GemmKey, Kernel
from qfuse.kernels.registry import (
    KERNELS,
    KernelChoice,
    KernelRequest,
    KernelUnavailableError,
    choose_kernel,
    get_kernel,
    why_not_implemented,
)

__all__ = ["GemmKey", "Kernel", "KERNELS", "KernelChoice", "KernelRequest", "KernelUnavailableError", "choose_kernel", "get_kernel",
           "why_not_implemented"]
