"""One rank of the tensor-parallel checks (tests/distributed/test_tensor_parallel.py), spawned by
`torch.multiprocessing` on the gloo backend: builds the sharded block, runs it eagerly and compiled
with backend="qfuse" (fullgraph: no graph break), and writes what it saw to `<out>/rank<r>.json`."""

from __future__ import annotations

import json
import os

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed import tp_models
from tests.distributed.tp_models import (SHARDINGS, TensorParallelMlp, dtensor_llama, dtensor_mlp, float_mlp,
                                        quantized_llama, tensor_parallel_llama)
from tests.helpers import FLOAT_WRITTEN_INT8


@dataclass
class Case:
    sharded: nn.Module  # this rank's shard, quantized
    unsharded_quantized: nn.Module
    unsharded_float: nn.Module
    run: Callable[[nn.Module], torch.Tensor]  # the module on the case's input


def build_case(model: str, scheme: str, sharding: str, rank: int, world: int, group, tokens: int) -> Case:
    """The "mlp" block on [tokens, 64] activations, or the two-layer "llama" on [1, 8] token ids,
    sharded by hand ("funcol") or by `parallelize_module` ("dtensor")."""
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; one of {SHARDINGS}")
    if sharding == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    if model == "llama":
        sharded, input_ids = (dtensor_llama(scheme, mesh) if sharding == "dtensor"
                              else tensor_parallel_llama(scheme, rank, world, group))
        return Case(sharded, quantized_llama(scheme)[0], quantized_llama("float")[0],
                    lambda module: module(input_ids).logits)
    floats = float_mlp()
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(7))
    sharded = dtensor_mlp(floats, scheme, mesh) if sharding == "dtensor" else TensorParallelMlp(floats, scheme, rank, world, group)
    return Case(sharded, TensorParallelMlp(floats, scheme), TensorParallelMlp(floats, "float"), lambda module: module(x))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.float() - expected.float()).abs().max().item() / expected.float().abs().max().item()


def run_rank(rank: int, world: int, store_file: str, out_dir: str, model: str, scheme: str, sharding: str = "funcol",
             tokens: int = 5) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        import qfuse

        torch._inductor.config.force_disable_caches = True
        case = build_case(model, scheme, sharding, rank, world, dist.group.WORLD, tokens)
        with torch.no_grad():
            eager = case.run(case.sharded)
            marker = qfuse.graphs_compiled()
            # compressed-tensors fake-quantizes in float: a CPU without int8 dot instructions leaves that to Inductor
            options = FLOAT_WRITTEN_INT8 if scheme == tp_models.COMPRESSED_TENSORS else {}
            compiled = case.run(torch.compile(case.sharded, backend="qfuse", fullgraph=True, options=options or None))
            reports = qfuse.reports_since(marker)
            unsharded_quantized, unsharded_float = case.run(case.unsharded_quantized), case.run(case.unsharded_float)
        records = [record for report in reports for record in report.records]
        result = {
            "fused": sum(record.fused for record in records),
            "linears": len(records),
            "kernels": sorted({record.kernel for record in records if record.fused}),
            "compiled_vs_eager": relative_error(compiled, eager),
            "sharded_vs_float": relative_error(eager, unsharded_float),
            "sharded_vs_unsharded": relative_error(eager, unsharded_quantized),
            "unsharded_vs_float": relative_error(unsharded_quantized, unsharded_float),
            "ops_after": {key: value for report in reports for key, value in report.ops_after.items()
                          if "qfuse" in key or "c10d" in key},
        }
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
            json.dump(result, file)
    finally:
        dist.destroy_process_group()
