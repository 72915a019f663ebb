"""The kernel registry and the one function that chooses a kernel.

Priority lists are per platform; the first kernel that is supported on the machine, can
implement the key (its capability table, then its `can_implement`) and is not measured slower here
than a later kernel (`Kernel.why_slower_here`: a weight too small for its per-call cost, a decode
or prefill M where another GPU kernel is faster) wins; one measured slower than Inductor's own code
(`Kernel.why_inductor_is_faster`) leaves the linear to Inductor. A forced kernel skips both speed rules.
`reference` is in no list: it is slow emulation, used only when forced. Every kernel that was passed
over is returned with its reason, so debug mode can show it.

The same choice serves a static M (the passes ask `KernelRequest.choose`) and a dynamic one (the
lowerings ask `KernelRequest.choose_by_rows` once M's bucket is known): the speed rules that look at
M declare where their verdict changes (`Kernel.speed_row_bounds`), and a bucket is chosen for at its
largest M, so both ways read one set of rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from qfuse.errors import QfuseUserError
from qfuse.kernels.aiter import AiterKernel
from qfuse.kernels.base import GemmKey, Kernel
from qfuse.kernels.capabilities import table_verdict
from qfuse.kernels.cuda import CudaKernel
from qfuse.kernels.cutlass import CutlassKernel
from qfuse.kernels.onednn import OneDnnKernel
from qfuse.kernels.reference import ReferenceKernel
from qfuse.kernels.torch_native import TorchKernel
from qfuse.kernels.triton import TritonKernel
from qfuse.kernels.xpu import XpuKernel
from qfuse.kernels.zentorch import ZentorchKernel
from qfuse.platform import Platform

KERNELS: dict[str, Kernel] = {kernel.name: kernel for kernel in (
    CutlassKernel(),
    CudaKernel(),
    TritonKernel(),
    TorchKernel(),
    AiterKernel(),
    ZentorchKernel(),
    OneDnnKernel(),
    XpuKernel(),
    ReferenceKernel(),
)}

#: First kernel that can run a linear wins. Vendor kernels first, then qfuse's CUDA C++ (int4 decode under
#: CUDA graphs), Triton as the portable GPU fallback, torch last (it covers zero points and everything
#: cuBLAS / ATen can take).
PRIORITY: dict[str, tuple[str, ...]] = {
    "cpu": (ZentorchKernel.name, OneDnnKernel.name, TorchKernel.name),
    "cuda": (CutlassKernel.name, CudaKernel.name, TritonKernel.name, TorchKernel.name),
    "rocm": (AiterKernel.name, TritonKernel.name, TorchKernel.name),
    "xpu": (XpuKernel.name, TritonKernel.name),
}


class KernelUnavailableError(QfuseUserError):
    """A kernel that was asked for by name cannot run this linear."""


@dataclass(frozen=True)
class KernelChoice:
    kernel: Kernel | None
    rejected: dict[str, str] = field(default_factory=dict)  # kernel name -> why it was not used

    def rejections(self) -> str:
        """Every rejected kernel with its reason: 'onednn: ...; torch: ...' ('' when none was)."""
        return "; ".join(f"{name}: {reason}" for name, reason in self.rejected.items())


def get_kernel(name: str) -> Kernel:
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"unknown qfuse kernel {name!r}; known kernels: {sorted(KERNELS)}") from None


def priority_list(platform: Platform) -> tuple[str, ...]:
    return PRIORITY["rocm" if platform.is_rocm else platform.device_type]


def why_not_implemented(kernel: Kernel, key: GemmKey, platform: Platform) -> str:
    """Why `kernel` cannot compute `key` on `platform` (its capability table, then `can_implement`),
    or '' if it can. Whether it runs on this machine at all is `is_supported`'s question."""
    reason = table_verdict(kernel.name, kernel.capabilities, key, platform)
    if reason:
        return reason
    if key.per_call_weight and kernel.prepares_weight:
        return (f"{kernel.name} prepares (repacks) its weight once, and this weight is quantized anew on every "
                "call (a fake-quantized float weight)")
    ok, reason = kernel.can_implement(key, platform)
    return "" if ok else reason


def _verdict(kernel: Kernel, key: GemmKey, platform: Platform) -> str:
    """Why `kernel` cannot run `key` here, or '' if it can."""
    ok, reason = kernel.is_supported(platform)
    return reason if not ok else why_not_implemented(kernel, key, platform)


def choose_kernel(
    key: GemmKey,
    platform: Platform,
    *,
    forced: str | None = None,
    preference: Sequence[str] = (),
    disabled: Sequence[str] = (),
) -> KernelChoice:
    """The best kernel for `key` on `platform`, and why every other candidate was rejected.

    `forced` names the only kernel to use (raises KernelUnavailableError if it cannot run);
    `preference` replaces the platform's priority list; `disabled` kernels are skipped.
    """
    if forced is not None:
        kernel = get_kernel(forced)
        reason = _verdict(kernel, key, platform)
        if reason:
            raise KernelUnavailableError(f"forced kernel {forced!r} cannot run {key.scheme.describe()}: {reason}")
        return KernelChoice(kernel)
    rejected: dict[str, str] = {}
    slower: list[Kernel] = []  # able, but slower than a later kernel here: used only if none is left
    for name in preference or priority_list(platform):
        kernel = get_kernel(name)
        reason = "disabled by configuration" if name in disabled else _verdict(kernel, key, platform)
        reason = reason or kernel.why_inductor_is_faster(key, platform)
        if not reason and (why_slower := kernel.why_slower_here(key, platform)):
            slower.append(kernel)
            reason = why_slower
        if not reason:
            return KernelChoice(kernel, rejected)
        rejected[name] = reason
    if slower:
        del rejected[slower[0].name]
        return KernelChoice(slower[0], rejected)
    return KernelChoice(None, rejected)


@dataclass(frozen=True)
class KernelRequest:
    """One linear's question to kernel choice, kept so that it can be asked again at another M: the key
    and the configuration's constraints (`choose_kernel`'s keywords)."""

    key: GemmKey
    forced: str | None = None
    preference: tuple[str, ...] = ()
    disabled: tuple[str, ...] = ()

    def choose(self, platform: Platform, m: int | None = None) -> KernelChoice:
        """`choose_kernel` for this request, at `m` rows where given (else the key's M)."""
        key = self.key if m is None else replace(self.key, m=m)
        return choose_kernel(key, platform, forced=self.forced, preference=self.preference, disabled=self.disabled)

    def row_bounds(self, platform: Platform) -> tuple[int, ...]:
        """The ascending M bounds at which this request's choice changes kernel."""
        return self._buckets(platform)[0]

    def _buckets(self, platform: Platform) -> tuple[tuple[int, ...], dict[int, KernelChoice]]:
        """(the bounds of `row_bounds`, the choice at each step and one above the last). The steps are those
        the kernels that can run this request declare (`Kernel.speed_row_bounds`); a step with the same kernel
        on both sides is no bound (a guard there would only compile the same code twice)."""
        if self.forced is not None:
            return (), {}
        names = [name for name in self.preference or priority_list(platform) if name not in self.disabled]
        steps = sorted({bound for name in names if not _verdict(kernel := get_kernel(name), self.key, platform)
                        for bound in kernel.speed_row_bounds(self.key, platform)})
        if not steps:
            return (), {}
        above = (*steps[1:], steps[-1] + 1)
        choices = {m: self.choose(platform, m) for m in (*steps, above[-1])}
        return tuple(bound for bound, next_m in zip(steps, above)
                     if choices[bound].kernel is not choices[next_m].kernel), choices

    def choose_by_rows(self, platform: Platform, rows_at_most: Callable[[int], bool]) -> tuple[KernelChoice, str]:
        """The choice for an M known only through `rows_at_most(bound)` (a dynamic M, which the caller
        guards on each bound it is asked: so it is asked only the bounds of `row_bounds`, in turn), and
        M's bucket in words ('' where no bound matters). Each speed rule is a step at one of the bounds,
        so the bucket's largest M (one above the last step for the top bucket) stands for all of it."""
        bounds, choices = self._buckets(platform)
        if not bounds:
            return self.choose(platform), ""
        lower = 0
        for bound in bounds:
            if rows_at_most(bound):
                return choices[bound], f"M above {lower}, at most {bound}" if lower else f"M at most {bound}"
            lower = bound
        return choices[max(choices)], f"M above {lower}"
