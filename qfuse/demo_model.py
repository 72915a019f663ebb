"""The demo's model: a small transformer whose linears are W8A8 quantized in plain torch.

`W8A8Linear` is the "reference form" qfuse recognises (see `qfuse.passes.families.reference_linear`):

    weights   quantized once at construction: symmetric per output channel, int8 or fp8 e4m3fn,
              stored [N, K], with a float32 scale [N]
    forward   activations quantized per token at run time (dynamic, symmetric):
                  s = x.abs().amax(-1, keepdim=True).clamp(min=1e-6) / qmax
                  int8: q = clamp(round(x / s), -128, 127).to(int8)
                  fp8:  q = (x / s).clamp(-448, 448).to(float8_e4m3fn)
              matmul: torch._int_mm(q, w.t())  or  torch._scaled_mm(q, w.t(), 1, 1, out_dtype=float32)
              then  y.float() * s * w_scale (+ bias), reshaped back and cast to x's dtype

Nothing here imports qfuse: it is an ordinary model, as a user would write it. `TinyTransformer`
is built in float (`nn.Linear`); `quantize_linears` swaps every `nn.Linear` for a `W8A8Linear`, and
`dequantize_linears` swaps them back for `nn.Linear`s holding the dequantized weights (the float
model with the same weights, to measure the quantization error against).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize_per_channel(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel quantization of a [N, K] weight: (quantized [N, K], scale [N])."""
    weight = weight.detach().to(torch.float32)
    scale = weight.abs().amax(dim=1).clamp(min=1e-6) / QMAX[dtype]
    scaled = weight / scale[:, None]
    if dtype == torch.int8:
        quantized = torch.clamp(torch.round(scaled), -128, 127).to(torch.int8)
    else:
        quantized = scaled.clamp(-448, 448).to(dtype)
    return quantized, scale


class W8A8Linear(nn.Module):
    """y = x @ W.T + b with int8 / fp8 weights (per channel) and activations (per token, dynamic)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.int8) -> None:
        super().__init__()
        if dtype not in QMAX:
            raise ValueError(f"W8A8Linear quantizes to {list(QMAX)}, not {dtype}")
        self.dtype = dtype
        weight_q, weight_scale = quantize_per_channel(weight, dtype)
        self.register_buffer("weight", weight_q)  # [N, K]
        self.register_buffer("weight_scale", weight_scale)  # [N], float32
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> W8A8Linear:
        return cls(linear.weight, linear.bias, dtype)

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.to(torch.float32) * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-6) / QMAX[self.dtype]
        if self.dtype == torch.int8:
            q = torch.clamp(torch.round(x / scale), -128, 127).to(torch.int8)
            y = torch._int_mm(q.reshape(-1, k), self.weight.t())
        else:
            q = (x / scale).clamp(-448, 448).to(self.dtype)
            one = torch.ones((), device=x.device, dtype=torch.float32)
            y = torch._scaled_mm(q.reshape(-1, k), self.weight.t(), one, one, out_dtype=torch.float32)
        y = y.to(torch.float32) * scale.reshape(-1, 1) * self.weight_scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return (x.to(torch.float32) * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight.to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention, written out (no SDPA) so every step is plain torch."""

    def __init__(self, hidden: int, head_dim: int = 64) -> None:
        super().__init__()
        self.heads, self.head_dim = max(1, hidden // head_dim), min(head_dim, hidden)
        inner = self.heads * self.head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, inner) for _ in range(3))
        self.o_proj = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(batch, tokens, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = split_heads(self.q_proj(x)), split_heads(self.k_proj(x)), split_heads(self.v_proj(x))
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).triu(1)
        weights = scores.masked_fill(causal, float("-inf")).softmax(-1)
        return self.o_proj((weights @ v).transpose(1, 2).reshape(batch, tokens, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(hidden), Attention(hidden)
        self.mlp_norm, self.mlp = RMSNorm(hidden), MLP(hidden, 4 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyTransformer(nn.Module):
    """`layers` pre-norm blocks (attention q/k/v/o with bias, MLP up/gate/down without) and a final norm."""

    def __init__(self, hidden: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = RMSNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _swap_linears(model: nn.Module, convert) -> nn.Module:
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = convert(child)
            if replacement is not None:
                setattr(parent, name, replacement)
    return model


def quantize_linears(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `model` with every `nn.Linear` replaced by a `W8A8Linear`."""
    return _swap_linears(model, lambda m: W8A8Linear.from_linear(m, dtype) if isinstance(m, nn.Linear) else None)


def dequantize_linears(model: nn.Module) -> nn.Module:
    """A copy of a quantized `model` with float `nn.Linear`s holding the dequantized weights."""
    def to_float(module: nn.Module) -> nn.Linear | None:
        if not isinstance(module, W8A8Linear):
            return None
        out_features, in_features = module.weight.shape
        linear = torch.nn.utils.skip_init(
            nn.Linear, in_features, out_features, bias=module.bias is not None, device=module.weight.device
        )
        with torch.no_grad():
            linear.weight.copy_(module.dequantized_weight())
            if module.bias is not None:
                linear.bias.copy_(module.bias)
        return linear
    return _swap_linears(model, to_float)
