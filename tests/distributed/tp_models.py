"""Tensor-parallel quantized Llama blocks, as vLLM's parallel layers compute them, on plain functional
collectives (issue #17): a Llama MLP block, and the tiny two-layer HF Llama of tests/peers/hf_llama.py
with its decoder linears quantized and sharded. This module does not import qfuse.

    gate, up   column-parallel: rank r holds output rows [r N / tp, (r + 1) N / tp) of the int8 / fp8
               weight and of its per-channel scale; its input is the whole (replicated) activation
    down       row-parallel: rank r holds input columns [r K / tp, (r + 1) K / tp) of the weight (the
               per-channel scale is whole: it belongs to the output rows), its input is the rank's
               own slice of SiLU(gate) * up, and its partial sums are added across ranks by
               `torch.distributed._functional_collectives.all_reduce`

In the Llama, q / k / v_proj are column-parallel too (whole heads per rank: 4 heads and 2 KV heads
over 2 ranks leave 2 and 1, the same GQA groups), o_proj is row-parallel with its all-reduce; the
embedding, the norms and lm_head are replicated.

Each linear is `ReferenceW8A8Linear` (tests/peers/hf_llama.py: dynamic per-token int8, `_int_mm`) or
`ReferenceFp8Linear` below (dynamic per-token fp8, `torch._scaled_mm` with row-wise scales). The
row-parallel linear quantizes its local input per token, as vLLM does, so a sharded block is not
bit-equal to the unsharded quantized one: what is checked exactly is the compiled shard against
the same shard in eager; the sharded block against the unsharded float one within quantization error.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.peers.hf_llama import ReferenceW8A8Linear

FP8 = torch.float8_e4m3fn


class ReferenceFp8Linear(nn.Module):
    """W8A8 fp8 in plain torch: dynamic per-token fp8 activations, per-channel fp8 weights, `_scaled_mm`."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("weight", weight_fp8)  # [N, K]
        self.register_buffer("weight_scale", weight_scale)  # [N] float32
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "ReferenceFp8Linear":
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 448
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls((weight / scale[:, None]).clamp(-448, 448).to(FP8), scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        scale = x2.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / 448
        q = (x2 / scale).clamp(-448, 448).to(FP8)
        out = torch._scaled_mm(q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale[None, :],
                               out_dtype=torch.float32)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*shape[:-1], -1)


QUANTIZED = {"int8": ReferenceW8A8Linear, "fp8": ReferenceFp8Linear}


def quantized(linear: nn.Linear, scheme: str) -> nn.Module:
    """`linear` in the reference form of `scheme` ("int8", "fp8"), or itself ("float")."""
    return linear if scheme == "float" else QUANTIZED[scheme].from_linear(linear)


def float_mlp(hidden: int = 64, intermediate: int = 128, seed: int = 0) -> nn.ModuleDict:
    torch.manual_seed(seed)
    return nn.ModuleDict({name: nn.Linear(k, n, bias=False) for name, (k, n) in
                          {"gate": (hidden, intermediate), "up": (hidden, intermediate),
                           "down": (intermediate, hidden)}.items()}).eval()


def _shard(linear: nn.Module, rank: int, world: int, along: str) -> nn.Module:
    """This rank's part of a quantized linear (no bias): output rows ("column" parallel) with their
    scales, or input columns ("row") with every output row's scale."""
    rows, columns = linear.weight.shape
    if along == "column":
        part = slice(rank * rows // world, (rank + 1) * rows // world)
        return type(linear)(linear.weight[part].contiguous(), linear.weight_scale[part].contiguous(), None)
    part = slice(rank * columns // world, (rank + 1) * columns // world)
    return type(linear)(linear.weight[:, part].contiguous(), linear.weight_scale.clone(), None)


class TensorParallelMlp(nn.Module):
    """down(SiLU(gate(x)) * up(x)), gate / up column-parallel and down row-parallel over `group`
    (None: one process, no all-reduce: the unsharded block)."""

    def __init__(self, float_block: nn.ModuleDict, scheme: str, rank: int = 0, world: int = 1, group=None) -> None:
        super().__init__()
        for name, along in (("gate", "column"), ("up", "column"), ("down", "row")):
            linear = quantized(float_block[name], scheme)
            setattr(self, name, linear if group is None else _shard(linear, rank, world, along))
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        if self.group is None:
            return partial
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(partial, "sum", self.group)


class AllReduced(nn.Module):
    """A row-parallel linear whose partial sums are added across the ranks of `group`."""

    def __init__(self, linear: nn.Module, group) -> None:
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(self.linear(x), "sum", self.group)


COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def tensor_parallel_llama(scheme: str, rank: int = 0, world: int = 1, group=None, seq: int = 8,
                          dtype: torch.dtype = torch.float32, **sizes):
    """(model, input_ids [1, seq]): the tiny HF Llama of `tiny_llama` (its config sizes overridden by
    `sizes`), its 14 decoder linears quantized by `scheme` ("float" leaves them as they are), each
    replaced by this rank's shard when `group` is given."""
    from tests.peers.hf_llama import tiny_llama

    model, input_ids = tiny_llama(seq=seq, dtype=dtype, **sizes)
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                              (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                linear = quantized(getattr(parent, name), scheme)
                if group is not None:
                    linear = _shard(linear, rank, world, "column" if name in COLUMN_PARALLEL else "row")
                    linear = AllReduced(linear, group) if name in ROW_PARALLEL else linear
                setattr(parent, name, linear)
    return model, input_ids
