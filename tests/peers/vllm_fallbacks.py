"""W8A8 fp8 linears written the way vLLM's torch fallbacks write them (seeds 001 / 003, `w8a8_utils`).

Written by the team from the seeds' description; it imports nothing of qfuse or vLLM.

    weight      fp8 e4m3fn, stored [N, K] and handed to the GEMM as `weight.t()` ([K, N], column-major)
    w_scale     float32 [N, 1] per channel, or [1] per tensor
    activation  dynamic per token: amax in float32, scale clamped from below, x * (1 / scale)
                (vLLM's native quant), or static per tensor: a stored [1] scale
    padding     `num_token_padding=17`: the token dim is padded before the GEMM and cut back with
                `torch.narrow` (vLLM does this outside torch.compile; both forms are here)

    per-tensor    _scaled_mm(q, w, scale_a, scale_b, bias=bias, out_dtype) -> narrow -> view
    row-wise      _scaled_mm(q, w, scale_a [M, 1], scale_b.t() [1, N], bias=bias, out_dtype) -> narrow -> view
    channelwise   _scaled_mm(q, w, IDENTITY, IDENTITY, out_dtype=float32) -> narrow,
                  then output * x_scale * scale_b.t() (+ bias), .to(out_dtype).view(...)
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
TOKEN_PADDING = 17
KINDS = ("per_tensor", "row_wise", "channelwise")


def quantize_fp8_per_token(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM-style native dynamic per-token fp8 quant: float32 scale [M, 1], multiply by its reciprocal."""
    amax = x2d.abs().amax(dim=-1, keepdim=True).to(torch.float32)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    q = (x2d.to(torch.float32) * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_fp8_static(x2d: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x2d.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class VllmFp8Linear(nn.Module):
    """One fp8 linear in one of vLLM's three torch fallback forms."""

    def __init__(self, in_features: int, out_features: int, kind: str, dynamic: bool = True,
                 pad_tokens: bool = False, bias: bool = True, seed: int = 0) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
        per_channel = kind != "per_tensor"
        w_scale = (weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax().reshape(1)) / FP8_MAX
        self.register_buffer("weight", (weight / w_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8))  # [N, K]
        self.register_buffer("weight_scale", w_scale.to(torch.float32))  # [N, 1] or [1]
        self.register_buffer("input_scale", None if dynamic else torch.tensor([0.02]))
        self.register_buffer("bias", torch.randn(out_features, generator=generator) if bias else None)
        self.register_buffer("identity", torch.ones(1, dtype=torch.float32))  # TORCH_DEVICE_IDENTITY
        self.kind, self.pad_tokens = kind, pad_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_2d = x.reshape(-1, x.shape[-1])
        output_shape = [*x.shape[:-1], self.weight.shape[0]]
        padded = input_2d
        if self.pad_tokens and input_2d.shape[0] < TOKEN_PADDING:
            padded = nn.functional.pad(input_2d, (0, 0, 0, TOKEN_PADDING - input_2d.shape[0]))
        if self.input_scale is None:
            qinput, x_scale = quantize_fp8_per_token(padded)
        else:
            qinput, x_scale = quantize_fp8_static(padded, self.input_scale), self.input_scale
        weight, bias, out_dtype = self.weight.t(), None if self.bias is None else self.bias.to(x.dtype), x.dtype
        if self.kind == "per_tensor":
            output = torch._scaled_mm(qinput, weight, scale_a=x_scale, scale_b=self.weight_scale,
                                      bias=bias, out_dtype=out_dtype)
            return torch.narrow(output, 0, 0, input_2d.shape[0]).view(*output_shape)
        if self.kind == "row_wise":
            output = torch._scaled_mm(qinput, weight, scale_a=x_scale, scale_b=self.weight_scale.t(),
                                      bias=bias, out_dtype=out_dtype)
            return torch.narrow(output, 0, 0, input_2d.shape[0]).view(*output_shape)
        output = torch._scaled_mm(qinput, weight, scale_a=self.identity, scale_b=self.identity,
                                  out_dtype=torch.float32)
        output = torch.narrow(output, 0, 0, input_2d.shape[0])
        x_scale = torch.narrow(x_scale, 0, 0, input_2d.shape[0]) if x_scale.numel() > 1 else x_scale
        output = output * x_scale * self.weight_scale.t()
        if bias is not None:
            output = output + bias
        return output.to(out_dtype).view(*output_shape)
