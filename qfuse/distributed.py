"""DTensor sharding for the quantized GEMM that DTensor lacks: `aten._int_mm`.

A model sharded with `torch.distributed.tensor.parallel` computes on DTensors, and every op it runs
needs a sharding strategy. DTensor has one for `aten.mm` and `aten._scaled_mm` (fp8), none for
`aten._int_mm`, so an int8 W8A8 linear on a sharded weight fails even in eager ("Operator
aten._int_mm.default does not have a sharding strategy registered"). `register_int_mm_sharding`
gives it mm's strategies on each mesh dimension:

    out          a [M, K]     b [K, N]
    Replicate    Replicate    Replicate
    Shard(0)     Shard(0)     Replicate      rows of the activation
    Shard(1)     Replicate    Shard(1)       column-parallel: the weight's output channels
    Partial      Shard(1)     Shard(0)       row-parallel: int32 partial sums, added exactly

`import qfuse` registers it (the backend's entry point imports qfuse too), unless DTensor already
has a strategy for the op (a newer torch, or the user's own), which is then left as it is.
"""

from __future__ import annotations

import torch

_INT_MM = torch.ops.aten._int_mm.default


def has_sharding_strategy(op: torch._ops.OpOverload) -> bool:
    """Whether DTensor knows how to shard `op` (a rule, a strategy or a single-dimension strategy)."""
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    registries = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules")
    return any(op in getattr(propagator, registry, {}) for registry in registries)


def int_mm_shardings(a, b) -> list[tuple[list, list]]:
    """mm's placements for `_int_mm(a, b)`, as `register_sharding` takes them: (output, inputs)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    return [
        ([Replicate()], [Replicate(), Replicate()]),
        ([Shard(0)], [Shard(0), Replicate()]),
        ([Shard(1)], [Replicate(), Shard(1)]),
        ([Partial()], [Shard(1), Shard(0)]),
    ]


def register_int_mm_sharding() -> bool:
    """Give DTensor `aten._int_mm`'s sharding strategy; False where torch.distributed is missing or
    DTensor already has one."""
    if not torch.distributed.is_available():
        return False
    if has_sharding_strategy(_INT_MM):
        return False
    from torch.distributed.tensor.experimental import register_sharding

    register_sharding(_INT_MM)(int_mm_shardings)
    return True
