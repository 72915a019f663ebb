"""The cuda kernel's call from Inductor's code (qfuse/lowerings/cuda.py): its lookup of a prepared weight by
the source tensors' identity (CPU: no kernel runs). The call itself is tested on the GPU (tests/test_cuda.py,
test_int4_cuda_kernel_without_cuda_graphs_is_called_from_inductors_code)."""

import gc

import torch

from qfuse.kernels.prepared import PreparedWeight
from qfuse.lowerings import cuda

SETTINGS = (False, 128, "stored", False)


def _weight(source):
    return PreparedWeight(source.clone(), None, None, 1, source.numel())


def test_the_same_tensors_find_their_weight_until_one_changes():
    sources = (torch.zeros(8, dtype=torch.int32), None, torch.ones(8), None)
    weight = _weight(sources[0])
    cuda._remember(sources, SETTINGS, weight)
    assert cuda._recent_weight(sources, SETTINGS) is weight
    assert cuda._recent_weight(sources, (True, *SETTINGS[1:])) is None  # other settings: another entry
    sources[2].mul_(2)  # a checkpoint loaded in place: the version moves, so the prepared weight is made again
    assert cuda._recent_weight(sources, SETTINGS) is None
    cuda._remember(sources, SETTINGS, weight)
    assert cuda._recent_weight(sources, SETTINGS) is weight
    sources[2].data = torch.full((8,), 3.0)  # new memory under the same tensor (its version does not move)
    assert cuda._recent_weight(sources, SETTINGS) is None


def test_it_holds_no_weight_alive_and_skips_inference_tensors():
    sources = (torch.zeros(8, dtype=torch.int32), None, torch.ones(8), None)
    weight = _weight(sources[0])
    cuda._remember(sources, SETTINGS, weight)
    del weight
    gc.collect()
    assert cuda._recent_weight(sources, SETTINGS) is None  # the prepared-weight cache owns it, not this lookup
    with torch.inference_mode():
        inference = (torch.zeros(8, dtype=torch.int32), None, torch.ones(8), None)
    kept = _weight(inference[0])
    cuda._remember(inference, SETTINGS, kept)
    assert cuda._recent_weight(inference, SETTINGS) is None  # no version counter: never looked up by identity
