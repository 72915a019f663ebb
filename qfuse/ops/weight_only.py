"""`qfuse::weight_only_scaled_mm`: a linear whose weight is quantized and whose activation is not (W8A16).

    weight_only_scaled_mm(x, b, scale_b, bias, azp_b, out_dtype, kernel)
        = x @ ((b - azp_b) * scale_b) + bias, cast to out_dtype

Operands: `x` float [..., K] (bf16, fp16 or fp32; the output is [..., N]); `b` the int8 or fp8 weight
as a [K, N] matrix, any strides (usually `w.t()` of a stored [N, K]); `scale_b` one value, [N] /
[1, N], or one per 128x128 block [ceil(K/128), ceil(N/128)] (the fp8 block-quantized checkpoints);
`bias` [N]; `azp_b` an integer zero point of an int8 weight, one value or one per output channel
(PT2E's weight-only dequantize carries one, usually all zeros). `kernel` names the registry kernel
chosen for a weight-only `GemmKey` (`QuantScheme.weight_only`); it runs `Kernel.weight_only_apply`
on its prepared form of the weight, made once per weight (`qfuse.kernels.prepared`).

A separate op because `qfuse::scaled_mm` takes a quantized activation with its scale and zero point,
and `qfuse::quant_scaled_mm` quantizes a float one: here nothing quantizes the activation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qfuse.ops.arguments import op_arguments
from qfuse.ops.scaled_mm import OUT_DTYPES, _normalize_scale_b, _normalize_zero_point, _output_shape, prepared_kernel
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, WEIGHT_ONLY_DTYPES

_OP = "weight_only_scaled_mm"


def check_operands(x, b, bias, azp_b, out_dtype) -> tuple:
    """The output shape, after checking dtypes and shapes (ValueError naming the problem)."""
    if x.dtype not in FLOAT_ACTIVATION_DTYPES:
        raise ValueError(f"qfuse::{_OP}: activation must be one of {FLOAT_ACTIVATION_DTYPES}, got {x.dtype}")
    if b.dtype not in WEIGHT_ONLY_DTYPES:
        raise ValueError(f"qfuse::{_OP}: weight must be one of {WEIGHT_ONLY_DTYPES}, got {b.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"qfuse::{_OP}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if azp_b is not None and b.dtype != torch.int8:
        raise ValueError(f"qfuse::{_OP}: a weight zero point (azp_b) applies to int8 weights only, not {b.dtype}")
    out_shape = _output_shape(x, b, _OP)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != b.shape[1]):
        raise ValueError(f"qfuse::{_OP}: bias must have shape [{b.shape[1]}], got {tuple(bias.shape)}")
    return out_shape


@torch.library.custom_op("qfuse::weight_only_scaled_mm", mutates_args=())
def weight_only_scaled_mm(x: Tensor, b: Tensor, scale_b: Tensor | None, bias: Tensor | None, azp_b: Tensor | None,
                          out_dtype: torch.dtype, kernel: str) -> Tensor:
    out_shape = check_operands(x, b, bias, azp_b, out_dtype)
    k, n = b.shape
    zero_point = _normalize_zero_point(azp_b, n, "azp_b", _OP, (1, n))
    implementation, weight = prepared_kernel(kernel, b, _normalize_scale_b(scale_b, k, n), zero_point)
    return implementation.weight_only_apply(x.reshape(-1, k), weight, bias, out_dtype).reshape(out_shape)


def check_call(x, b, scale_b, bias, azp_b, out_dtype) -> tuple:
    """`check_operands`, and the weight scale's and zero point's shapes: every check of a call."""
    out_shape = check_operands(x, b, bias, azp_b, out_dtype)
    _normalize_scale_b(scale_b, *b.shape)
    _normalize_zero_point(azp_b, b.shape[1], "azp_b", _OP, (1, b.shape[1]))
    return out_shape


@weight_only_scaled_mm.register_fake
def _(x, b, scale_b, bias, azp_b, out_dtype, kernel):
    return x.new_empty(check_call(x, b, scale_b, bias, azp_b, out_dtype), dtype=out_dtype)


class WeightOnlyScaledMmArgs(op_arguments(torch.ops.qfuse.weight_only_scaled_mm.default)):
    """`qfuse::weight_only_scaled_mm`'s arguments by name; its fields are the parameters of the op above."""
