"""Tensor-parallel quantized MLP blocks compile and fuse with backend="qfuse" (issue #17), on the CPU:
two processes on the gloo backend, the MLP block and the two-layer tiny Llama of
`tests/distributed/tp_models.py` (column-parallel q / k / v / gate / up, row-parallel o / down with an
all-reduce each), int8 and fp8 W8A8 in the reference form, sharded by hand on functional collectives
and by `parallelize_module` on DTensors.
Each rank compiles its shard with fullgraph=True (a graph break fails it), every linear of the
shard fuses, the all-reduce stays in the graph, and the compiled shard matches the eager one; the
sharded block matches the unsharded float block within quantization error (and, on DTensors, which
compute the unsharded math, the unsharded quantized block up to float rounding)."""

import json

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed import tp_models
from tests.distributed.tp_worker import run_rank
from tests.peers import compressed_tensors_models, hf_llama

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
WORLD = 2


# Not here, because they fail in eager before qfuse sees a graph (docs/distributed.md):
# - fp8 on DTensors: DTensor's `_scaled_mm` rule gives a row-wise [M, 1] / [1, N] scale the sharding
#   of its operand, so a row-parallel fp8 linear cannot keep its K shards and all-gathers them (gloo
#   cannot gather fp8 at all);
# - compressed-tensors on DTensors: its dynamic activation quant adds a zero point it makes as a
#   plain tensor to the DTensor input ("got mixed torch.Tensor and DTensor").
REFERENCE_FORMS = [("funcol", "int8"), ("funcol", "fp8"), ("dtensor", "int8")]
CASES = [("mlp", 3, *form) for form in REFERENCE_FORMS] + [
    ("llama", 14, *form) for form in [*REFERENCE_FORMS, ("funcol", tp_models.COMPRESSED_TENSORS)]]


@pytest.mark.parametrize("model, linears, sharding, scheme", CASES)
def test_every_shard_fuses_and_matches(model, linears, sharding, scheme, tmp_path):
    if model == "llama" and not hf_llama.available()[0]:
        pytest.skip(hf_llama.available()[1])
    if scheme == tp_models.COMPRESSED_TENSORS and not compressed_tensors_models.available()[0]:
        pytest.skip(compressed_tensors_models.available()[1])
    mp.spawn(run_rank, args=(WORLD, str(tmp_path / "store"), str(tmp_path), model, scheme, sharding), nprocs=WORLD,
             join=True)
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["linears"] == linears and result["fused"] == linears, result
        assert any("all_reduce" in op for op in result["ops_after"]), result  # the collective is still there
        assert result["compiled_vs_eager"] < 1e-5, result
        # quantizing each shard's input on its own costs about what quantizing the whole one does
        assert result["sharded_vs_float"] < 2 * result["unsharded_vs_float"] + 1e-3, result
        if sharding == "dtensor":  # the per-token amax is all-reduced: the unsharded quantization
            assert result["sharded_vs_unsharded"] < 1e-5, result


def test_int_mm_has_a_sharding_rule_once_qfuse_is_imported():
    import torch

    import qfuse  # noqa: F401  (registers the rule)
    from qfuse.distributed import has_sharding_strategy, register_int_mm_sharding

    assert has_sharding_strategy(torch.ops.aten._int_mm.default)
    assert not register_int_mm_sharding()  # DTensor's strategy (ours, or a newer torch's) is left as it is
