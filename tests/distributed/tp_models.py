"""Tensor-parallel quantized Llama blocks, as vLLM's parallel layers compute them, on plain functional
collectives (issue #17): a Llama MLP block, and the tiny two-layer HF Llama of tests/peers/hf_llama.py
with its decoder linears quantized and sharded. This module does not import qfuse.

    gate, up   column-parallel: rank r holds output rows [r N / tp, (r + 1) N / tp) of the int8 / fp8
               weight and of its per-channel scale; its input is the whole (replicated) activation
    down       row-parallel: rank r holds input columns [r K / tp, (r + 1) K / tp) of the weight (the
               per-channel scale is whole: it belongs to the output rows; a bias stays on rank 0),
               its input is the rank's own slice of SiLU(gate) * up, and its partial sums are added
               across ranks by `torch.distributed._functional_collectives.all_reduce`
               (tp must divide N and K: the slices are those of DTensor's `Shard`)

In the Llama, q / k / v_proj are column-parallel too (whole heads per rank: 4 heads and 2 KV heads
over 2 ranks leave 2 and 1, the same GQA groups), o_proj is row-parallel with its all-reduce; the
embedding, the norms and lm_head are replicated.

Each linear is `ReferenceW8A8Linear` (tests/peers/hf_llama.py: dynamic per-token int8, `_int_mm`) or
`ReferenceFp8Linear` below (dynamic per-token fp8, `torch._scaled_mm` with row-wise scales). The
row-parallel linear quantizes its local input per token, as vLLM does, so a sharded block is not
bit-equal to the unsharded quantized one: what is checked exactly is the compiled shard against
the same shard in eager; the sharded block against the unsharded float one within quantization error.

The same models sharded with DTensor (`dtensor_mlp`, `dtensor_llama`): `parallelize_module` with
`QuantizedColwiseParallel` / `QuantizedRowwiseParallel`, torch's Colwise / RowwiseParallel for a
quantized linear's tensors (the weight, its per-channel scale and zero point, the bias), as a user
writes them for a module that is not an `nn.Linear`. DTensor computes the unsharded math: the
row-parallel linear's per-token amax is all-reduced (max) before it quantizes, its partial sums stay
`Partial` through the dequantize epilogue and are all-reduced at the output layout; the int8 GEMM
needs qfuse's `_int_mm` sharding rule (qfuse/distributed.py).
"""

from __future__ import annotations

import copy
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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


#: How each tensor of a quantized linear is split, by parallel style: the dimension sharded, or None
#: (whole on every rank). Column-parallel keeps output rows with their per-channel scales and zero
#: points; row-parallel keeps input columns of the weight, and every output row's scale. The names
#: are those of the reference linears (buffers) and of compressed-tensors' (parameters). A
#: row-parallel bias is whole, and added once: by rank 0 in the hand-sharded model (the other ranks
#: hold zeros, so the all-reduce adds it once), after the reduction on DTensors.
SHARD_DIMS = {
    "column": {"weight": 0, "weight_scale": 0, "weight_zero_point": 0, "bias": 0},
    "row": {"weight": 1, "weight_scale": None, "weight_zero_point": None, "bias": None},
}


def _tensors(module: nn.Module):
    """(name, tensor, is_parameter) for the module's own parameters and buffers."""
    yield from ((name, tensor, True) for name, tensor in module.named_parameters(recurse=False))
    yield from ((name, tensor, False) for name, tensor in module.named_buffers(recurse=False) if tensor is not None)


def _replace(module: nn.Module, name: str, tensor: torch.Tensor, is_parameter: bool) -> None:
    if is_parameter:
        module.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    else:
        module.register_buffer(name, tensor)


def _shard(linear: nn.Module, rank: int, world: int, along: str) -> nn.Module:
    """This rank's part of a copy of a quantized linear: each tensor cut along `SHARD_DIMS[along]`."""
    linear = copy.deepcopy(linear)
    for name, tensor, is_parameter in list(_tensors(linear)):
        dim = SHARD_DIMS[along][name]
        if dim is not None:
            if tensor.shape[dim] % world:
                raise ValueError(f"{name} {tuple(tensor.shape)}: dimension {dim} does not split into {world} ranks")
            _replace(linear, name, tensor.chunk(world, dim)[rank].contiguous(), is_parameter)
        elif along == "row" and name == "bias" and rank != 0:
            _replace(linear, name, torch.zeros_like(tensor), is_parameter)
    return linear


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
        partial_sums = self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        if self.group is None:
            return partial_sums
        from torch.distributed import _functional_collectives as funcol

        return funcol.all_reduce(partial_sums, "sum", self.group)


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


PARALLEL_LINEARS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
#: The quantizer: compressed-tensors' W8A8 preset (fake quant, `compile_friendly` forwards; CPU only).
COMPRESSED_TENSORS = "ct_w8a8"


def quantized_llama(scheme: str, seq: int = 8, dtype: torch.dtype = torch.float32, **sizes):
    """(model, input_ids [1, seq]): the tiny HF Llama of `tiny_llama` (its config sizes overridden by
    `sizes`), its 14 decoder linears in the reference form of `scheme` ("float" leaves them as they
    are), or quantized by compressed-tensors (`COMPRESSED_TENSORS`)."""
    from tests.peers.hf_llama import tiny_llama

    if scheme == COMPRESSED_TENSORS:
        from tests.peers.compressed_tensors_models import ct_llama

        if sizes or dtype != torch.float32:
            raise ValueError("the compressed-tensors Llama is the tiny float32 one: no dtype or sizes")
        return ct_llama("W8A8", "qdq", compile_friendly=True, seq=seq)
    model, input_ids = tiny_llama(seq=seq, dtype=dtype, **sizes)
    for layer in model.model.layers:
        for parent_name, names in PARALLEL_LINEARS:
            parent = getattr(layer, parent_name)
            for name in names:
                setattr(parent, name, quantized(getattr(parent, name), scheme))
    return model, input_ids


def tensor_parallel_llama(scheme: str, rank: int = 0, world: int = 1, group=None, seq: int = 8,
                          dtype: torch.dtype = torch.float32, **sizes):
    """(model, input_ids): `quantized_llama`, each decoder linear replaced by this rank's shard when
    `group` is given (row-parallel ones followed by their all-reduce)."""
    model, input_ids = quantized_llama(scheme, seq, dtype, **sizes)
    if group is None:
        return model, input_ids
    for layer in model.model.layers:
        for parent_name, names in PARALLEL_LINEARS:
            parent = getattr(layer, parent_name)
            for name in names:
                linear = _shard(getattr(parent, name), rank, world, "column" if name in COLUMN_PARALLEL else "row")
                setattr(parent, name, AllReduced(linear, group) if name in ROW_PARALLEL else linear)
    return model, input_ids


def _distribute(along: str, src_data_rank: int | None, name: str, module: nn.Module, mesh) -> None:
    """A `distribute_module` partition function: each tensor placed by `SHARD_DIMS[along]`, from
    `src_data_rank` as torch's styles do (None: each rank keeps its own shard of its own copy)."""
    for tensor_name, tensor, is_parameter in list(_tensors(module)):
        dim = SHARD_DIMS[along][tensor_name]
        placement = Replicate() if dim is None else Shard(dim)
        _replace(module, tensor_name, distribute_tensor(tensor, mesh, [placement], src_data_rank=src_data_rank),
                 is_parameter)


class QuantizedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a quantized linear: its weight, scales, zero points and bias by output rows."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, partial(_distribute, "column", self.src_data_rank),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class QuantizedRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a quantized linear: the weight by input columns; scales and bias whole."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(module, device_mesh, partial(_distribute, "row", self.src_data_rank),
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


SHARDINGS = ("funcol", "dtensor")  # by hand on functional collectives; by parallelize_module on DTensors

#: Every rank builds the whole quantized model from the same seed, so each keeps its own shard: no
#: scatter from rank 0 (which gloo cannot do for fp8).
SRC_DATA_RANK = None


def dtensor_mlp(float_block: nn.ModuleDict, scheme: str, mesh) -> nn.Module:
    """The quantized block sharded by `parallelize_module` on `mesh`'s device: gate / up column-, down row-parallel."""
    block = TensorParallelMlp(copy.deepcopy(float_block), scheme).to(mesh.device_type)
    return parallelize_module(block, mesh, {"gate": QuantizedColwiseParallel(), "up": QuantizedColwiseParallel(),
                                            "down": QuantizedRowwiseParallel()}, src_data_rank=SRC_DATA_RANK)


def dtensor_llama(scheme: str, mesh, seq: int = 8, dtype: torch.dtype = torch.float32, **sizes):
    """(model, input_ids) on `mesh`'s device: `quantized_llama(scheme)` sharded by `parallelize_module`,
    whole heads per rank."""
    model, input_ids = quantized_llama(scheme, seq, dtype, **sizes)
    model, input_ids = model.to(mesh.device_type), input_ids.to(mesh.device_type)
    plan = {f"model.layers.*.{parent}.{name}": QuantizedColwiseParallel() if name in COLUMN_PARALLEL
            else QuantizedRowwiseParallel()
            for parent, names in PARALLEL_LINEARS for name in names}
    return parallelize_module(model, mesh, plan, src_data_rank=SRC_DATA_RANK), input_ids
