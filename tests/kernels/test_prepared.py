"""Tests for `qfuse.kernels.prepared`: a kernel's prepared weight is made once per weight, made
again after an in-place update, dropped with the weight, and never keeps the weight alive; and the
padding helpers."""

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from qfuse.kernels.base import OK, Kernel
from qfuse.kernels.prepared import (
    PreparedWeight,
    cached_weight_count,
    padded_activation,
    padded_weight,
    prepare_once,
)


class CountingKernel(Kernel):
    """Doubles the weight in prepare_weight (or returns it as it is) and counts the calls."""

    name = "counting"
    prepares_weight = True

    def __init__(self, copies=True):
        self.calls, self.copies = 0, copies

    def is_supported(self, platform):
        return OK

    def can_implement(self, key, platform):
        return OK

    def prepare_weight(self, b, scale_b, azp_b):
        self.calls += 1
        return PreparedWeight(b * 2 if self.copies else b, scale_b, azp_b, *b.shape)

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        raise NotImplementedError


def test_prepared_once_per_weight_and_again_after_an_update():
    kernel, weight, scale = CountingKernel(), torch.ones(8, 4), torch.ones(1, 4)
    first = prepare_once(kernel, weight.t(), scale, None)
    assert prepare_once(kernel, weight.t(), scale, None) is first and kernel.calls == 1
    weight.add_(1)  # an in-place update bumps the version counter
    assert torch.equal(prepare_once(kernel, weight.t(), scale, None).data, weight.t() * 2)
    assert kernel.calls == 2
    prepare_once(kernel, weight, scale, None)  # another view of the same storage: another entry
    assert kernel.calls == 3


def test_entries_die_with_their_weight():
    kernel = CountingKernel()
    before = cached_weight_count()
    weight = torch.ones(8, 4)
    prepare_once(kernel, weight, None, None)
    assert cached_weight_count() == before + 1
    del weight
    gc.collect()
    assert cached_weight_count() == before


def test_a_weight_the_kernel_returns_as_it_is_is_not_held_and_not_looked_for_again(monkeypatch):
    from qfuse.kernels import prepared

    kernel, weight = CountingKernel(copies=False), torch.ones(8, 4)
    storage = StorageWeakRef(weight.untyped_storage())
    before = cached_weight_count()
    scans = []
    monkeypatch.setattr(prepared, "_evict_expired", lambda: scans.append(1))
    assert prepare_once(kernel, weight, None, None).data is weight
    assert prepare_once(kernel, weight, None, None).data is weight
    assert kernel.calls == 2  # rebuilt from the inputs: the cache does not hold the weight...
    assert len(scans) == 1  # ...but remembers there is nothing to prepare (no cache scan per call)
    monkeypatch.undo()
    assert cached_weight_count() == before
    del weight
    gc.collect()
    assert storage.expired()


def test_inference_tensors_are_prepared_every_call():
    kernel = CountingKernel()
    with torch.inference_mode():
        weight = torch.ones(8, 4)
    prepare_once(kernel, weight, None, None)
    prepare_once(kernel, weight, None, None)
    assert kernel.calls == 2


@pytest.mark.parametrize("k, n, k_multiple, n_multiple, shape", [(40, 20, 16, 16, (48, 32)), (40, 20, 16, 1, (48, 20))])
def test_padded_weight_is_column_major_with_zeros(k, n, k_multiple, n_multiple, shape):
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8).t()
    padded = padded_weight(b, k_multiple, n_multiple)
    assert padded.shape == shape and padded.stride(0) == 1
    assert torch.equal(padded[:k, :n], b) and padded[k:].abs().sum() == 0 and padded[:, n:].abs().sum() == 0


def test_aligned_column_major_weight_and_activation_are_not_copied():
    b = torch.randint(-127, 128, (32, 64), dtype=torch.int8).t()
    assert padded_weight(b, 16, 16) is b
    a = torch.ones(3, 64)
    assert padded_activation(a, 64) is a
    assert padded_activation(torch.ones(3, 60), 64)[:, 60:].abs().sum() == 0
