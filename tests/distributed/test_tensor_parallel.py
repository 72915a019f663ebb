"""Tensor-parallel quantized MLP blocks compile and fuse with backend="qfuse" (issue #17), on the CPU:
two processes on the gloo backend, the MLP block and the two-layer tiny Llama of
`tests/distributed/tp_models.py` (column-parallel q / k / v / gate / up, row-parallel o / down with
their all-reduces), int8 and fp8 W8A8 in the reference form, sharded by hand on functional
collectives and by `parallelize_module` on DTensors, and the Llama quantized by compressed-tensors.
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

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
              pytest.mark.slow]  # processes on gloo: minutes
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
        # the collectives are still there: one per row-parallel linear, two on DTensors (the amax's too)
        row_parallel = {"mlp": 1, "llama": 4}[model]
        expected = row_parallel * (2 if sharding == "dtensor" else 1)
        assert result["ops_after"].get("_c10d_functional.all_reduce.default") == expected, result
        assert result["compiled_vs_eager"] < 1e-5, result
        # quantizing each shard's input on its own costs about what quantizing the whole one does
        assert result["sharded_vs_float"] < 2 * result["unsharded_vs_float"] + 1e-3, result
        if sharding == "dtensor":  # the per-token amax is all-reduced: the unsharded quantization
            assert result["sharded_vs_unsharded"] < 1e-5, result


@pytest.fixture
def mesh_of_one(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_int_mm_on_dtensors_has_mms_placements(mesh_of_one):
    """qfuse's rule (`import qfuse`): row-parallel gives int32 partial sums, column-parallel output
    columns; the partials stay partial through the float epilogue, reduced at the output layout."""
    import torch
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    import qfuse  # noqa: F401  (registers the rule)

    a = torch.randint(-128, 128, (32, 64), dtype=torch.int8)
    b = torch.randint(-128, 128, (64, 16), dtype=torch.int8)
    expected = torch._int_mm(a, b)
    for a_placement, b_placement, out_placement in ((Shard(1), Shard(0), Partial()), (Replicate(), Shard(1), Shard(1)),
                                                     (Shard(0), Replicate(), Shard(0))):
        out = torch._int_mm(distribute_tensor(a, mesh_of_one, [a_placement]),
                            distribute_tensor(b, mesh_of_one, [b_placement]))
        assert out.placements == (out_placement,) and out.dtype == torch.int32
        assert torch.equal(out.full_tensor(), expected)
    partial = torch._int_mm(distribute_tensor(a, mesh_of_one, [Shard(1)]), distribute_tensor(b, mesh_of_one, [Shard(0)]))
    assert (partial * 0.5).placements == (Partial(),)  # the all-reduce comes after the dequantize epilogue


def test_a_strategy_dtensor_already_has_is_left_alone(monkeypatch):
    import torch
    from torch.distributed.tensor import DTensor

    from qfuse.distributed import register_int_mm_sharding

    propagator = DTensor._op_dispatcher.sharding_propagator
    sentinel = object()
    monkeypatch.setitem(propagator.op_strategy_funcs, torch.ops.aten._int_mm.default, sentinel)
    assert not register_int_mm_sharding()
    assert propagator.op_strategy_funcs[torch.ops.aten._int_mm.default] is sentinel
