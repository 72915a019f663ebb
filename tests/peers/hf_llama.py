"""Peer models: a tiny Hugging Face `LlamaForCausalLM` built from a config (no download), plain and
with its decoder linears replaced by quantized ones, on CPU.

- `tiny_llama()`: hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, vocab 128, sdpa
  attention, `use_cache=False`. Seven linears per layer (q/k/v/o_proj, gate/up/down_proj) plus
  `lm_head`; the decoder linears see 3-D `[batch, seq, features]` activations.
- `llama_w8a8_reference()`: every decoder linear replaced by `ReferenceW8A8Linear`, a W8A8 linear
  written in plain torch the way vLLM's torch fallbacks and hand-written models write it:
  dynamic per-token symmetric int8 activations
  (`scale = x.abs().amax(-1, keepdim=True).float().clamp(min=eps) / 127`,
  `q = round(x / scale).clamp(-128, 127).to(int8)`), int8 per-channel weights `[N, K]`,
  `torch._int_mm(q, w.t())`, then `* scale * w_scale`, bias, output cast. This checks that every
  linear of a real HF model (reshapes around the matmul, RMSNorm / SiLU·mul producers) fuses.
- `llama_transformers_fp8()`: every decoder linear replaced by transformers'
  `CompressedTensorsFP8Linear` (what `CompressedTensorsConfig(use_optimized_inference=True)` loads
  an fp8 compressed-tensors checkpoint into on fp8 GPUs): fp8 per-channel weights, dynamic per-row
  fp8 activations, `torch.nn.functional.scaled_mm(..., ScalingType.RowWise, ...)`, which is
  `aten._scaled_mm_v2` in the graph. Runs on CPU here (transformers only refuses it at load time).

Builders return `(model, input_ids [1, seq])`; call `model(input_ids).logits`. `available()` says
whether transformers imports. This module does not import qfuse. Seeded: two calls build the same
model.
"""

from __future__ import annotations

import torch
from torch import nn

DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def available() -> tuple[bool, str]:
    """(True, version) when transformers' Llama imports; otherwise (False, why not)."""
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401
    except Exception as error:  # any import failure means "not available", with its reason
        return False, f"transformers does not import: {type(error).__name__}: {error}"
    return True, f"transformers {transformers.__version__}"


def eager_fp8_runs_on_cpu() -> tuple[bool, str]:
    """(True, '') when eager `torch._scaled_mm` runs on the CPU (torch 2.13 here; torch 2.11, the GPU
    machine's, has it for CUDA only); otherwise (False, why not): the fp8 model's eager output, the
    reference, cannot be computed there."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    one = torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), one, one, out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError) as error:
        return False, f"eager torch._scaled_mm does not run on the CPU with torch {torch.__version__}: {str(error)[:80]}"
    return True, ""


TINY_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 128}


def tiny_llama(seq: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32, **sizes):
    """A randomly initialised tiny `LlamaForCausalLM` in eval mode and a `[1, seq]` input; `sizes`
    override `LlamaConfig` fields of `TINY_SIZES` (a benchmark builds Llama-sized layers this way)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**(TINY_SIZES | sizes), use_cache=False)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(dtype).eval()
    generator = torch.Generator().manual_seed(seed)
    return model, torch.randint(0, config.vocab_size, (1, seq), generator=generator)


class ReferenceW8A8Linear(nn.Module):
    """W8A8 linear in plain torch: dynamic per-token int8 activations, int8 per-channel weights,
    `torch._int_mm`, float epilogue. Built from a float `nn.Linear` by `from_linear`."""

    eps = 1e-8

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight_int8)  # [N, K] int8
        self.register_buffer("weight_scale", weight_scale)  # [N] float32
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "ReferenceW8A8Linear":
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
        weight_int8 = torch.round(weight / scale[:, None]).clamp(-128, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight_int8, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        scale = x2.abs().amax(-1, keepdim=True).float().clamp(min=self.eps) / 127
        q = torch.round(x2 / scale).clamp(-128, 127).to(torch.int8)
        accumulator = torch._int_mm(q, self.weight.t())
        out = accumulator * scale * self.weight_scale
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], -1)


def _replace_decoder_linears(model: nn.Module, make) -> int:
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in DECODER_LINEARS and isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
                replaced += 1
    return replaced


def llama_w8a8_reference(seq: int = 8, seed: int = 0):
    """The tiny Llama with its 14 decoder linears replaced by `ReferenceW8A8Linear`."""
    model, input_ids = tiny_llama(seq=seq, seed=seed)
    count = _replace_decoder_linears(model, ReferenceW8A8Linear.from_linear)
    assert count == 7 * model.config.num_hidden_layers, count
    return model, input_ids


def llama_transformers_fp8(seq: int = 8, seed: int = 0):
    """The tiny Llama with its decoder linears replaced by transformers' `CompressedTensorsFP8Linear`
    (fp8 e4m3 per-channel weights `[N, K]`, `weight_scale [1, N]`, dynamic per-row fp8 inputs)."""
    from transformers.integrations.compressed_tensors import CompressedTensorsFP8Linear

    fp8_max = torch.finfo(torch.float8_e4m3fn).max

    def make(linear: nn.Linear) -> nn.Module:
        new = CompressedTensorsFP8Linear(linear.in_features, linear.out_features, has_bias=linear.bias is not None)
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / fp8_max
        new.weight.data = (weight / scale[:, None]).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
        new.weight_scale.data = scale[None, :].clone()
        if linear.bias is not None:
            new.bias.data = linear.bias.detach().clone()
        return new.eval()

    model, input_ids = tiny_llama(seq=seq, seed=seed)
    _replace_decoder_linears(model, make)
    return model, input_ids
