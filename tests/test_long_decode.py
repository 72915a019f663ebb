"""A serving loop on the GPU (issue #41, item 3; runs on the GPU machine, skipped elsewhere): the decode
benchmark's model (one layer) under CUDA graphs for 1,000 steps, the position growing and the batch changing
between requests (`benchmarks/gpu_long_decode.py`, whose `--steps 10000` run is in docs/benchmarks.md), per linear form:
GPU memory flat once every batch size has run, no more graphs compiled than plain Inductor compiles on the
same loop, and outputs as close to eager's as Inductor's are."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FORMS = ["gptq int4", "fp8 W8A8", "int8 weight-only"]


@pytest.mark.parametrize("form", FORMS)
def test_long_decode_under_cuda_graphs_stays_flat_and_exact(form):
    gpu_long_decode = pytest.importorskip("gpu_long_decode", reason="needs benchmarks/ on PYTHONPATH")
    if form == "fp8 W8A8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs capability >= 8.9")
    runs = {backend: gpu_long_decode.long_run(f"{form} ({backend})", layers=1, steps=1000, batches=(1, 4),
                                              sample_every=200)
            for backend in ("Inductor", "qfuse")}
    inductor, qfuse = runs["Inductor"], runs["qfuse"]
    assert qfuse["growth_mib"] == 0 and inductor["growth_mib"] == 0, runs
    assert qfuse["graphs"] <= inductor["graphs"], runs
    assert qfuse["max_error"] <= max(2 * inductor["max_error"], 1e-2), runs
