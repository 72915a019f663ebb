"""Peer models: WEIGHT-ONLY quantized linears (issue #14) in the forms real code writes, on CPU.

The activation stays float (bf16 / fp16 / fp32); only the weight is int8 or int4, dequantized in the
forward (or handed to a weight-only kernel). Each form says where it comes from; all are written by
the team from public descriptions of those tools (nothing copied), except where a builder applies
the tool itself (torchao's `quantize_`, compressed-tensors' compressor and unpack / dequantize
helpers, transformers' `QuantizedLinear`).

    form                          weight storage                         dequantize
    int8, scale in the weight     int8 [N, K], scale [N]                 F.linear(x, w.to(dt) * s[:, None], b)
    int8, scale after the matmul  int8 [N, K], scale [N]                 (x @ w.t().to(dt)) * s + b
    torchao Int8WeightOnlyConfig  Int8Tensor (int8 [N, K], fp32 [N, 1])  mm(x2d, w.t().to(dt)) * s.to(dt).flatten()
    torchao int4 on CPU           Int4OpaqueTensor (prototype config)    aten._weight_int4pack_mm_for_cpu
    torchao intx int4             int8 [N, K] values, int8 zero points   ((q.view(N, K/g, g).to(dt) - zp.view(N,
                                  [N, K/g], scales [N, K/g]              K/g, 1).to(dt)) * s.view(N, K/g, 1)).view(N, K)
    GPTQ / CT pack-quantized      int32 [N, K/8], 8 nibbles along K      ((w >> shifts) & 0xF) - zero, * group scale
    AutoGPTQ (classic)            int32 [K/8, N], zeros [K/g, N/8] - 1   same, [K, N] orientation, scales[g_idx]
    AWQ (GEMM)                    int32 [K, N/8], order 0 2 4 6 1 3 5 7  unpack, undo the order, (w - z) * s
    transformers Gemma quant      int8 [N, K] / uint8 [N, K/2] nibbles   int.to(dt) * scale [N, 1], F.linear
    fp8 per channel (Marlin fp8)  fp8 [N, K], scale [N, 1] float32       F.linear(x, (w.float() * s).to(dt), b)
    fp8 block (DeepSeek-V3 style) fp8 [N, K], weight_scale_inv           s.repeat_interleave(128, 0 / 1)[:N, :K]
                                  [ceil(N/128), ceil(K/128)] float32     (vLLM / SGLang), or a [N/128, 128,
                                                                         K/128, 128] view (HF style)

Builders take `dtype` (the activation's and the float parameters'), return the model in eval mode
and set `model.reference_weight` (all but `torchao_int4_weight_only`, which cannot build here): the
float `[N, K]` weight the model must compute with, made from the integers the builder drew without
any of the model's unpacking (tests compare eager against `F.linear(x, reference_weight, bias)`, so
a wrong bit order or zero-point convention shows). For the tools' own formats (torchao,
compressed-tensors) it is the tool's own dequantize / decompress.
`example_input(K, dtype, three_d)` makes an input. Seeded: two calls build the same model.
This module does not import qfuse.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

INT4_SHIFTS = tuple(range(0, 32, 4))  # nibble i of an int32 word sits at bits 4i..4i+3
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output channel AWQ_PACK_ORDER[i]
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # channel j sits in nibble AWQ_UNPACK_ORDER[j] (the inverse)


def example_input(in_features: int, dtype: torch.dtype, three_d: bool = False, tokens: int = 16, seed: int = 1):
    """`[tokens, K]`, or `[2, tokens // 2, K]` when `three_d`."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, tokens // 2, in_features) if three_d else (tokens, in_features)
    return torch.randn(*shape, generator=generator).to(dtype)


def _bias(out_features: int, generator: torch.Generator, dtype: torch.dtype, bias: bool):
    return torch.randn(out_features, generator=generator).to(dtype) / 4 if bias else None


def _random_int4(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Unsigned 4-bit values 0..15, as int32."""
    return torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.int32)


def pack_int4_along_last(values: torch.Tensor) -> torch.Tensor:
    """int32 `[R, C]` of values 0..15 -> int32 `[R, C / 8]`: value 8j + i in bits 4i..4i+3 of word j."""
    rows, cols = values.shape
    nibbles = values.to(torch.int64).reshape(rows, cols // 8, 8)
    shifts = torch.tensor(INT4_SHIFTS, dtype=torch.int64)
    return (nibbles << shifts).sum(-1).to(torch.int32)  # the cast keeps the low 32 bits (two's complement)


def pack_int4_along_first(values: torch.Tensor) -> torch.Tensor:
    """int32 `[R, C]` of values 0..15 -> int32 `[R / 8, C]`, packed down the rows."""
    return pack_int4_along_last(values.t().contiguous()).t().contiguous()


# --- 1. int8 weight-only written by hand ------------------------------------------------------------------


class HandWrittenInt8WeightOnlyLinear(nn.Module):
    """int8 weight-only linear written by hand (HF-style model code, torchao's fallback).

    Source: the common plain-PyTorch W8A16 linear: int8 weight `[N, K]`, one float scale per
    output channel `[N]` (symmetric, no zero point), float activation.
    - `scale_after_matmul=False`: `F.linear(x, w.to(x.dtype) * scale[:, None], bias)`: the weight is
      dequantized, then a float linear (`addmm` / `mm` in the graph).
    - `scale_after_matmul=True`: `(x @ w.t().to(x.dtype)) * scale + bias`: the matmul runs on the
      upcast integer weight and the scale multiplies its output columns, the way torchao's int8
      weight-only path writes it (`y = mm(x, w.t().to(dtype)) * scale`).
    Math: y[m, n] = sum_k x[m, k] * w[n, k] * scale[n] + bias[n].
    The scale is stored in the activation dtype unless `scale_dtype` says otherwise; then the forward
    casts it (`scale.to(x.dtype)`), as code that keeps fp32 scales next to a bf16 model does.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 scale_after_matmul: bool) -> None:
        super().__init__()
        self.register_buffer("weight", weight)  # int8 [N, K]
        self.register_buffer("weight_scale", scale)  # [N]
        self.register_buffer("bias", bias)
        self.scale_after_matmul = scale_after_matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight_scale.to(x.dtype)
        if self.scale_after_matmul:
            y = (x @ self.weight.t().to(x.dtype)) * scale
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight.to(x.dtype) * scale[:, None], self.bias)


def hand_written_int8(dtype: torch.dtype, scale_after_matmul: bool, in_features: int = 64, out_features: int = 128,
                      bias: bool = True, scale_dtype: torch.dtype | None = None, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    scale = (torch.rand(out_features, generator=generator) + 0.5) / 127
    scale = scale.to(scale_dtype or dtype)
    model = HandWrittenInt8WeightOnlyLinear(weight, scale, _bias(out_features, generator, dtype, bias),
                                            scale_after_matmul).eval()
    model.reference_weight = weight.double() * scale.double()[:, None]
    return model


# --- 2. torchao quantize_ ---------------------------------------------------------------------------------


def _float_linear(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype).eval()


def torchao_int8_weight_only(dtype: torch.dtype, granularity: str = "per_row", in_features: int = 128,
                             out_features: int = 256, bias: bool = True, seed: int = 0):
    """`quantize_(linear, Int8WeightOnlyConfig(granularity=...))` (torchao 0.18, config version 2).

    Source: torchao's `Int8Tensor` linear. The weight becomes int8 `[N, K]` with an fp32 scale
    (`PerRow`: `[N, 1]`; `PerTensor`: `[1, 1]`; `PerGroup(g)`: `[N, K / g]` plus an int8 zero point,
    all zeros for the symmetric mapping). Forward, per row / per tensor:
    `y = mm(x.reshape(-1, K), w.t().to(x.dtype)) * scale.to(y.dtype).flatten()`, reshape, `+= bias`;
    per group: the weight is dequantized (`(w - zp) * scale` over `[N, K / g, g]`) and a float mm runs.
    `granularity`: "per_row", "per_tensor" or "per_group_32".
    """
    from torchao.quantization import Int8WeightOnlyConfig, PerGroup, PerRow, PerTensor, quantize_

    choice = {"per_row": PerRow(), "per_tensor": PerTensor()}.get(granularity)
    if choice is None and granularity.startswith("per_group_"):
        choice = PerGroup(int(granularity.rsplit("_", 1)[1]))
    model = _float_linear(in_features, out_features, bias, dtype, seed)
    quantize_(model, Int8WeightOnlyConfig(granularity=choice, set_inductor_config=False))
    model.reference_weight = model.weight.dequantize().double()
    return model


TORCHAO_INT4_PACKING_FORMATS = ("plain", "preshuffled", "plain_int32", "tile_packed_to_4d")


def torchao_int4_weight_only(dtype: torch.dtype, packing_format: str, group_size: int = 32, in_features: int = 128,
                             out_features: int = 256, bias: bool = True, seed: int = 0):
    """`quantize_(linear, Int4WeightOnlyConfig(group_size, int4_packing_format=...))` (torchao 0.18).

    Source: torchao's `Int4WeightOnlyConfig`. None of its packing formats has a CPU path in 0.18:
    "plain" and "preshuffled" need the `mslk` package (CUDA kernels), "plain_int32" is XPU / NPU
    only, "tile_packed_to_4d" (tinygemm, `aten._weight_int4pack_mm`) needs CUDA and bf16.
    Raises whatever torchao raises here; the test skips with that reason.
    """
    from torchao.quantization import Int4WeightOnlyConfig, quantize_
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    model = _float_linear(in_features, out_features, bias, dtype, seed)
    quantize_(model, Int4WeightOnlyConfig(group_size=group_size, int4_packing_format=Int4PackingFormat(packing_format),
                                          set_inductor_config=False))
    return model


def torchao_int4_cpu(dtype: torch.dtype, group_size: int = 32, in_features: int = 128, out_features: int = 256,
                     bias: bool = True, seed: int = 0):
    """`quantize_(linear, PrototypeInt4WeightOnlyConfig(group_size))` (torchao 0.18 prototype).

    Source: torchao's CPU int4 weight-only path (`torchao.prototype.quantization.int4`,
    `Int4OpaqueTensor`, what replaced the old `Int4CPULayout`). Asymmetric uint4 per group (tinygemm
    qparams: `w = (q - 8) * scale + zero`, scale and zero in the model dtype), the weight repacked by
    `aten._convert_weight_to_int4pack_for_cpu`; forward:
    `aten._weight_int4pack_mm_for_cpu(x.reshape(-1, K), packed, group_size, scale_and_zero)`, reshape,
    `+= bias`. The weight is opaque to a graph pass: the matmul is already a weight-only kernel.
    """
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
    from torchao.quantization import quantize_

    model = _float_linear(in_features, out_features, bias, dtype, seed)
    float_weight = model.weight.detach().clone()
    quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False))
    model.reference_weight = _tinygemm_fake_quant(float_weight, group_size).double()
    return model


def _tinygemm_fake_quant(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight torchao's tinygemm int4 qparams represent (asymmetric uint4 with a float zero)."""
    from torchao.quantization.quant_primitives import (MappingType, _choose_qparams_affine_tinygemm,
                                                       _dequantize_affine_tinygemm, _quantize_affine_tinygemm)

    block = (1, group_size)
    scale, zero = _choose_qparams_affine_tinygemm(weight, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6,
                                                  None, weight.dtype)
    q = _quantize_affine_tinygemm(weight, block, scale, zero, torch.int32, 0, 15)
    return _dequantize_affine_tinygemm(q, block, scale, zero, torch.int32, 0, 15, output_dtype=weight.dtype)


# --- 3. GPTQ / compressed-tensors pack-quantized int4 ------------------------------------------------------


class PackedInt4Linear(nn.Module):
    """int4 weight-only linear, weight packed eight to an int32 along K (GPTQ / compressed-tensors).

    Source: the "pack-quantized" int4 format of compressed-tensors checkpoints (llm-compressor W4A16)
    and GPTQ checkpoints in `[N, K]` orientation (GPTQModel's v2 format): `qweight` int32 `[N, K / 8]`,
    eight unsigned 4-bit values per word along K, value i in bits 4i..4i+3. Unpack:
    `(qweight.unsqueeze(-1) >> shifts) & 0xF` with `shifts = [0, 4, ..., 28]`, reshape to `[N, K]`.
    - symmetric: uint4 with offset 8, `q - 8` (no zero point stored);
    - asymmetric: a zero point per group, packed the same way along N: int32 `[N / 8, K / g]`;
      `zeros_minus_one`: the old GPTQ convention, zeros stored minus one (`zero = stored + 1`).
    Group scales `[N, K / g]` (`group_size=None`: per channel, g = K) in the model dtype, applied by
    reshaping the weight to `[N, K / g, g]` (`scale_expand="reshape"`) or with
    `scale.repeat_interleave(g, 1)` (`"repeat_interleave"`). `act_order`: GPTQ's desc_act, a
    `g_idx [K]` gives each input channel its group: `scale[:, g_idx]`, `zero[:, g_idx]` (gathers).
    Math: w[n, k] = (q[n, k] - z[n, group(k)]) * s[n, group(k)]; y = F.linear(x, w.to(x.dtype), bias).
    """

    def __init__(self, qweight, scales, qzeros, g_idx, bias, group_size: int, zeros_minus_one: bool,
                 scale_expand: str) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # int32 [N, K / 8]
        self.register_buffer("scales", scales)  # [N, K / g]
        self.register_buffer("qzeros", qzeros)  # int32 [N / 8, K / g] or None (symmetric)
        self.register_buffer("g_idx", g_idx)  # int32 [K] or None
        self.register_buffer("bias", bias)
        self.register_buffer("shifts", torch.tensor(INT4_SHIFTS, dtype=torch.int32))
        self.group_size, self.zeros_minus_one, self.scale_expand = group_size, zeros_minus_one, scale_expand

    def unpacked_zeros(self) -> torch.Tensor:
        """`[N, K / g]`: the packed zero points (asymmetric only)."""
        zeros = (self.qzeros.unsqueeze(1) >> self.shifts[:, None]) & 0xF  # [N / 8, 8, K / g]
        zeros = zeros.reshape(-1, self.qzeros.shape[-1])
        return zeros + 1 if self.zeros_minus_one else zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_features = self.qweight.shape[0]
        q = (self.qweight.unsqueeze(-1) >> self.shifts) & 0xF  # [N, K / 8, 8]
        q = q.reshape(out_features, -1)  # [N, K]
        in_features, g = q.shape[1], self.group_size
        if self.g_idx is not None:
            group = self.g_idx.long()
            zeros = None if self.qzeros is None else self.unpacked_zeros()[:, group]
            weight = ((q - 8) if zeros is None else (q - zeros)) * self.scales[:, group]
        elif self.scale_expand == "repeat_interleave":
            zeros = None if self.qzeros is None else self.unpacked_zeros().repeat_interleave(g, 1)
            weight = ((q - 8) if zeros is None else (q - zeros)) * self.scales.repeat_interleave(g, 1)
        else:
            grouped = q.reshape(out_features, in_features // g, g)
            shifted = grouped - 8 if self.qzeros is None else grouped - self.unpacked_zeros().unsqueeze(-1)
            weight = (shifted * self.scales.unsqueeze(-1)).reshape(out_features, in_features)
        return F.linear(x, weight.to(x.dtype), self.bias)


def gptq_packed_int4(dtype: torch.dtype, group_size: int | None = 32, symmetric: bool = True, act_order: bool = False,
                     zeros_minus_one: bool = False, scale_expand: str = "reshape", in_features: int = 256,
                     out_features: int = 128, bias: bool = True, seed: int = 0):
    """A `PackedInt4Linear` with random 4-bit values, scales and zero points."""
    generator = torch.Generator().manual_seed(seed)
    g = group_size or in_features
    groups = in_features // g
    q = _random_int4(out_features, in_features, generator)
    scales = ((torch.rand(out_features, groups, generator=generator) + 0.5) / 16).to(dtype)
    zeros = None if symmetric else torch.randint(1, 16, (out_features, groups), generator=generator, dtype=torch.int32)
    if act_order:  # desc_act: input channels reach their group in a permuted order
        group_of = (torch.arange(in_features) // g)[torch.randperm(in_features, generator=generator)].to(torch.int32)
    else:
        group_of = torch.arange(in_features, dtype=torch.int32) // g
    stored_zeros = None if zeros is None else pack_int4_along_first(zeros - 1 if zeros_minus_one else zeros)
    model = PackedInt4Linear(pack_int4_along_last(q), scales, stored_zeros, group_of if act_order else None,
                             _bias(out_features, generator, dtype, bias), g, zeros_minus_one, scale_expand).eval()
    per_k = group_of.long()
    zero_of = torch.full((out_features, groups), 8) if zeros is None else zeros
    model.reference_weight = (q - zero_of[:, per_k]).double() * scales[:, per_k].double()
    return model


class IntxInt4Linear(nn.Module):
    """torchao's int4 "intx" weight, written out: int4 values stored one per int8 (`IntxUnpackedToInt8Tensor`).

    Source: torchao's `IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(g))` and the
    weight of `Int8DynamicActivationIntxWeightConfig` ("8da4w"), whose linear dequantizes as
    `IntxUnpackedToInt8Tensor.dequantize` does: the int8 values viewed as [N, K / g, g] and the int8
    zero points and scales as [N, K / g, 1], both cast to the model dtype, subtracted, multiplied,
    viewed back to [N, K] (tests/peers/test_torchao.py runs torchao's own; this one takes any values,
    out of int4's range included, to test what int8 storage does not prove).
    Math: w[n, k] = (q[n, k] - zp[n, k // g]) * s[n, k // g]; y = F.linear(x, w, bias).
    """

    def __init__(self, qdata, scale, zero_point, bias, group_size: int) -> None:
        super().__init__()
        self.register_buffer("qdata", qdata)  # int8 [N, K]
        self.register_buffer("scale", scale)  # [N, K / g] in the model dtype
        self.register_buffer("zero_point", zero_point)  # int8 [N, K / g], or None
        self.register_buffer("bias", bias)
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.qdata.shape
        groups = k // self.group_size
        values = self.qdata.view(n, groups, self.group_size).to(x.dtype)
        if self.zero_point is not None:
            values = values - self.zero_point.view(n, groups, 1).to(x.dtype)
        weight = (values * self.scale.view(n, groups, 1)).view(n, k)
        return F.linear(x, weight, self.bias)


def torchao_intx_int4(dtype: torch.dtype, group_size: int = 32, zero_points: str = "zero", values: str = "int4",
                      in_features: int = 256, out_features: int = 128, bias: bool = True, seed: int = 0):
    """An `IntxInt4Linear`. `zero_points`: "zero" (torchao's symmetric default stores zeros), "int4"
    (asymmetric, in [-8, 7]), "wide" (in [-100, 100]) or "none" (no subtraction); `values`: "int4"
    ([-8, 7]) or "int8" (the whole int8 range: what the storage allows)."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    low, high = (-8, 8) if values == "int4" else (-128, 128)
    q = torch.randint(low, high, (out_features, in_features), generator=generator, dtype=torch.int8)
    scales = ((torch.rand(out_features, groups, generator=generator) + 0.5) / 16).to(dtype)
    zero_range = {"zero": (0, 1), "int4": (-8, 8), "wide": (-100, 101), "none": None}[zero_points]
    zeros = None if zero_range is None else torch.randint(*zero_range, (out_features, groups), generator=generator,
                                                          dtype=torch.int8)
    model = IntxInt4Linear(q, scales, zeros, _bias(out_features, generator, dtype, bias), group_size).eval()
    group = torch.arange(in_features) // group_size
    difference = q.double() - (0 if zeros is None else zeros[:, group].double())
    model.reference_weight = difference * scales[:, group].double()
    return model


class W4A8Linear(nn.Module):
    """W4A8 (int4 weights, int8 activations) in plain torch: the activation fake-quantized per token
    (symmetric: round(x / s) clamped to int8, times s; `divisor` 127 as vLLM, 127.5 as torchao's
    symmetric mapping; `activation_zero_point` adds torchao's asymmetric form), then `weight`, an
    `IntxInt4Linear` (int4 values in int8 storage, group scales), dequantizes and runs the float
    linear; `static_scale`: one calibrated scale instead of the per-token one. Not a weight-only form: qfuse
    reads it as W4A8 (qfuse/passes/forms/w4a8.py) where a kernel runs that, else as int4 weight-only
    (tests/passes/test_w4a8.py)."""

    def __init__(self, weight: nn.Module, divisor: float = 127.0, activation_zero_point: bool = False,
                 static_scale: float | None = None) -> None:
        super().__init__()
        self.weight_linear, self.divisor, self.activation_zero_point = weight, divisor, activation_zero_point
        self.static_scale = static_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = (x.abs().amax(-1, keepdim=True).clamp(min=1e-5) / self.divisor if self.static_scale is None
                 else self.static_scale)
        if self.activation_zero_point:
            zero_point = torch.round(-x.amin(-1, keepdim=True) / scale) - 128
            q = torch.clamp(torch.round(x / scale) + zero_point, -128, 127)
            return self.weight_linear((q - zero_point) * scale)
        return self.weight_linear(torch.clamp(torch.round(x / scale), -128, 127) * scale)


class AutoGptqLinear(nn.Module):
    """int4 GPTQ linear in the classic AutoGPTQ checkpoint layout (`[K, N]` orientation).

    Source: the GPTQ format most Hugging Face GPTQ checkpoints use (AutoGPTQ's QuantLinear, torch
    path): `qweight` int32 `[K / 8, N]` packed along K (value 8r + i of column n in bits 4i of word
    `[r, n]`), `qzeros` int32 `[K / g, N / 8]` packed along N and stored MINUS ONE (the "+1"
    convention, added before the mask: `zero = ((stored >> shift) + 1) & 0xF`), `scales [K / g, N]`,
    `g_idx [K]` (group of each input channel; act-order checkpoints permute it). Written as AutoGPTQ
    writes it: `torch.bitwise_right_shift` of the words unsqueezed and expanded against `wf`, the
    shifts as an int32 `[1, 8]` buffer, the shifted words cast to int8 before `torch.bitwise_and`
    (the low bits survive the cast). Dequantize to `[K, N]` and multiply:
    w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]; y = matmul(x, w) + bias.
    """

    def __init__(self, qweight, qzeros, scales, g_idx, bias) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # int32 [K / 8, N]
        self.register_buffer("qzeros", qzeros)  # int32 [K / g, N / 8]
        self.register_buffer("scales", scales)  # [K / g, N]
        self.register_buffer("g_idx", g_idx)  # int32 [K]
        self.register_buffer("bias", bias)
        self.register_buffer("wf", torch.tensor(INT4_SHIFTS, dtype=torch.int32).unsqueeze(0))  # [1, 8]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        zeros = torch.bitwise_right_shift(torch.unsqueeze(self.qzeros, 2).expand(-1, -1, 8),
                                          self.wf.unsqueeze(0)).to(torch.int8)  # [K / g, N / 8, 8]
        zeros = zeros + 1
        zeros = torch.bitwise_and(zeros, 0xF).reshape(self.scales.shape)  # [K / g, N]
        weight = torch.bitwise_right_shift(torch.unsqueeze(self.qweight, 1).expand(-1, 8, -1),
                                           self.wf.unsqueeze(-1)).to(torch.int8)  # [K / 8, 8, N]
        weight = torch.bitwise_and(weight, 0xF)
        weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])  # [K, N]
        group = self.g_idx.long()
        weight = self.scales[group] * (weight - zeros[group])
        out = torch.matmul(x, weight.to(x.dtype))
        return out if self.bias is None else out + self.bias


def autogptq_int4(dtype: torch.dtype, group_size: int = 64, act_order: bool = False, in_features: int = 256,
                  out_features: int = 128, bias: bool = True, seed: int = 0):
    """An `AutoGptqLinear` with random values; zero points drawn in 1..15 (stored as 0..14)."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    q = _random_int4(in_features, out_features, generator)  # [K, N]
    zeros = torch.randint(1, 16, (groups, out_features), generator=generator, dtype=torch.int32)
    scales = ((torch.rand(groups, out_features, generator=generator) + 0.5) / 16).to(dtype)
    group_of = torch.arange(in_features, dtype=torch.int32) // group_size
    if act_order:
        group_of = group_of[torch.randperm(in_features, generator=generator)]
    model = AutoGptqLinear(pack_int4_along_first(q), pack_int4_along_last(zeros - 1), scales, group_of,
                           _bias(out_features, generator, dtype, bias)).eval()
    per_k = group_of.long()
    model.reference_weight = ((q - zeros[per_k]).double() * scales[per_k].double()).t()
    return model


class CompressedTensorsPackedLinear(nn.Module):
    """int4 W4A16 linear exactly as compressed-tensors 0.20 decompresses it, in the forward.

    Source: compressed-tensors' "pack-quantized" compressor (`PackedQuantizationCompressor`). The
    builder quantizes and packs with compressed-tensors itself (`calculate_qparams`, `compress`):
    `weight_packed` int32 `[N, K / 8]` (its `pack_to_int32`: the values offset by 8 and packed
    densely, 4-bit value i in bits 4i), `weight_scale [N, K / g]` (group) or `[N, 1]` (channel), an
    asymmetric zero point int32 `[N / 8, K / g]` packed along N. The forward calls its
    `unpack_from_int32` (for 4 bits: view the int32 words as bytes, `byte & 0xF` and `byte >> 4`,
    stacked, viewed as int8, minus 8) and its `dequantize` (group: `x_q.unflatten(-1, (K / g, g))`,
    `(x_q.to(scale.dtype) - zp) * scale.unsqueeze(-1)`, flatten), then `F.linear`: what
    `decompress` + `nn.Linear.forward` compute. The one change: the weight shape is a Python tuple;
    compressed-tensors keeps it as a tensor (`weight_shape`), and `int(shape[1])` on it inside
    `unpack_from_int32` is a `Tensor.item()` graph break (`compressed_tensors_decompress_forward`
    keeps that and breaks).
    """

    def __init__(self, state: dict, scheme, in_features: int, out_features: int, bias) -> None:
        super().__init__()
        self.register_buffer("weight_packed", state["weight_packed"])
        self.register_buffer("weight_scale", state["weight_scale"])
        self.register_buffer("weight_zero_point", state.get("weight_zero_point"))
        self.register_buffer("weight_shape", state["weight_shape"])
        self.register_buffer("bias", bias)
        self.scheme, self.weight_shape_tuple = scheme, (out_features, in_features)

    def dequantized_weight(self) -> torch.Tensor:
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        args = self.scheme.weights
        zero_point = None
        if self.weight_zero_point is not None:
            zero_shape = (self.weight_shape_tuple[0], self.weight_scale.shape[-1])
            zero_point = unpack_from_int32(self.weight_zero_point, args.num_bits, zero_shape, packed_dim=0)
        unpacked = unpack_from_int32(self.weight_packed, args.num_bits, self.weight_shape_tuple)
        return dequantize(x_q=unpacked, scale=self.weight_scale, zero_point=zero_point, args=args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(), self.bias)


def compressed_tensors_w4a16(dtype: torch.dtype, strategy: str = "group", group_size: int = 64, symmetric: bool = True,
                             in_features: int = 256, out_features: int = 128, bias: bool = True, seed: int = 0):
    """A float weight quantized and packed by compressed-tensors 0.20 (min/max qparams per group or
    per channel, as llm-compressor's default observer computes them) in a `CompressedTensorsPackedLinear`.
    `reference_weight` is compressed-tensors' own `decompress` of the same state."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group_size if strategy == "group" else None)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)
    grouped = weight.reshape(out_features, -1, group_size if strategy == "group" else in_features)
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    state = PackedQuantizationCompressor.compress(
        {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, scheme)
    model = CompressedTensorsPackedLinear(state, scheme, in_features, out_features,
                                          _bias(out_features, generator, dtype, bias)).eval()
    model.reference_weight = PackedQuantizationCompressor.decompress(dict(state), scheme)["weight"].double()
    return model


def compressed_tensors_decompress_forward(model: CompressedTensorsPackedLinear):
    """`x -> F.linear(x, PackedQuantizationCompressor.decompress(state)["weight"], bias)`: compressed-
    tensors' own decompress in the forward, with its `weight_shape` tensor (graph-breaks in Dynamo)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    state = {name: buffer for name, buffer in model.named_buffers() if name != "bias"}

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = PackedQuantizationCompressor.decompress(state, model.scheme)["weight"]
        return F.linear(x, weight, model.bias)

    return forward


# --- 4. AWQ ----------------------------------------------------------------------------------------------


class AwqGemmLinear(nn.Module):
    """int4 AWQ linear, GEMM layout (AutoAWQ `WQLinear_GEMM` checkpoints), dequantized in torch.

    Source: AutoAWQ's GEMM checkpoint format and its torch dequantize (`dequantize_gemm`, used where
    its kernels are missing): `qweight` int32 `[K, N / 8]` packed along N, eight consecutive output
    channels per word in AWQ's interleaved order: nibble i (bits 4i..4i+3) holds channel 8j + [0, 2,
    4, 6, 1, 3, 5, 7][i]; `qzeros` int32 `[K / g, N / 8]` packed the same way; `scales [K / g, N]`.
    `unpack_order="index"` is AutoAWQ's spelling: shift by `arange(0, 32, 4)`, cast to int8, view as
    `[K, N]`, undo the order with a gather over N by `arange(N).view(-1, 8)[:, [0, 4, 1, 5, 2, 6, 3,
    7]].view(-1)` (the Python list a constant of the graph), then `& 0xF`. `"shifts"`: the order
    folded into the shift amounts, `shifts = 4 * [0, 4, 1, 5, 2, 6, 3, 7]`, as vLLM's AWQ dequantize
    kernel writes it. Group scales and zeros expand with `repeat_interleave(g, 0)`.
    Math: w[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]; y = matmul(x, w) + bias.
    """

    def __init__(self, qweight, qzeros, scales, bias, group_size: int, unpack_order: str) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # int32 [K, N / 8]
        self.register_buffer("qzeros", qzeros)  # int32 [K / g, N / 8]
        self.register_buffer("scales", scales)  # [K / g, N]
        self.register_buffer("bias", bias)
        self.register_buffer("shifts", torch.tensor([4 * nibble for nibble in AWQ_UNPACK_ORDER], dtype=torch.int32))
        self.group_size, self.unpack_order = group_size, unpack_order

    def unpack_in_order(self, packed: torch.Tensor) -> torch.Tensor:
        """AutoAWQ's `unpack_awq` + `reverse_awq_order` + mask, for the words or the zero points."""
        shifts = torch.arange(0, 32, 4, device=packed.device)
        values = torch.bitwise_right_shift(packed[:, :, None], shifts[None, None, :]).to(torch.int8)
        values = values.view(values.shape[0], -1)
        order = torch.arange(values.shape[-1], dtype=torch.int32, device=packed.device)
        order = order.view(-1, 8)[:, list(AWQ_UNPACK_ORDER)].view(-1)
        return torch.bitwise_and(values[:, order], 0xF)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        if self.unpack_order == "index":
            return self.unpack_in_order(packed)
        values = torch.bitwise_and(torch.bitwise_right_shift(packed.unsqueeze(-1), self.shifts), 0xF)
        return values.reshape(packed.shape[0], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, zeros = self.unpack(self.qweight), self.unpack(self.qzeros)
        scales = self.scales.repeat_interleave(self.group_size, 0)
        weight = (weight - zeros.repeat_interleave(self.group_size, 0)) * scales  # [K, N]
        out = torch.matmul(x, weight.to(x.dtype))
        return out if self.bias is None else out + self.bias


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int32 `[R, N]` of values 0..15 -> AWQ-packed int32 `[R, N / 8]` (interleaved channel order)."""
    rows, cols = values.shape
    reordered = values.reshape(rows, cols // 8, 8)[..., list(AWQ_PACK_ORDER)]
    return pack_int4_along_last(reordered.reshape(rows, cols))


def awq_int4(dtype: torch.dtype, group_size: int = 64, unpack_order: str = "index", in_features: int = 256,
             out_features: int = 128, bias: bool = True, seed: int = 0):
    """An `AwqGemmLinear` with random values (asymmetric: AWQ always stores zero points)."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    q = _random_int4(in_features, out_features, generator)  # [K, N]
    zeros = _random_int4(groups, out_features, generator)
    scales = ((torch.rand(groups, out_features, generator=generator) + 0.5) / 16).to(dtype)
    model = AwqGemmLinear(pack_awq(q), pack_awq(zeros), scales, _bias(out_features, generator, dtype, bias),
                          group_size, unpack_order).eval()
    per_k = torch.arange(in_features) // group_size
    model.reference_weight = ((q - zeros[per_k]).double() * scales[per_k].double()).t()
    return model


# --- 5. transformers ------------------------------------------------------------------------------------


def transformers_gemma_quantized_linear(dtype: torch.dtype, num_bits: int = 8, in_features: int = 64,
                                        out_features: int = 128, bias: bool = True, seed: int = 0):
    """transformers 5.23's own pure-torch weight-only linear: `integrations.gemma_quant.QuantizedLinear`.

    Source: what `GemmaQuantizationConfig` (quant_method "gemma", pre-quantized Gemma checkpoints)
    loads every linear into; it needs no package beyond torch and runs on CPU. int8 weight `[N, K]`,
    or int4 / int2 packed in uint8 `[N, K / 2]` (int4: low nibble = even input channel, high nibble =
    odd one, stored unsigned with offset 8; unpack `(p & 0xF).to(int8) - 8`, `(p >> 4).to(int8) - 8`,
    stacked); `weight_scale [N, 1]` per channel. Forward: `F.linear(srq(x), q.to(dt) * scale.to(dt),
    bias)` then `srq(out)`, where `srq` (static range quantization) rounds to an int8 grid only when
    its scale parameter is non-zero: `torch.where(scale != 0, round(x / s).clamp(-128, 127) * s, x)`.
    A weight-only checkpoint leaves those scales 0, so the graph keeps two `where`-guarded fake
    quants that select `x` at run time. This builds the real class (int4: packed by this builder).
    """
    from transformers.integrations.gemma_quant import QuantizedLinear

    generator = torch.Generator().manual_seed(seed)
    model = QuantizedLinear(in_features, out_features, bias=bias, num_bits=num_bits)
    low, high = (-8, 7) if num_bits == 4 else (-127, 127)
    q = torch.randint(low, high + 1, (out_features, in_features), generator=generator, dtype=torch.int8)
    scale = (torch.rand(out_features, 1, generator=generator) + 0.5) / (16 if num_bits == 4 else 256)
    with torch.no_grad():
        if num_bits == 4:
            unsigned = (q + 8).to(torch.uint8)
            model.weight.data = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
        else:
            model.weight.data = q
        model.weight_scale.copy_(scale)
        if bias:
            model.bias.copy_(torch.randn(out_features, generator=generator) / 4)
    model = model.to(dtype).eval()  # float parameters only: the packed integer weight stays as it is
    model.reference_weight = q.double() * model.weight_scale.double()
    return model


# --- 6. fp8 weight-only (W8A16: vLLM's Marlin fp8 row, the fp8 block checkpoints without fp8 activations)


class Fp8WeightOnlyLinear(nn.Module):
    """An fp8 e4m3fn weight dequantized in float32 in the forward, then cast to the activation's dtype.

    Source: what a model that loads an fp8 checkpoint but has no fp8 GEMM runs (vLLM's Marlin fp8
    kernel computes the same linear for GPUs without fp8 tensor cores). Scales:
    - "channel": `weight_scale` [N, 1] (compressed-tensors' fp8 "channel" strategy);
    - "block_repeat": `weight_scale_inv` [ceil(N / 128), ceil(K / 128)], expanded the way vLLM's and
      SGLang's `block_quant_dequant` helpers write it: `repeat_interleave(128)` along both axes, then
      sliced to [N, K];
    - "block_view": the same scale against a `[N / 128, 128, K / 128, 128]` view of the weight, the way
      transformers' fine-grained fp8 dequantize writes it (N and K multiples of 128).
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, scales: str) -> None:
        super().__init__()
        self.scales = scales
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:
        n, k = self.weight.shape
        if self.scales == "channel":
            return self.weight.to(torch.float32) * self.weight_scale
        if self.scales == "block_repeat":
            expanded = self.weight_scale.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
            return self.weight.to(torch.float32) * expanded[:n, :k]
        blocks = self.weight.to(torch.float32).view(n // 128, 128, k // 128, 128)
        return (blocks * self.weight_scale[:, None, :, None]).view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)


def fp8_weight_only(dtype: torch.dtype, scales: str = "block_repeat", in_features: int = 256, out_features: int = 384,
                    bias: bool = True, seed: int = 0) -> Fp8WeightOnlyLinear:
    """`Fp8WeightOnlyLinear` with random fp8 values and positive scales; `reference_weight` is the
    float64 product of the stored fp8 values and their scales."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) * 64).clamp(-448, 448)
    weight = weight.to(torch.float8_e4m3fn)
    if scales == "channel":
        scale = torch.rand(out_features, 1, generator=generator) / 256 + 1e-3
        expanded = scale.double()
    else:
        blocks = (-(-out_features // 128), -(-in_features // 128))
        scale = torch.rand(*blocks, generator=generator) / 256 + 1e-3
        expanded = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_features, :in_features]
    model = Fp8WeightOnlyLinear(weight, scale, _bias(out_features, generator, dtype, bias), scales).eval()
    model.reference_weight = weight.double() * expanded
    return model
