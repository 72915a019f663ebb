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
    Partial      Shard(1)     Shard(0)       row-parallel: int32 partial sums

The row-parallel partial sums stay `Partial` through the dequantize epilogue (a product with
replicated scales is still a sum of products), so DTensor all-reduces the layer's float output, as
the hand-sharded model does, and the epilogue stays next to its `_int_mm` in the graph qfuse sees.

`import qfuse` registers it (the backend's entry point imports qfuse too), unless DTensor already
has a strategy for the op (a newer torch, or the user's own), which is then left as it is. If
DTensor's registry is not where this torch version keeps it, nothing is registered and a warning
says so: `import qfuse` never fails for it.
"""

from __future__ import annotations

import warnings

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
    """Give DTensor `aten._int_mm`'s sharding strategy; False where torch.distributed is missing,
    DTensor already has one, or registering failed (with a warning)."""
    if not torch.distributed.is_available():
        return False
    try:
        if has_sharding_strategy(_INT_MM):
            return False
        from torch.distributed.tensor.experimental import register_sharding

        register_sharding(_INT_MM)(int_mm_shardings)
    except Exception as error:  # a torch whose DTensor internals moved: qfuse still imports
        warnings.warn(f"qfuse could not give DTensor a sharding rule for aten._int_mm ({error!r}); an int8 "
                      "linear on DTensors needs one", stacklevel=2)
        return False
    return True
