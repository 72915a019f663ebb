"""qfuse's ops add no synchronisation around a collective (issue #17): a row-parallel linear whose
output is all-reduced, then an independent quantized linear, compiled by Inductor and by qfuse on a
one-process gloo group. Both linears fuse, and the generated code issues the GEMMs, the all-reduce
and its wait in the order Inductor's own code does (no wait added or moved), with Inductor's
comm/compute reordering off and on.

What this does not show: overlap itself. On the CPU (torch 2.13) Inductor waits right after the
all-reduce in both settings, before the independent GEMM, so the order checked here has none to
keep. On 2 H100s (torch 2.11, NCCL) Inductor's code does the same, and no compute kernel ran while
the all-reduce did, for Inductor or qfuse (benchmarks/explorations/gpu_collective_overlap.py, docs/distributed.md)."""

import pytest
import torch
import torch.distributed as dist

import qfuse
from tests.distributed.collectives import ReducedThenSide, compile_with_order

pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
              pytest.mark.slow]  # processes on gloo: minutes


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reorder", [False, True], ids=["inductor-order", "comm-reordering"])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_fused_linears_keep_inductors_collective_order(world_of_one, scheme, reorder):
    model, inputs = ReducedThenSide(scheme, world_of_one), (torch.randn(5, 128), torch.randn(5, 64))
    with torch._inductor.config.patch(reorder_for_compute_comm_overlap=reorder):
        inductor = compile_with_order(model, "inductor", *inputs)[1]
        marker = qfuse.graphs_compiled()
        ours = compile_with_order(model, "qfuse", *inputs)[1]
    assert [record.fused for report in qfuse.reports_since(marker) for record in report.records] == [True, True]
    assert ours == inductor and ours.count("gemm") == 2 and "all_reduce" in ours and "wait" in ours, (ours, inductor)
