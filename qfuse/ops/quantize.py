"""Quantize ops: `qfuse::dynamic_quant`, `qfuse::dynamic_quant_asymmetric`, `qfuse::static_quant`,
`qfuse::silu_mul_quant`.

    dynamic_quant(x, quant_dtype, granularity, eps, kernel, scale_dtype=None) -> (q, scale)
        scale = max(amax(|x|), eps) / qmax over the tensor ([]), each token ([..., 1]) or each
        128-group of the last dim ([..., K / 128]); q = quantize(x / scale); computed in
        scale_dtype (x upcast to it exactly, as `x.float()` is written before a float32 scale)
    dynamic_quant_asymmetric(x, quant_dtype, granularity, eps, kernel) -> (q, scale, zero_point)
        int8 / uint8 with an int32 zero point, per tensor or per token
    static_quant(x, scale, zero_point, quant_dtype, kernel) -> q
    silu_mul_quant(gate, up, quant_dtype, eps, kernel, scale_dtype=None) -> (q, scale)
        dynamic_quant of silu(gate) * up per token (each rounded to up's dtype, as eager's ops
        round; gate may be float32): a Llama MLP's down-projection input, the product never written

The scale keeps x's dtype (or scale_dtype), as a model written in plain torch computes it. Exact formulas:
`qfuse.kernels.reference_math`.
"""

from __future__ import annotations

import torch

from qfuse.kernels import get_kernel
from qfuse.ops.arguments import op_arguments
from qfuse.schemes import ACTIVATION_GRANULARITIES, FP8_DTYPE, GROUP_SIZE, QUANT_DTYPES, Granularity


def _granularity(name: str, x: torch.Tensor, op: str) -> Granularity:
    try:
        granularity = Granularity(name)
    except ValueError:
        granularity = None
    if granularity not in ACTIVATION_GRANULARITIES:
        raise ValueError(
            f"qfuse::{op}: granularity must be one of {[g.value for g in ACTIVATION_GRANULARITIES]}, got {name!r}"
        )
    if not x.dtype.is_floating_point:
        raise ValueError(f"qfuse::{op}: input must be floating point, got {x.dtype}")
    if granularity == Granularity.PER_GROUP and x.shape[-1] % GROUP_SIZE != 0:
        raise ValueError(f"qfuse::{op}: per_group needs the last dim to be a multiple of {GROUP_SIZE}, got {x.shape[-1]}")
    return granularity


def _check_quant_dtype(dtype: torch.dtype, op: str, allowed=QUANT_DTYPES) -> None:
    if dtype not in allowed:
        raise ValueError(f"qfuse::{op}: quant_dtype must be one of {allowed}, got {dtype}")


def _scale_shape(x: torch.Tensor, granularity: Granularity) -> tuple:
    if granularity == Granularity.PER_TENSOR:
        return ()
    if granularity == Granularity.PER_TOKEN:
        return (*x.shape[:-1], 1)
    return (*x.shape[:-1], x.shape[-1] // GROUP_SIZE)


def _computed_dtype(x: torch.Tensor, scale_dtype: torch.dtype | None, op: str) -> torch.dtype:
    """The dtype the quantizer computes in: x's, or a wider float `scale_dtype` x is upcast to exactly."""
    if scale_dtype is None or scale_dtype == x.dtype:
        return x.dtype
    if not scale_dtype.is_floating_point or scale_dtype.itemsize <= x.dtype.itemsize:
        raise ValueError(f"qfuse::{op}: scale_dtype must be x's dtype or a wider float (an exact upcast of "
                         f"{x.dtype}), got {scale_dtype}")
    return scale_dtype


@torch.library.custom_op("qfuse::dynamic_quant", mutates_args=())
def dynamic_quant(
    x: torch.Tensor, quant_dtype: torch.dtype, granularity: str, eps: float, kernel: str,
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_quant_dtype(quant_dtype, "dynamic_quant", (torch.int8, FP8_DTYPE))
    resolved = _granularity(granularity, x, "dynamic_quant")
    q, scale = get_kernel(kernel).dynamic_quant(x.to(_computed_dtype(x, scale_dtype, "dynamic_quant")), quant_dtype,
                                                resolved, eps)
    return q, scale.reshape(_scale_shape(x, resolved))


@dynamic_quant.register_fake
def _(x, quant_dtype, granularity, eps, kernel, scale_dtype=None):
    _check_quant_dtype(quant_dtype, "dynamic_quant", (torch.int8, FP8_DTYPE))
    resolved = _granularity(granularity, x, "dynamic_quant")
    return (x.new_empty(x.shape, dtype=quant_dtype),  # contiguous, as every kernel returns it
            x.new_empty(_scale_shape(x, resolved), dtype=_computed_dtype(x, scale_dtype, "dynamic_quant")))


class DynamicQuantArgs(op_arguments(torch.ops.qfuse.dynamic_quant.default)):
    """`qfuse::dynamic_quant`'s arguments by name."""


@torch.library.custom_op("qfuse::silu_mul_quant", mutates_args=())
def silu_mul_quant(
    gate: torch.Tensor, up: torch.Tensor, quant_dtype: torch.dtype, eps: float, kernel: str,
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_silu_mul(gate, up, quant_dtype)
    return get_kernel(kernel).silu_mul_quant(gate, up, quant_dtype, eps, _computed_dtype(up, scale_dtype, "silu_mul_quant"))


@silu_mul_quant.register_fake
def _(gate, up, quant_dtype, eps, kernel, scale_dtype=None):
    _check_silu_mul(gate, up, quant_dtype)
    return (up.new_empty(up.shape, dtype=quant_dtype),
            up.new_empty((*up.shape[:-1], 1), dtype=_computed_dtype(up, scale_dtype, "silu_mul_quant")))


def _check_silu_mul(gate: torch.Tensor, up: torch.Tensor, quant_dtype: torch.dtype) -> None:
    _check_quant_dtype(quant_dtype, "silu_mul_quant", (torch.int8, FP8_DTYPE))
    if gate.shape != up.shape or not up.dtype.is_floating_point or gate.dtype not in (up.dtype, torch.float32):
        raise ValueError(f"qfuse::silu_mul_quant: gate and up must be float tensors of one shape, gate of up's dtype "
                         f"or float32, got {gate.dtype}{list(gate.shape)} and {up.dtype}{list(up.shape)}")


class SiluMulQuantArgs(op_arguments(torch.ops.qfuse.silu_mul_quant.default)):
    """`qfuse::silu_mul_quant`'s arguments by name."""


@torch.library.custom_op("qfuse::dynamic_quant_asymmetric", mutates_args=())
def dynamic_quant_asymmetric(
    x: torch.Tensor, quant_dtype: torch.dtype, granularity: str, eps: float, kernel: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_quant_dtype(quant_dtype, "dynamic_quant_asymmetric", (torch.int8, torch.uint8))
    resolved = _granularity(granularity, x, "dynamic_quant_asymmetric")
    if resolved == Granularity.PER_GROUP:
        raise ValueError("qfuse::dynamic_quant_asymmetric: per_group is not supported; use per_tensor or per_token")
    q, scale, zero_point = get_kernel(kernel).dynamic_quant_asymmetric(x, quant_dtype, resolved, eps)
    shape = _scale_shape(x, resolved)
    return q, scale.reshape(shape), zero_point.reshape(shape)


@dynamic_quant_asymmetric.register_fake
def _(x, quant_dtype, granularity, eps, kernel):
    _check_quant_dtype(quant_dtype, "dynamic_quant_asymmetric", (torch.int8, torch.uint8))
    resolved = _granularity(granularity, x, "dynamic_quant_asymmetric")
    if resolved == Granularity.PER_GROUP:
        raise ValueError("qfuse::dynamic_quant_asymmetric: per_group is not supported; use per_tensor or per_token")
    shape = _scale_shape(x, resolved)
    return torch.empty_like(x, dtype=quant_dtype), x.new_empty(shape), x.new_empty(shape, dtype=torch.int32)


def _check_static_scale(x, scale, zero_point, quant_dtype):
    if not x.dtype.is_floating_point:
        raise ValueError(f"qfuse::static_quant: input must be floating point, got {x.dtype}")
    if quant_dtype == FP8_DTYPE and zero_point is not None:
        raise ValueError("qfuse::static_quant: fp8 is symmetric; a zero point applies to int8 / uint8 only")
    for name, tensor in (("scale", scale), ("zero_point", zero_point)):
        if tensor is not None and (tensor.dim() > x.dim() or any(
            size not in (1, full) for size, full in zip(reversed(tensor.shape), reversed(x.shape))
        )):
            raise ValueError(
                f"qfuse::static_quant: {name} of shape {tuple(tensor.shape)} does not broadcast to x {tuple(x.shape)}"
            )


@torch.library.custom_op("qfuse::static_quant", mutates_args=())
def static_quant(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, quant_dtype: torch.dtype, kernel: str
) -> torch.Tensor:
    _check_quant_dtype(quant_dtype, "static_quant")
    _check_static_scale(x, scale, zero_point, quant_dtype)
    return get_kernel(kernel).static_quant(x, scale, zero_point, quant_dtype)


@static_quant.register_fake
def _(x, scale, zero_point, quant_dtype, kernel):
    _check_quant_dtype(quant_dtype, "static_quant")
    return torch.empty_like(x, dtype=quant_dtype)
