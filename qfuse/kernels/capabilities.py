"""What a kernel computes, as data: its capability table, and the one check that reads it.

Each kernel declares `capabilities`, a tuple of `Capability` rows. A row is one combination of
activation and weight dtypes the kernel computes (its "label"), with the limits of that
combination in columns: devices, scale granularities, static / dynamic activation scales, zero
points, weight groups, K / N alignment, output and bias dtypes, the minimum NVIDIA compute
capability, whether it also runs on ROCm, and the packages it needs. Weight-only (a float
activation) and int4 weights are no special cases: they are dtypes in the dtype columns.
A row can also decline a combination on purpose (`declined`, with the reason, e.g. a measured
slowdown), so that the reason reaches the user instead of "not implemented".

`table_verdict(name, rows, key, platform)` is the check: the rows for the key's device and dtypes
are looked up; a key passes if one of them accepts every column; otherwise the reason is the first
failing column of the row that came furthest (of each, on a tie), or, when no row has the key's
device or dtypes, what the kernel does take. A new scheme field is one new column here and one value in each kernel's rows; what a
table cannot say (none today but a warning) stays in the kernel's `can_implement`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qfuse.platform import Platform
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, Granularity, dtype_name

G = Granularity
#: `Capability.bias_dtypes` value: the bias must have the output's dtype.
SAME_AS_OUTPUT = "output"
DYNAMIC, STATIC = "dynamic", "static"


@dataclass(frozen=True)
class Capability:
    """One row of a kernel's capability table (see the module docstring).

    A default is the common case of today's kernels. A column added for a new scheme field must
    default to the value that no kernel took before the field existed (what a kernel that has not
    thought about it cannot compute), so that no kernel accepts the new field without saying so."""

    label: str  # what this row computes, e.g. "fp8 W8A8 via ATen"
    devices: tuple[str, ...]  # the tensors' device type: "cpu", "cuda" (NVIDIA and ROCm), "xpu"
    activation_dtypes: tuple[torch.dtype, ...]  # quantized (int8 / uint8 / fp8), or float: weight-only
    weight_dtypes: tuple[torch.dtype, ...]  # int8, fp8, int4
    activation_scales: tuple[Granularity, ...] = (G.PER_TENSOR, G.PER_TOKEN)
    weight_scales: tuple[Granularity, ...] = (G.PER_TENSOR, G.PER_CHANNEL)
    scale_pairs: tuple[tuple[Granularity, Granularity], ...] = ()  # not empty: only these (activation, weight) pairs
    activation_scale_kinds: tuple[str, ...] = (DYNAMIC, STATIC)
    activation_zero_point: bool = False  # asymmetric activations
    weight_zero_point: bool = False
    weight_group_multiple: int = 1  # per-group weight scales: the group size is a multiple of this
    k_multiple: int = 1  # > 1: K must be static and a multiple of this
    n_multiple: int = 1
    out_dtypes: tuple[torch.dtype, ...] = FLOAT_ACTIVATION_DTYPES
    bias_dtypes: tuple[torch.dtype, ...] | str = FLOAT_ACTIVATION_DTYPES  # or SAME_AS_OUTPUT
    min_capability: int = 0  # NVIDIA compute capability as one number (89 = sm_89); ROCm is not held to it
    rocm: bool = True  # for "cuda" rows: also runs on ROCm GPUs
    #: the tensor cores sum the products below float32's precision (Hopper's fp8 MMA, measured on an H200: 1.3e-4 to
    #: 4.5e-4 of the result at K = 64 to 4096, cuBLASLt's default included): not for a linear written as a float32 GEMM
    sums_below_float32: bool = False
    requires: tuple[str, ...] = ()  # packages that must be importable, or runtime libraries found (`Platform.libraries`)
    declined: str = ""  # not empty: the kernel declines this combination, for this reason

    @property
    def is_weight_only(self) -> bool:
        return all(dtype in FLOAT_ACTIVATION_DTYPES for dtype in self.activation_dtypes)

    def dtypes(self) -> str:
        """'int8 x int8', 'bf16 x fp8 (weight-only)'."""
        pair = f"{_names(self.activation_dtypes)} x {_names(self.weight_dtypes)}"
        return pair + (" (weight-only)" if self.is_weight_only else "")

    def column_reasons(self, key, platform: Platform) -> list[str]:
        """Why this row cannot run `key` (a `GemmKey`) on `platform`: one entry per column, in the
        order of the table ('' where the column accepts the key). Each reason is a predicate that
        follows the row's label ("needs ...", "takes ..."), except `declined`, which stands alone."""
        scheme = key.scheme
        missing = [package for package in self.requires if not platform.has(package)]
        nvidia, rocm = key.device_type == "cuda" and not platform.is_rocm, key.device_type == "cuda" and platform.is_rocm
        pair = (scheme.activation_granularity, scheme.weight_granularity)
        return [
            self.declined,
            f"needs {', '.join(missing)} (not importable)" if missing else "",
            "does not run on ROCm GPUs" if rocm and not self.rocm else "",
            f"needs compute capability >= {self.min_capability} (this GPU: {platform.capability})"
            if nvidia and platform.capability < self.min_capability else "",
            "" if scheme.activation_granularity in self.activation_scales else
            f"takes {_values(self.activation_scales)} activation scales, not {_value(scheme.activation_granularity)}",
            "" if scheme.weight_granularity in self.weight_scales else
            f"takes {_values(self.weight_scales)} weight scales, not {_value(scheme.weight_granularity)}",
            "" if not self.scale_pairs or pair in self.scale_pairs else
            f"takes {' or '.join(_pair(option) for option in self.scale_pairs)} scales, not {_pair(pair)}",
            "" if (DYNAMIC if scheme.dynamic else STATIC) in self.activation_scale_kinds else
            f"takes {' or '.join(self.activation_scale_kinds)} activation scales only",
            "takes no activation zero point (asymmetric activations)"
            if not scheme.symmetric and not self.activation_zero_point else "",
            "takes symmetric weights only (this weight has a zero point)"
            if key.weight_zero_point and not self.weight_zero_point else "",
            self._group_reason(key),
            "" if _multiple(key.k, self.k_multiple) and _multiple(key.n, self.n_multiple) else
            f"needs {self._alignment()} (K={key.k}, N={key.n})",
            "" if key.out_dtype in self.out_dtypes else f"writes {_names(self.out_dtypes)}, not {dtype_name(key.out_dtype)}",
            "sums the products below float32's precision (the tensor cores' fp8 accumulator), coarser than the float32 "
            "GEMM the linear is written as" if self.sums_below_float32 and key.out_dtype == torch.float32
            and key.float_gemm_as_written else "",
            self._bias_reason(key),
        ]

    def _alignment(self) -> str:
        if self.k_multiple == self.n_multiple:
            return f"static K and N that are multiples of {self.k_multiple}"
        sizes = [f"{name} a multiple of {multiple}" for name, multiple in (("K", self.k_multiple), ("N", self.n_multiple))
                 if multiple > 1]
        return "static " + " and ".join(sizes)

    def _group_reason(self, key) -> str:
        group = key.scheme.weight_group_size
        if group is not None and group % self.weight_group_multiple:
            return f"needs a weight group size that is a multiple of {self.weight_group_multiple}, got {group}"
        if group is not None and key.k is not None and key.k % group:
            return f"needs a weight group size that divides K (group {group}, K={key.k})"
        return ""

    def _bias_reason(self, key) -> str:
        if key.bias_dtype is None:
            return ""
        if self.bias_dtypes == SAME_AS_OUTPUT:
            if key.bias_dtype == key.out_dtype:
                return ""
            return (f"adds a bias of the output dtype only "
                    f"(bias {dtype_name(key.bias_dtype)}, output {dtype_name(key.out_dtype)})")
        if key.bias_dtype in self.bias_dtypes:
            return ""
        return f"adds a {_names(self.bias_dtypes)} bias, not {dtype_name(key.bias_dtype)}"


def _names(dtypes) -> str:
    return " / ".join(dtype_name(dtype) for dtype in dtypes)


def _value(granularity: Granularity) -> str:
    return granularity.value.replace("_", "-")


def _values(granularities) -> str:
    return " / ".join(_value(granularity) for granularity in granularities)


def _pair(pair: tuple[Granularity, Granularity]) -> str:
    return f"{_value(pair[0])} x {_value(pair[1])}"


def _multiple(size: int | None, factor: int) -> bool:
    return factor == 1 or (size is not None and size % factor == 0)


def table_verdict(name: str, rows: tuple[Capability, ...], key, platform: Platform) -> str:
    """Why kernel `name`, whose table is `rows`, cannot run `key` on `platform`; '' if it can."""
    on_device = [row for row in rows if key.device_type in row.devices]
    if not on_device:
        devices = sorted({device for row in rows for device in row.devices})
        return f"{name} takes {' / '.join(devices)} tensors, not {key.device_type}"
    scheme = key.scheme
    matching = [row for row in on_device
                if scheme.activation_dtype in row.activation_dtypes and scheme.weight_dtype in row.weight_dtypes]
    if not matching:
        wanted = f"{dtype_name(scheme.activation_dtype)} x {dtype_name(scheme.weight_dtype)}"
        wanted += " (weight-only)" if scheme.is_weight_only else ""
        offered = ", ".join(dict.fromkeys(row.dtypes() for row in on_device if not row.declined))
        return f"{name} computes {offered or 'nothing'} on {key.device_type}, not {wanted}"
    # The rows that came furthest (accepted the most columns before one failed) say why; rows that
    # failed the same column for the same reason say it once, with their labels joined.
    furthest, reasons = -1, {}
    for row in matching:
        columns = row.column_reasons(key, platform)
        failed = next((position for position, reason in enumerate(columns) if reason), len(columns))
        if failed == len(columns):
            return ""
        if failed > furthest:
            furthest, reasons = failed, {}
        if failed == furthest:
            reasons.setdefault(columns[failed], []).append(row)
    return "; ".join(reason if rows[0].declined else f"{' and '.join(row.label for row in rows)}: {reason}"
                     if len(rows) > 1 else f"{rows[0].label} {reason}" for reason, rows in reasons.items())
