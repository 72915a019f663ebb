"""Tests for `qfuse.kernels.prepared`: a kernel's prepared weight is made once per weight, made
again after an in-place update (into the same memory; `refresh_weights` where the update is not seen), dropped with the
weight at the next full collection, made once when two threads ask at once, and never keeps the
weight alive; and the padding helpers."""

import gc
import threading
import time
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from qfuse.kernels.base import OK, Kernel
from qfuse.kernels.prepared import (
    PreparedWeight,
    built_once,
    cached_weight_count,
    padded_activation,
    padded_weight,
    prepare_once,
    prepared_weights,
    refresh_weights,
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


def test_prepared_once_per_weight_and_again_after_an_update_into_the_same_memory():
    kernel, weight, scale = CountingKernel(), torch.ones(8, 4), torch.ones(1, 4)
    first = prepare_once(kernel, weight.t(), scale, None)
    assert prepare_once(kernel, weight.t(), scale, None) is first and kernel.calls == 1
    count = cached_weight_count()
    for step in range(3):
        weight.add_(1)  # an in-place update (a checkpoint loaded again) bumps the version counter
        again = prepare_once(kernel, weight.t(), scale, None)
        assert torch.equal(again.data, weight.t() * 2) and kernel.calls == 2 + step
        assert again.data.data_ptr() == first.data.data_ptr() and cached_weight_count() == count  # no copy per reload
    prepare_once(kernel, weight, scale, None)  # another view of the same storage: another entry
    assert kernel.calls == 5


def test_a_weight_whose_storage_moved_is_prepared_again():
    """A storage resized to nothing and back (FSDP's reshard and unshard) keeps its identity and version counter but
    moves the data: a prepared form that reads the weight where it lies (a table of addresses) is made again."""
    kernel, weight = CountingKernel(), torch.ones(8, 4)
    prepare_once(kernel, weight, None, None)
    storage = weight.untyped_storage()
    address, version, nbytes = weight.data_ptr(), weight._version, storage.nbytes()
    storage.resize_(0)
    torch.empty(1 << 20)  # (the freed bytes taken, so the data lands elsewhere)
    storage.resize_(nbytes)
    if weight.data_ptr() == address:
        pytest.skip("the allocator gave the storage its old address back")
    assert weight._version == version
    weight.untyped_storage().copy_(torch.full((8, 4), 3.0).untyped_storage())
    again = prepare_once(kernel, weight, None, None)
    assert kernel.calls == 2 and torch.equal(again.data, torch.full((8, 4), 6.0))


def test_a_new_layout_after_an_update_replaces_the_entry():
    kernel, weight = CountingKernel(), torch.ones(8, 4)
    first = prepare_once(kernel, weight, None, None)
    kernel.prepare_weight = lambda b, s, z: PreparedWeight(b.double(), s, z, *b.shape)
    weight.add_(1)
    again = prepare_once(kernel, weight, None, None)
    assert again.data.dtype == torch.float64 and torch.equal(again.data, weight.double())
    assert first.data.dtype == torch.float32 and torch.equal(first.data, torch.full((8, 4), 2.0))  # left as it was


def test_entries_die_with_their_weight_at_the_next_full_collection():
    kernel = CountingKernel()
    gc.collect()  # earlier tests' dead weights leave first (the preparation below would drop them mid-count)
    before = cached_weight_count()
    weight = torch.ones(8, 4)
    prepared = weakref.ref(prepare_once(kernel, weight, None, None).data)
    assert cached_weight_count() == before + 1
    del weight
    gc.collect()  # nothing else asks the cache: the gc callback drops the entry
    assert prepared() is None
    assert cached_weight_count() == before


def test_two_threads_asking_at_once_prepare_a_weight_once():
    kernel, weight = CountingKernel(), torch.ones(8, 4)
    slow_build = kernel.prepare_weight

    def slow(b, s, z):
        time.sleep(0.2)  # long enough for the other thread to ask meanwhile
        return slow_build(b, s, z)

    kernel.prepare_weight = slow
    start, results = threading.Barrier(2), []

    def ask():
        start.wait()
        results.append(prepare_once(kernel, weight, None, None))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert kernel.calls == 1 and results[0] is results[1]


def test_refresh_weights_prepares_a_models_weights_again_in_place():
    kernel, model = CountingKernel(), torch.nn.Linear(4, 8, bias=False)
    with torch.no_grad():
        model.weight.fill_(1)
    from torch._C._dynamo.guards import _reinterpret_tensor  # how Inductor hands an extern op a view

    first = prepare_once(kernel, _reinterpret_tensor(model.weight, (4, 8), (1, 4), 0), None, None)
    unrelated = torch.ones(3, 3)
    prepare_once(kernel, unrelated, None, None)
    with torch.no_grad():
        model.weight.fill_(3)  # the view's own counter does not see it: the cache cannot either
    assert prepare_once(kernel, _reinterpret_tensor(model.weight, (4, 8), (1, 4), 0), None, None) is first
    assert refresh_weights(model) == 1 and kernel.calls == 3  # the model's weight only
    assert torch.equal(first.data, torch.full((4, 8), 6.0))  # in the memory a captured graph reads
    assert prepare_once(kernel, _reinterpret_tensor(model.weight, (4, 8), (1, 4), 0), None, None) is first
    assert kernel.calls == 3 and any(weight.data is first.data for weight in prepared_weights())


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


def test_a_field_of_a_kernels_own_weight_type_that_cannot_be_refilled_replaces_the_entry():
    """oneDNN's prepared weight adds an opaque packed tensor: refilling the plain fields alone would keep it stale."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Packed(PreparedWeight):
        packed: object = None

    kernel, weight = CountingKernel(), torch.ones(8, 4)
    kernel.prepare_weight = lambda b, s, z: Packed(b * 2, s, z, *b.shape, packed=("opaque", b.sum().item()))
    first = prepare_once(kernel, weight, None, None)
    weight.add_(1)
    again = prepare_once(kernel, weight, None, None)
    assert again.packed == ("opaque", 64.0) and first.packed == ("opaque", 32.0)


@pytest.mark.parametrize("kernel_name, k", [("triton", 40), ("cuda", 64)])
def test_a_scale_made_on_every_call_reuses_one_preparation(kernel_name, k):
    """Kernels that read the weight scale per call (`reads_weight_scale_per_call`) prepare the weight once
    however the scale comes: torchao's bf16 linears cast theirs in the forward, a new tensor each call. Keyed
    by the scale, the triton kernel prepared (padded, K = 40) the weight again on every call and kept an entry
    per call, holding that call's scale (found by review, session 28)."""
    from qfuse.kernels import get_kernel

    kernel = get_kernel(kernel_name)
    assert kernel.reads_weight_scale_per_call
    weight, stored_scale = torch.randint(-128, 128, (k, 32), dtype=torch.int8), torch.rand(1, 32)
    count = cached_weight_count()
    prepared = [prepare_once(kernel, weight, stored_scale.to(torch.bfloat16), None) for _ in range(3)]
    assert all(each.data is prepared[0].data for each in prepared) and cached_weight_count() == count + 1
    assert all(torch.equal(each.scale, stored_scale.to(torch.bfloat16)) for each in prepared)


def _counted_build(builds: list):
    def build(weight, scale):
        builds.append(1)
        return PreparedWeight(weight.clone(), scale, None, 1, weight.numel())
    return build


def test_a_repeated_call_with_the_same_tensors_finds_its_entry_by_identity(monkeypatch):
    """A compiled graph hands each call its weights as the same tensors: `built_once` finds their entry without
    its storage keys, until a source changes in place (its version) or gets new memory (`.data = `)."""
    from qfuse.kernels import prepared

    builds = []
    sources = (torch.zeros(8, dtype=torch.int32), torch.ones(8))
    first = built_once(("identity",), sources, _counted_build(builds))
    with monkeypatch.context() as patched:
        patched.setattr(prepared._SourceKey, "of", lambda tensor: pytest.fail("keys made on a repeated call"))
        assert built_once(("identity",), sources, _counted_build(builds)) is first and len(builds) == 1
    sources[1].mul_(2)  # a checkpoint loaded in place: prepared again
    assert built_once(("identity",), sources, _counted_build(builds)) is not None and len(builds) == 2
    sources[1].data = torch.full((8,), 3.0)  # new memory under the same tensor: its version does not move
    assert built_once(("identity",), sources, _counted_build(builds)) is not None and len(builds) == 3


def test_the_identity_lookup_holds_no_weight_alive_and_skips_inference_tensors():
    builds = []
    sources = (torch.zeros(8, dtype=torch.int32), torch.ones(8))
    weight = weakref.ref(built_once(("identity, dropped",), sources, _counted_build(builds)))
    del sources
    gc.collect()
    assert weight() is None  # the cache drops a freed weight's entry; the lookup keeps nothing of it
    with torch.inference_mode():
        inference = (torch.zeros(8, dtype=torch.int32), torch.ones(8))
    for _ in range(2):  # no version counter: prepared on every call, never looked up by identity
        built_once(("identity, inference",), inference, _counted_build(builds))
    assert len(builds) == 3
