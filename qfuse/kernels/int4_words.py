"""int4 values packed eight to an int32 word, the layout GPTQ (v2), compressed-tensors, vLLM's XPU
W4A8 kernel and qfuse's Triton W4A16 kernel share:

    packed[n, j] = sum_i (w[n, 8 j + i] + 8) << 4 i        int32 [N, K / 8], w int8 in [-8, 7]

(each value plus 8 is a nibble in [0, 15]; the first of eight in the lowest four bits).
"""

from __future__ import annotations

import torch

from qfuse.schemes import INT4_OFFSET

VALUES_PER_INT32 = 8
BITS_PER_VALUE = 4
#: zero_convention -> (what is added to the zero point's shifted word, whether the sum is masked after)
ZERO_CONVENTIONS = {"stored": (0, False), "plus_one": (1, False), "plus_one_mod_16": (1, True)}


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] holding int4 values in [-8, 7] -> int32 [N, K / 8], eight nibbles per int32."""
    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError(f"pack_int4 takes an int8 [N, K] matrix, got {values.dtype} of shape {tuple(values.shape)}")
    rows, cols = values.shape
    if cols % VALUES_PER_INT32:
        raise ValueError(f"pack_int4 needs K to be a multiple of {VALUES_PER_INT32}, got {cols}")
    if values.numel() and (values.min() < -INT4_OFFSET or values.max() >= INT4_OFFSET):
        raise ValueError(f"int4 values must lie in [-8, 7], got [{values.min()}, {values.max()}]")
    nibbles = (values.to(torch.int64) + INT4_OFFSET).reshape(rows, cols // VALUES_PER_INT32, VALUES_PER_INT32)
    shifts = torch.arange(0, 32, BITS_PER_VALUE, dtype=torch.int64, device=values.device)
    unsigned = (nibbles << shifts).sum(dim=-1)  # distinct bits, so the sum is the bitwise or
    return torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32)  # as two's complement


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K / 8] from `pack_int4` -> int8 [N, K] with values in [-8, 7]."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"unpack_int4 takes an int32 [N, K / 8] matrix, "
                         f"got {packed.dtype} of shape {tuple(packed.shape)}")
    unsigned = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, BITS_PER_VALUE, dtype=torch.int64, device=packed.device)
    nibbles = (unsigned.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles - INT4_OFFSET).to(torch.int8).flatten(-2)
