"""Tensor-parallel quantized MLP blocks compile and fuse with backend="qfuse" (issue #17), on the CPU:
two processes on the gloo backend, the MLP block and the two-layer tiny Llama of
`tests/distributed/tp_models.py` (column-parallel q / k / v / gate / up, row-parallel o / down with a
functional all-reduce each), int8 and fp8 W8A8 in the reference form.
Each rank compiles its shard with fullgraph=True (a graph break fails it), every linear of the
shard fuses, the all-reduce stays in the graph, and the compiled shard matches the eager one; the
sharded block matches the unsharded float block within quantization error."""

import json

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.tp_worker import run_rank
from tests.peers import hf_llama

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
WORLD = 2


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("model, linears", [("mlp", 3), ("llama", 14)])
def test_every_shard_fuses_and_matches(model, linears, scheme, tmp_path):
    if model == "llama" and not hf_llama.available()[0]:
        pytest.skip(hf_llama.available()[1])
    mp.spawn(run_rank, args=(WORLD, str(tmp_path / "store"), str(tmp_path), model, scheme), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["linears"] == linears and result["fused"] == linears, result
        assert any("all_reduce" in op for op in result["ops_after"]), result  # the collective is still there
        assert result["compiled_vs_eager"] < 1e-5, result
        # quantizing each shard's input on its own costs about what quantizing the whole one does
        assert result["sharded_vs_float"] < 2 * result["unsharded_vs_float"] + 1e-3, result
