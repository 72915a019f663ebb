"""The kernel x scheme matrix: every kernel's capability table, rendered for people.

`python -m qfuse kernels` prints, for this machine, which kernels run here, the kernel x scheme
matrix of this machine and the registry's pick for each common scheme; `--markdown` prints the part that does not depend on the
machine (every capability row, and which scheme each kernel's table takes on which device), which
docs/kernels.md holds between the `KERNEL_TABLES` markers, kept equal by a test.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from qfuse.kernels.base import GemmKey
from qfuse.kernels.capabilities import Capability
from qfuse.kernels.reference import ReferenceKernel
from qfuse.kernels.registry import KERNELS, choose_kernel, why_not_implemented
from qfuse.platform import OPTIONAL_LIBRARIES, Platform, current_platform
from qfuse.tables import format_table
from qfuse.schemes import FP8_DTYPE, INT4_DTYPE, Granularity, QuantScheme, dtype_name

G = Granularity
#: The schemes real models bring (vLLM / compressed-tensors W8A8, PT2E, DeepSeek blocks, W4A8, W8A16, W4A16).
SCHEMES: tuple[QuantScheme, ...] = (
    QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True),
    QuantScheme(torch.int8, torch.int8, G.PER_TENSOR, G.PER_TENSOR, dynamic=False),
    QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True, symmetric=False),
    QuantScheme(torch.uint8, torch.int8, G.PER_TENSOR, G.PER_CHANNEL, dynamic=False, symmetric=False),
    QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True),
    QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TENSOR, G.PER_TENSOR, dynamic=False),
    QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_GROUP, G.BLOCK, dynamic=True),
    QuantScheme(torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, dynamic=True, weight_group_size=128),
    QuantScheme.weight_only(FP8_DTYPE, G.BLOCK),
    QuantScheme.weight_only(torch.int8, G.PER_CHANNEL),
    QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, weight_group_size=128),
)
#: Machines with every capability (every package importable), for the part of the matrix that
#: depends on the tables alone: "cuda" is an NVIDIA sm_90, "rocm" an MI300 (its tensors are "cuda").
_TARGETS = {
    "cpu": Platform("cpu", libraries=frozenset(OPTIONAL_LIBRARIES)),
    "cuda": Platform("cuda", cuda_capability=(9, 0), libraries=frozenset(OPTIONAL_LIBRARIES)),
    "rocm": Platform("cuda", is_rocm=True, cuda_capability=(9, 4), gpu_arch="gfx942", libraries=frozenset(OPTIONAL_LIBRARIES)),
    "xpu": Platform("xpu", libraries=frozenset(OPTIONAL_LIBRARIES)),
}
_SIZE = 4096  # K and N of the matrix's linears: aligned for every kernel
#: The kernels in the matrix: `reference` (slow emulation, only when forced) takes everything.
MATRIX_KERNELS = tuple(name for name in KERNELS if name != ReferenceKernel.name)


def _key(scheme: QuantScheme, device: str) -> GemmKey:
    """An aligned linear of the scheme (int4 group scales in bf16, the common checkpoint dtype)."""
    scale_dtype = torch.bfloat16 if scheme.weight_dtype == INT4_DTYPE else None
    return GemmKey(scheme, n=_SIZE, k=_SIZE, out_dtype=torch.bfloat16, bias_dtype=None, device_type=device,
                   weight_scale_dtype=scale_dtype)


def _item(item) -> str:
    if isinstance(item, torch.dtype):
        return dtype_name(item)
    if isinstance(item, tuple):  # an (activation, weight) scale pair
        return " x ".join(_item(part) for part in item)
    return getattr(item, "value", item).replace("_", "-")


def _cell(value) -> str:
    """One capability column as table text."""
    if isinstance(value, tuple):
        return " / ".join(_item(item) for item in value) or "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value) if value not in ("", 0, 1) else "-"


def capability_table() -> str:
    """Every kernel's capability rows as one markdown table (the columns of `Capability`)."""
    columns = [field.name for field in fields(Capability)]
    lines = ["| kernel | " + " | ".join(column.replace("_", " ") for column in columns) + " |",
             "|---" * (len(columns) + 1) + "|"]
    for name, kernel in KERNELS.items():
        for row in kernel.capabilities:
            gpu_only = {"min_capability", "rocm"} if "cuda" not in row.devices else set()
            cells = ["-" if column in gpu_only else _cell(getattr(row, column)) for column in columns]
            lines.append(f"| {name} | " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines)


def _targets_taking(kernel_name: str, scheme: QuantScheme) -> str:
    """The targets (cpu, cuda, rocm, xpu) on which `kernel_name`'s table takes `scheme` (K = N = 4096,
    bf16 out), naming the packages it needs there."""
    rows = KERNELS[kernel_name].capabilities
    taken = []
    for target, platform in _TARGETS.items():
        key = _key(scheme, platform.device_type)
        if why_not_implemented(KERNELS[kernel_name], key, platform):
            continue
        needs = ""
        if why_not_implemented(KERNELS[kernel_name], key, replace(platform, libraries=frozenset())):
            needs = " (" + ", ".join(dict.fromkeys(package for row in rows for package in row.requires)) + ")"
        taken.append(target + needs)
    return ", ".join(taken) or "-"


def scheme_matrix() -> str:
    """Markdown: which kernel's table takes which scheme, on which device."""
    lines = ["| scheme | " + " | ".join(MATRIX_KERNELS) + " |", "|---" * (len(MATRIX_KERNELS) + 1) + "|"]
    for scheme in SCHEMES:
        lines.append(f"| {scheme.describe()} | " + " | ".join(_targets_taking(name, scheme) for name in MATRIX_KERNELS) + " |")
    return "\n".join(lines)


def markdown() -> str:
    """The machine-independent part: what docs/kernels.md holds between its KERNEL_TABLES markers."""
    return (f"Which scheme each kernel's table takes, and where (K = N = {_SIZE}, bf16 output; cuda: an NVIDIA "
            "sm_90, rocm: an MI300; a package in brackets: only with it; `reference` takes everything):\n\n"
            f"{scheme_matrix()}\n\nThe capability rows (`capabilities` of each kernel class; `-`: no limit):\n\n"
            f"{capability_table()}\n")


def this_machine(devices: tuple[str, ...]) -> str:
    """Plain text, per device type of this machine: which kernels run here, and the kernel x scheme
    matrix of this machine ('yes' where the kernel runs here and takes the scheme) with the
    registry's pick."""
    sections = []
    for device in devices:
        platform = current_platform(device)
        lines = [f"{device}: {platform.describe()}"]
        for name, kernel in KERNELS.items():
            ok, reason = kernel.is_supported(platform)
            lines.append(f"  {name:<10} {'runs here' if ok else 'not here: ' + reason}")
        rows = []
        for scheme in SCHEMES:
            key = _key(scheme, device)
            cells = ["yes" if KERNELS[name].is_supported(platform)[0] and not why_not_implemented(KERNELS[name], key, platform)
                     else "-" for name in MATRIX_KERNELS]
            choice = choose_kernel(key, platform)
            rows.append([scheme.describe(), *cells, choice.kernel.name if choice.kernel else "none (Inductor's code)"])
        lines.append(f"\n  K = N = {_SIZE}, bf16 output:")
        lines += ["  " + line for line in format_table(rows, ["scheme", *MATRIX_KERNELS, "registry's pick"]).splitlines()]
        sections.append("\n".join(lines))
    return "\n\n".join(sections)
