"""`qfuse::int4_weight_only_mm`: a linear whose weight is int4, packed eight to an int32 or one to an int8 (W4A16).

    int4_weight_only_mm(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype, kernel,
                        g_idx=None, zero_convention="stored", packed_along_n=False)
        q[n, k]  = (packed[n, k // 8] >> shifts[k % 8]) & 0xF                       unsigned 4-bit values
                   (shifts None: 0, 4, ..., 28, nibble i at bits 4i)
                 = (packed[k, n // 8] >> shifts[n % 8]) & 0xF                       packed_along_n (AWQ)
        u[n, j]  = packed_zeros[n // 8, j] >> shifts[n % 8]                           the zero point's word
        z[n, j]  = 8 without packed_zeros, else by `zero_convention`:                 per group j
                   "stored" u & 0xF;  "plus_one" (u & 0xF) + 1;  "plus_one_mod_16" (u + 1) & 0xF
        q[n, k]  = packed[n, k]                                                     int8 storage: signed values
        z[n, j]  = packed_zeros[n, j], or 0 without them                             int8 storage
        group(k) = g_idx[k], or k // group_size without g_idx
        w[n, k]  = (q[n, k] - z[n, group(k)]) * scales[n, group(k)]                  in x's dtype
        out      = x @ w^T + bias, cast to out_dtype

This is the int4 layout of GPTQ checkpoints in [N, K] orientation (GPTQModel's v2 format) and of
compressed-tensors' "pack-quantized" W4A16 (llm-compressor): `packed` int32 [N, K / 8], `scales`
[N, K / g] in the model dtype, `packed_zeros` int32 [N / 8, K / g] (asymmetric) or None (the uint4
offset 8). The classic AutoGPTQ layout (`qweight` [K / 8, N], `scales` [K / g, N], `qzeros`
[K / g, N / 8]) is the same formula on the transposes of its tensors (views, any strides). AWQ
packs along N: `packed` int32 [K, N / 8] (`packed_along_n`), its interleaved channel order folded
into `shifts`, its zero points and scales transposed as AutoGPTQ's. Old GPTQ
checkpoints store the zero points minus one: AutoGPTQ adds one before its mask ("plus_one_mod_16"),
other code after it ("plus_one", where a stored 15 is a zero point of 16). `g_idx` int32 [K] is
GPTQ's activation order (desc_act): the group of each input channel.

int8 storage is torchao's "intx" int4 (`IntxUnpackedToInt8Tensor`, from `IntxWeightOnlyConfig` and
`Int8DynamicActivationIntxWeightConfig` with `weight_dtype=torch.int4`): `packed` int8 [N, K] holds
one value per byte, `packed_zeros` int8 [N, K / g] (or None), no shifts, no zero convention. int8
storage does not prove int4's range, so the op checks it once per weight (`in_int4_range`, after
`folded_zero_points`): values and zero points in [-8, 7] go to the int4 kernel, any other weight is
dequantized once (`Packing.DENSE`).

The op takes the stored tensors themselves, and `shifts` as the model holds them (an int32 [8]
buffer, usually 0, 4, ..., 28): the unpack above uses whatever it holds, so the op is the model's
math for any value of it. Code that splits the words' bytes into nibbles instead
(compressed-tensors' `unpack_from_int32`) reads nibble i at bits 4i: `shifts` None. Unpacking and
the kernel's own packing run once per weight (`qfuse.kernels.prepared.built_once`), not on every
call: the kernel gets qfuse's int4 convention, the values q - 8 in [-8, 7] as an int8 [K, N] matrix,
`scales` as [K / g, N] and the zero points z - 8 as [K / g, N] (None when symmetric), and runs
`Kernel.weight_only_apply` on every call (`Kernel.prepare_int4_weight` makes its layout). A `g_idx`
that sorts into groups of `group_size` (every GPTQ checkpoint's) becomes an order of the K rows:
the weight's rows are sorted by group once, and the activation's columns gathered in that order
on every call (`PreparedWeight.input_order`). Any other `g_idx` gets the weight dequantized once to
a float [K, N] matrix and a plain matmul (`Packing.DENSE`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from qfuse.kernels import get_kernel
from qfuse.kernels.array_ops import TORCH_OPS, ArrayOps
from qfuse.kernels.int4_words import ZERO_CONVENTIONS
from qfuse.kernels.prepared import Packing, PreparedWeight, built_once, dense_int4_weight
from qfuse.ops.arguments import op_arguments
from qfuse.ops.scaled_mm import OUT_DTYPES
from qfuse.schemes import FLOAT_ACTIVATION_DTYPES, INT4_OFFSET

_OP = "int4_weight_only_mm"
NIBBLES_PER_WORD = 8
#: words `unpack` turns into values at a time: its temporaries (two of 32 MiB at once with int32 shifts) stay so
#: whatever the weight (a 70B model's joined gate / up weight would otherwise take 8 bytes a value, gigabytes, while its
#: values take one)
UNPACK_WORDS = 2**20
INT4_RANGE = (-INT4_OFFSET, INT4_OFFSET - 1)


def check_operands(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype, g_idx,
                    zero_convention, packed_along_n) -> tuple:
    """The output shape, after checking dtypes and shapes (ValueError naming the problem)."""
    def fail(message):
        raise ValueError(f"qfuse::{_OP}: {message}")

    if x.dtype not in FLOAT_ACTIVATION_DTYPES:
        fail(f"activation must be one of {FLOAT_ACTIVATION_DTYPES}, got {x.dtype}")
    if out_dtype not in OUT_DTYPES:
        fail(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if packed.dtype == torch.int8 and packed.dim() == 2:
        if shifts is not None or packed_along_n or zero_convention != "stored":
            fail("an int8 [N, K] weight holds its values unpacked: no shifts, packed_along_n or zero convention")
        (n, k), layout = packed.shape, "[N, K]"
    else:
        layout = "[K, N / 8]" if packed_along_n else "[N, K / 8]"
        if packed.dtype != torch.int32 or packed.dim() != 2:
            fail(f"packed must be an int32 {layout} matrix or int8 [N, K] values, got {packed.dtype} of shape "
                 f"{tuple(packed.shape)}")
        if packed_along_n:
            k, n = packed.shape[0], packed.shape[1] * NIBBLES_PER_WORD
        else:
            n, k = packed.shape[0], packed.shape[1] * NIBBLES_PER_WORD
    if x.shape[-1] != k:
        fail(f"activation has K={x.shape[-1]} but the packed weight {layout} holds K={k}")
    if shifts is not None and (shifts.dtype != torch.int32 or tuple(shifts.shape) != (NIBBLES_PER_WORD,)):
        fail(f"shifts must be int32 [8], got {shifts.dtype} of shape {tuple(shifts.shape)}")
    if group_size <= 0 or k % group_size:
        fail(f"group_size must divide K={k}, got {group_size}")
    if not scales.is_floating_point() or tuple(scales.shape) != (n, k // group_size):
        fail(f"scales must be a float [N, K / group_size] = [{n}, {k // group_size}] matrix, got "
             f"{scales.dtype} of shape {tuple(scales.shape)}")
    if packed.dtype == torch.int8:  # one zero point a value, as the weight's values
        zeros_dtype, zeros_shape, zeros_layout = torch.int8, (n, k // group_size), "int8 [N, K / group_size]"
    else:  # packed eight to a word along N
        zeros_dtype, zeros_shape, zeros_layout = torch.int32, (n // NIBBLES_PER_WORD, k // group_size), "int32 [N / 8, K / group_size]"
        if packed_zeros is not None and n % NIBBLES_PER_WORD:
            fail(f"packed_zeros are packed eight to a word along N, which N={n} does not divide into")
    if packed_zeros is not None and (packed_zeros.dtype != zeros_dtype or tuple(packed_zeros.shape) != zeros_shape):
        fail(f"packed_zeros must be {zeros_layout} = {list(zeros_shape)}, got {packed_zeros.dtype} of shape "
             f"{tuple(packed_zeros.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        fail(f"bias must have shape [{n}], got {tuple(bias.shape)}")
    if g_idx is not None and (g_idx.dtype not in (torch.int32, torch.int64) or tuple(g_idx.shape) != (k,)):
        fail(f"g_idx must be an int32 or int64 [K] = [{k}] vector, got {g_idx.dtype} of shape {tuple(g_idx.shape)}")
    if zero_convention not in ZERO_CONVENTIONS:
        fail(f"zero_convention must be one of {list(ZERO_CONVENTIONS)}, got {zero_convention!r}")
    return (*x.shape[:-1], n)


def apply_zero_convention(shifted_words, zero_convention: str, ops: ArrayOps = TORCH_OPS):
    """The zero point held in the low nibble of `shifted_words` (int32), by its convention: the nibble
    itself, plus one after the mask, or plus one before it (mod 16). Written once for the eager op
    (`TORCH_OPS`) and the lowering (`qfuse.lowerings.ir.IR_OPS`)."""
    add, wrap = ZERO_CONVENTIONS[zero_convention]
    if wrap:
        return ops.bitwise_and(ops.add(shifted_words, add), 0xF)
    return ops.add(ops.bitwise_and(shifted_words, 0xF), add)


def zero_points(packed_zeros: Tensor, shifts: Tensor, zero_convention: str) -> Tensor:
    """z [N, K / g] of the module docstring (int32, in [0, 16])."""
    words = packed_zeros.unsqueeze(1) >> shifts[:, None]  # [N / 8, 8, K / g]
    return apply_zero_convention(words, zero_convention).reshape(-1, packed_zeros.shape[-1])


def unpack(packed: Tensor, shifts: Tensor | None, scales: Tensor, packed_zeros: Tensor | None, group_size: int,
           zero_convention: str = "stored", packed_along_n: bool = False):
    """(int8 [K, N] values q - 8 in [-8, 7], scales [K / g, N], int8 [K / g, N] zero points z - 8 or
    None): the weight in qfuse's int4 convention, exactly as the module docstring's formula reads it
    (its groups contiguous along K: the caller orders the rows of a `g_idx`, `group_order`). int8
    storage is read as it is: its values and zero points may leave [-8, 7] (`in_int4_range`)."""
    if packed.dtype == torch.int8:
        return packed.t(), scales.t(), None if packed_zeros is None else packed_zeros.t()
    if shifts is None:
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    values = torch.empty(packed.shape[0], packed.shape[1] * NIBBLES_PER_WORD, dtype=torch.int8, device=packed.device)
    rows = max(1, UNPACK_WORDS // max(1, packed.shape[1]))  # int32 temporaries of at most UNPACK_WORDS x 8 values
    for start in range(0, packed.shape[0], rows):  # [N, K], or [K, N] along N
        block = packed[start:start + rows]
        values[start:start + rows] = (((block.unsqueeze(-1) >> shifts) & 0xF) - INT4_OFFSET).reshape(block.shape[0], -1)
    values = values if packed_along_n else values.t()
    zeros = None
    if packed_zeros is not None:
        zeros = (zero_points(packed_zeros, shifts, zero_convention) - INT4_OFFSET).to(torch.int8).t()
    return values, scales.t(), zeros


def group_order(g_idx: Tensor, group_size: int, groups: int) -> Tensor | None:
    """The order of the K rows that makes the groups of `g_idx` contiguous (k // group_size after
    it), or None when `g_idx` sorts into no such groups. ValueError for a group out of range, where
    eager's gather would raise an IndexError."""
    if g_idx.numel() and (g_idx.min() < 0 or g_idx.max() >= groups):
        raise ValueError(f"qfuse::{_OP}: g_idx holds groups in [{int(g_idx.min())}, {int(g_idx.max())}], "
                         f"outside the {groups} groups of the scales")
    order = torch.argsort(g_idx, stable=True)
    grouped = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    return order if torch.equal(g_idx[order].to(grouped.dtype), grouped) else None


def in_int4_range(*tensors: Tensor | None) -> bool:
    """Whether every value of `tensors` (None: none) lies in [-8, 7], where the int4 kernels read it."""
    low, high = INT4_RANGE
    return all(tensor is None or not tensor.numel() or (low <= tensor.min() and tensor.max() <= high)
               for tensor in tensors)


def dense_weight(packed, shifts, scales, packed_zeros, group_size, g_idx, zero_convention,
                 packed_along_n) -> PreparedWeight:
    """The float [K, N] weight of the module docstring's formula (in the scales' dtype, one rounding)."""
    values, group_scales, zeros = unpack(packed, shifts, scales, packed_zeros, group_size, zero_convention,
                                         packed_along_n)
    why = ("its g_idx sorts into no groups of its size" if g_idx is not None
           else "its int8 values or zero points leave int4's range")
    return dense_int4_weight(values, group_scales, zeros, why, None if g_idx is None else g_idx.long())


def folded_zero_points(values: Tensor, zeros: Tensor | None, group_size: int) -> tuple[Tensor, Tensor | None]:
    """(values, zeros) of the same weight, the zero points folded into the values (v - z, then no
    zero points) where every difference stays in int4's range: all zero (torchao's symmetric int4
    stores them) or small. Exact: (v - z) * s is the same product."""
    if zeros is None:
        return values, None
    folded = values.to(torch.int16) - zeros.repeat_interleave(group_size, 0).to(torch.int16)
    return (folded.to(torch.int8), None) if in_int4_range(folded) else (values, zeros)


def int4_values(packed, shifts, scales, packed_zeros, group_size: int, g_idx=None, zero_convention: str = "stored",
                packed_along_n: bool = False) -> tuple | None:
    """(values, scales, zeros, order): the weight in qfuse's int4 convention as the kernels take it (`unpack`),
    its rows sorted by group where `g_idx` orders them (`order`, else None) and its zero points folded where
    they fit; None where it has no exact int4 form (a `g_idx` of no groups, int8 storage outside int4's
    range): it is multiplied dense (`dense_weight`)."""
    order = None if g_idx is None else group_order(g_idx, group_size, scales.shape[1])
    if g_idx is not None and order is None:
        return None
    values, group_scales, zeros = unpack(packed, shifts, scales, packed_zeros, group_size, zero_convention,
                                         packed_along_n)
    if order is not None:
        values = values[order]
    values, zeros = folded_zero_points(values, zeros, group_size)
    if packed.dtype == torch.int8 and not in_int4_range(values, zeros):  # (words hold int4 values by construction)
        return None
    return values, group_scales, zeros, order


def prepared_int4_weight(kernel: str, packed, shifts, scales, packed_zeros, group_size: int, g_idx=None,
                         zero_convention: str = "stored", packed_along_n: bool = False, in_place: bool = False) -> tuple:
    """(the kernel named `kernel`, its prepared form of this int4 weight), unpacked and prepared once; `in_place`:
    read where it lies where the kernel can (`Kernel.int4_checkpoint_weight`), nothing copied."""
    implementation = get_kernel(kernel)
    # Inductor inlines a CPU graph constant of at most 8 values (AWQ's shifts) as a new tensor on every call: the
    # shifts are then part of the key by value, or each call would prepare the weight again
    shift_values = tuple(shifts.tolist()) if shifts is not None and shifts.device.type == "cpu" else None

    def build(packed, shifts, scales, packed_zeros, g_idx) -> PreparedWeight:  # of the sources: the entry keeps it
        if shift_values is not None:
            shifts = torch.tensor(shift_values, dtype=torch.int32)
        if in_place and g_idx is None and not packed_along_n and (as_stored := implementation.int4_checkpoint_weight(
                [(packed, shifts, scales, packed_zeros)], group_size, zero_convention)):
            return as_stored
        parts = int4_values(packed, shifts, scales, packed_zeros, group_size, g_idx, zero_convention, packed_along_n)
        if parts is None:
            return dense_weight(packed, shifts, scales, packed_zeros, group_size, g_idx, zero_convention,
                                packed_along_n)
        values, group_scales, zeros, order = parts
        prepared = implementation.prepare_int4_weight(values.contiguous(), group_scales.contiguous(),
                                                      None if zeros is None else zeros.contiguous())
        return prepared if order is None else dataclasses.replace(prepared, input_order=order)

    label = (_OP, implementation.name, group_size, zero_convention, packed_along_n, shift_values, in_place)
    sources = (packed, None if shift_values is not None else shifts, scales, packed_zeros, g_idx)
    return implementation, built_once(label, sources, build)


def int4_product(implementation, x2d: Tensor, weight: PreparedWeight, bias: Tensor | None, out_dtype) -> Tensor:
    """x2d @ w + bias as `out_dtype`, w the prepared int4 weight (a DENSE one by a plain matmul)."""
    if weight.input_order is not None:  # the weight's rows were sorted by group (a DENSE one too)
        x2d = x2d[:, weight.input_order]
    if weight.packing == Packing.DENSE:
        out = x2d @ weight.data.to(x2d.dtype)
        return (out if bias is None else out + bias.to(out.dtype)).to(out_dtype)
    return implementation.weight_only_apply(x2d, weight, bias, out_dtype)


@torch.library.custom_op("qfuse::int4_weight_only_mm", mutates_args=())
def int4_weight_only_mm(x: Tensor, packed: Tensor, shifts: Tensor | None, scales: Tensor, packed_zeros: Tensor | None,
                        bias: Tensor | None, group_size: int, out_dtype: torch.dtype, kernel: str,
                        g_idx: Tensor | None = None, zero_convention: str = "stored",
                        packed_along_n: bool = False) -> Tensor:
    out_shape = check_operands(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype, g_idx,
                                zero_convention, packed_along_n)
    implementation, weight = prepared_int4_weight(kernel, packed, shifts, scales, packed_zeros, group_size, g_idx,
                                                  zero_convention, packed_along_n)
    return int4_product(implementation, x.reshape(-1, x.shape[-1]), weight, bias, out_dtype).reshape(out_shape)


@int4_weight_only_mm.register_fake
def _(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype, kernel, g_idx=None,
      zero_convention="stored", packed_along_n=False):
    out_shape = check_operands(x, packed, shifts, scales, packed_zeros, bias, group_size, out_dtype, g_idx,
                                zero_convention, packed_along_n)
    return x.new_empty(out_shape, dtype=out_dtype)


class Int4WeightOnlyMmArgs(op_arguments(torch.ops.qfuse.int4_weight_only_mm.default)):
    """`qfuse::int4_weight_only_mm`'s arguments by name; its fields are the parameters of the op above."""
