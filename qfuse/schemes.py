"""The data model: what a quantized linear is, as a frozen value.

A `QuantScheme` is the key that patterns, ops and kernels share. It says which dtype the
activation and the weight are quantized to, how fine their scales are, whether the activation
scale is computed at run time (dynamic) or fixed (static), and whether the activation carries a
zero point (asymmetric).

Supported granularities:

    role        granularity   scale shape (for an activation [M, K], weight [K, N])
    ----------  ------------  ---------------------------------------------------
    activation  PER_TENSOR    one value
    activation  PER_TOKEN     [M, 1]
    activation  PER_GROUP     [M, K / 128]        (1 x 128 groups along K)
    weight      PER_TENSOR    one value
    weight      PER_CHANNEL   [N]
    weight      BLOCK         [K / 128, N / 128]  (128 x 128 blocks)
    weight      PER_GROUP     [K / g, N]          (g x 1 groups along K; int4 weights only,
                                                   g = weight_group_size)

int4 weights (`INT4_DTYPE`, W4A8) are a marker: the tensors hold the values [-8, 7] unpacked in
int8 until a kernel packs them (`qfuse.kernels.int4_words.pack_int4`).

Weight-only schemes (W8A16): an activation dtype that is a float dtype (bf16, fp16, fp32) means the
activation is not quantized; only the int8 or fp8 weight is. Such a scheme has no activation scale,
so its activation fields are fixed (per-tensor, static, symmetric); `QuantScheme.weight_only` builds
one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
QUANT_DTYPES = (torch.int8, torch.uint8, FP8_DTYPE)
INT4_DTYPE = torch.int4  # a weight dtype only; torch has no int4 tensors, the values live in int8
INT4_OFFSET = 8  # an int4 value v stored as an unsigned nibble is v + 8 (GPTQ, compressed-tensors, oneDNN)
WEIGHT_DTYPES = (*QUANT_DTYPES, INT4_DTYPE)
#: Activation dtypes of a weight-only scheme (the activation stays in this float dtype), and its weights.
FLOAT_ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WEIGHT_ONLY_DTYPES = (torch.int8, FP8_DTYPE)
GROUP_SIZE = 128


class Granularity(str, enum.Enum):
    PER_TENSOR = "per_tensor"
    PER_TOKEN = "per_token"
    PER_GROUP = "per_group"
    PER_CHANNEL = "per_channel"
    BLOCK = "block"


ACTIVATION_GRANULARITIES = (Granularity.PER_TENSOR, Granularity.PER_TOKEN, Granularity.PER_GROUP)
WEIGHT_GRANULARITIES = (Granularity.PER_TENSOR, Granularity.PER_CHANNEL, Granularity.BLOCK, Granularity.PER_GROUP)


def quant_range(dtype: torch.dtype) -> tuple[float, float]:
    """The representable range [qmin, qmax] of a quantized dtype."""
    if dtype == FP8_DTYPE:
        info = torch.finfo(dtype)
        return float(info.min), float(info.max)
    if dtype in (torch.int8, torch.uint8):
        info = torch.iinfo(dtype)
        return float(info.min), float(info.max)
    if dtype == INT4_DTYPE:
        return -8.0, 7.0
    raise ValueError(f"{dtype} is not a quantized dtype; expected one of {WEIGHT_DTYPES}")


def symmetric_quant_max(dtype: torch.dtype) -> float:
    """The divisor of a symmetric scale: amax / qmax maps the largest |x| onto qmax."""
    if dtype == torch.uint8:
        raise ValueError("uint8 has no symmetric range; use an asymmetric scheme")
    return quant_range(dtype)[1]


_DTYPE_NAMES = {torch.int8: "int8", torch.uint8: "uint8", FP8_DTYPE: "fp8", INT4_DTYPE: "int4",
                torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


@dataclass(frozen=True)
class QuantScheme:
    """How the activation and the weight of one linear are quantized."""

    activation_dtype: torch.dtype
    weight_dtype: torch.dtype
    activation_granularity: Granularity
    weight_granularity: Granularity
    dynamic: bool
    symmetric: bool = True
    weight_group_size: int | None = None  # g of a PER_GROUP weight scale; None otherwise

    def __post_init__(self) -> None:
        for name in ("activation_granularity", "weight_granularity"):
            try:
                object.__setattr__(self, name, Granularity(getattr(self, name)))
            except ValueError:
                raise ValueError(f"{name} {getattr(self, name)!r} is not one of {[g.value for g in Granularity]}") from None
        for role, dtype, allowed in (("activation", self.activation_dtype, QUANT_DTYPES + FLOAT_ACTIVATION_DTYPES),
                                     ("weight", self.weight_dtype, WEIGHT_DTYPES)):
            if dtype not in allowed:
                raise ValueError(f"{role} dtype {dtype} is not supported; expected one of {allowed}")
        if self.activation_granularity not in ACTIVATION_GRANULARITIES:
            raise ValueError(
                f"activation granularity {self.activation_granularity} is not one of "
                f"{[g.value for g in ACTIVATION_GRANULARITIES]}"
            )
        if self.weight_granularity not in WEIGHT_GRANULARITIES:
            raise ValueError(
                f"weight granularity {self.weight_granularity} is not one of "
                f"{[g.value for g in WEIGHT_GRANULARITIES]}"
            )
        if self.weight_dtype == torch.uint8:
            raise ValueError("uint8 weights are not supported; weights are symmetric int8 or fp8")
        if self.is_weight_only:
            self._check_weight_only()
            return
        if (self.activation_dtype == FP8_DTYPE) != (self.weight_dtype == FP8_DTYPE):
            raise ValueError("activation and weight must both be fp8 or both be integer")
        if self.activation_dtype == FP8_DTYPE and not self.symmetric:
            raise ValueError("fp8 activations are symmetric only")
        if self.activation_dtype == torch.uint8 and self.symmetric:
            raise ValueError("uint8 activations need a zero point (symmetric=False)")
        self._check_weight_groups()

    def _check_weight_groups(self) -> None:
        grouped = self.weight_granularity == Granularity.PER_GROUP
        if grouped and self.weight_dtype != INT4_DTYPE:
            raise ValueError("per-group weight scales are supported for int4 weights only")
        if grouped != (self.weight_group_size is not None):
            raise ValueError("weight_group_size is required by, and only allowed with, per-group weight scales")
        if grouped and (not isinstance(self.weight_group_size, int) or self.weight_group_size <= 0):
            raise ValueError(f"weight_group_size must be a positive int, got {self.weight_group_size!r}")

    def _check_weight_only(self) -> None:
        if self.weight_dtype not in (*WEIGHT_ONLY_DTYPES, INT4_DTYPE):
            raise ValueError(f"weight-only schemes take {(*WEIGHT_ONLY_DTYPES, INT4_DTYPE)} weights, not {self.weight_dtype}")
        self._check_weight_groups()
        if (self.activation_granularity, self.dynamic, self.symmetric) != (Granularity.PER_TENSOR, False, True):
            raise ValueError(
                f"a weight-only scheme ({self.activation_dtype} activation, not quantized) has no activation "
                "scale: use activation_granularity=per_tensor, dynamic=False, symmetric=True "
                "(QuantScheme.weight_only builds one)"
            )

    @classmethod
    def weight_only(
        cls, weight_dtype: torch.dtype, weight_granularity: Granularity, activation_dtype: torch.dtype = torch.bfloat16,
        weight_group_size: int | None = None,
    ) -> QuantScheme:
        """A scheme whose weight is quantized and whose activation stays in `activation_dtype` (W8A16,
        W4A16 with `weight_group_size` for per-group int4)."""
        return cls(activation_dtype, weight_dtype, Granularity.PER_TENSOR, weight_granularity, dynamic=False,
                   weight_group_size=weight_group_size)

    @property
    def is_weight_only(self) -> bool:
        """The activation is not quantized (a float activation dtype): only the weight carries a scale."""
        return self.activation_dtype in FLOAT_ACTIVATION_DTYPES

    @property
    def is_fp8(self) -> bool:
        """The weight (and the activation, unless weight-only) is fp8."""
        return self.weight_dtype == FP8_DTYPE

    def describe(self) -> str:
        """A short label such as 'int8 dyn-token x per-channel' or 'bf16 x fp8 block (weight-only)'."""
        if self.is_weight_only:
            return (f"{dtype_name(self.activation_dtype)} x {dtype_name(self.weight_dtype)} "
                    f"{self.weight_granularity.value.replace('_', '-')} (weight-only)")
        kind = "dyn" if self.dynamic else "static"
        act = self.activation_granularity.value.removeprefix("per_")
        asym = " asym" if not self.symmetric else ""
        weight = self.weight_granularity.value.replace("_", "-")
        if self.weight_group_size is not None:
            weight += f"-{self.weight_group_size}"
        if self.weight_dtype == INT4_DTYPE:
            weight = f"int4 {weight}"
        return f"{dtype_name(self.activation_dtype)} {kind}-{act}{asym} x {weight}"
