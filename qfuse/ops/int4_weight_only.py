"""`qfuse::int4_weight_only_mm`: a linear whose weight is int4, packed eight to an int32 along K (W4A16).

    int4_weight_only_mm(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype, kernel)
        q[n, k]  = (packed[n, k // 8] >> shifts[k % 8]) & 0xF                       unsigned 4-bit values
                   (shifts None: 0, 4, ..., 28, nibble i at bits 4i)
        z[n, j]  = 8, or (packed_zeros[n // 8, j] >> shifts[n % 8]) & 0xF           per group j = k // g
        w[n, k]  = (q[n, k] - z[n, k // g]) * scales[n, k // g]                      in x's dtype
        out      = x @ w^T + bias, cast to out_dtype

This is the int4 layout of GPTQ checkpoints in [N, K] orientation (GPTQModel's v2 format) and of
compressed-tensors' "pack-quantized" W4A16 (llm-compressor): `packed` int32 [N, K / 8], `scales`
[N, K / g] in the model dtype, `packed_zeros` int32 [N / 8, K / g] (asymmetric) or None (the uint4
offset 8). The op takes the stored tensors themselves, and `shifts` as the model holds them (an
int32 [8] buffer, usually 0, 4, ..., 28): the unpack above uses whatever it holds, so the op is the
model's math for any value of it. Code that splits the words' bytes into nibbles instead
(compressed-tensors' `unpack_from_int32`) reads nibble i at bits 4i: `shifts` None. Unpacking and
the kernel's own packing run once per weight (`qfuse.kernels.prepared.built_once`), not on every call: the kernel gets qfuse's int4 convention,
the values q - 8 in [-8, 7] as an int8 [K, N] matrix, `scales` as [K / g, N] and the zero points
z - 8 as [K / g, N] (None when symmetric), and runs
`Kernel.weight_only_apply` on every call (`Kernel.prepare_int4_weight` makes its layout).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qfuse.kernels import get_kernel
from qfuse.kernels.prepared import PreparedWeight, built_once
from qfuse.ops.arguments import op_arguments
from qfuse.ops.scaled_mm import OUT_DTYPES
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, INT4_OFFSET

_OP = "int4_weight_only_mm"
NIBBLES_PER_WORD = 8


def _check_operands(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype) -> tuple:
    """The output shape, after checking dtypes and shapes (ValueError naming the problem)."""
    def fail(message):
        raise ValueError(f"qfuse::{_OP}: {message}")

    if x.dtype not in FLOAT_ACTIVATION_DTYPES:
        fail(f"activation must be one of {FLOAT_ACTIVATION_DTYPES}, got {x.dtype}")
    if out_dtype not in OUT_DTYPES:
        fail(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if packed.dtype != torch.int32 or packed.dim() != 2:
        fail(f"packed must be an int32 [N, K / 8] matrix, got {packed.dtype} of shape {tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * NIBBLES_PER_WORD
    if x.shape[-1] != k:
        fail(f"activation has K={x.shape[-1]} but the packed weight holds K={k} (8 values per int32)")
    if shifts is not None and (shifts.dtype != torch.int32 or tuple(shifts.shape) != (NIBBLES_PER_WORD,)):
        fail(f"shifts must be int32 [8], got {shifts.dtype} of shape {tuple(shifts.shape)}")
    if group_size <= 0 or k % group_size:
        fail(f"group_size must divide K={k}, got {group_size}")
    if not scales.is_floating_point() or tuple(scales.shape) != (n, k // group_size):
        fail(f"scales must be a float [N, K / group_size] = [{n}, {k // group_size}] matrix, got "
             f"{scales.dtype} of shape {tuple(scales.shape)}")
    if packed_zeros is not None and (packed_zeros.dtype != torch.int32 or n % NIBBLES_PER_WORD
                                     or tuple(packed_zeros.shape) != (n // NIBBLES_PER_WORD, k // group_size)):
        fail(f"packed_zeros must be int32 [N / 8, K / group_size] = [{n // NIBBLES_PER_WORD}, {k // group_size}], "
             f"got {packed_zeros.dtype} of shape {tuple(packed_zeros.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        fail(f"bias must have shape [{n}], got {tuple(bias.shape)}")
    return (*x.shape[:-1], n)


def unpack(packed: Tensor, shifts: Tensor | None, scales: Tensor, packed_zeros: Tensor | None, group_size: int):
    """(int8 [K, N] values q - 8 in [-8, 7], scales [K / g, N], int8 [K / g, N] zero points z - 8 or
    None): the weight in qfuse's int4 convention, exactly as the module docstring's formula reads it."""
    n = packed.shape[0]
    if shifts is None:
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(n, -1)
    values = (q - INT4_OFFSET).to(torch.int8).t()
    zeros = None
    if packed_zeros is not None:
        z = ((packed_zeros.unsqueeze(1) >> shifts[:, None]) & 0xF).reshape(n, -1)
        zeros = (z - INT4_OFFSET).to(torch.int8).t()
    return values, scales.t(), zeros


def prepared_int4_weight(kernel: str, packed, shifts, scales, packed_zeros, group_size: int) -> tuple:
    """(the kernel named `kernel`, its prepared form of this int4 weight), unpacked and prepared once."""
    implementation = get_kernel(kernel)

    def build() -> PreparedWeight:
        values, group_scales, zeros = unpack(packed, shifts, scales, packed_zeros, group_size)
        return implementation.prepare_int4_weight(values.contiguous(), group_scales.contiguous(),
                                                  None if zeros is None else zeros.contiguous())

    label = (_OP, implementation.name, group_size)
    return implementation, built_once(label, (packed, shifts, scales, packed_zeros), build)


@torch.library.custom_op("qfuse::int4_weight_only_mm", mutates_args=())
def int4_weight_only_mm(x: Tensor, packed: Tensor, shifts: Tensor | None, scales: Tensor, packed_zeros: Tensor | None,
                        bias: Tensor | None, group_size: int, out_dtype: torch.dtype, kernel: str) -> Tensor:
    out_shape = _check_operands(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype)
    implementation, weight = prepared_int4_weight(kernel, packed, shifts, scales, packed_zeros, group_size)
    return implementation.weight_only_apply(x.reshape(-1, x.shape[-1]), weight, bias, out_dtype).reshape(out_shape)


@int4_weight_only_mm.register_fake
def _(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype, kernel):
    return x.new_empty(_check_operands(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype),
                       dtype=out_dtype)


class Int4WeightOnlyMmArgs(op_arguments(torch.ops.qfuse.int4_weight_only_mm.default)):
    """`qfuse::int4_weight_only_mm`'s arguments by name; its fields are the parameters of the op above."""
