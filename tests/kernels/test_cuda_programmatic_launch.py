"""qfuse's CUDA kernels launched with programmatic dependent launch (`qfuse.kernels.cuda.launch`).

While a CUDA graph is captured on Hopper, the decode kernels are launched with programmatic stream serialization,
so they may start before the kernel ahead of them has ended; they must wait for it before they read x. Each test
puts ahead of them a Triton kernel, launched with PDL too, that lets its dependents start at once and writes x
only after a long spin: a kernel that did not wait would read the x of before. The layout of the launch's
structures is checked everywhere; the rest runs on the GPU machine (Hopper on)."""

import ctypes
import functools

import pytest
import torch

from qfuse.kernels.cuda import launch

HOPPER = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="needs a CUDA GPU with programmatic dependent launch (sm_90 on)")


def test_the_launch_structures_have_the_drivers_layout():
    """CUlaunchAttribute: a 4-byte id, 4 bytes of padding, a 64-byte union; CUlaunchConfig: seven unsigned ints, the
    stream, the attributes' address and their count (cuda.h)."""
    assert ctypes.sizeof(launch._LaunchAttribute) == 72 and launch._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(launch._LaunchConfig) == 56
    assert [launch._LaunchConfig.stream.offset, launch._LaunchConfig.attributes.offset,
            launch._LaunchConfig.attribute_count.offset] == [32, 40, 48]


@functools.cache
def _write_late():
    """A Triton kernel that lets its dependents start first thing and stores x = values only after a long spin."""
    import triton
    import triton.language as tl

    @triton.jit
    def write_late(x_ptr, values_ptr, numel, SPIN: tl.constexpr, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_launch_dependents()
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        v = tl.load(values_ptr + offsets, mask=mask).to(tl.float32)
        spun = v
        for _ in range(SPIN):  # (a chain the compiler keeps: about SPIN x 10 cycles)
            spun = spun * 0.999 + v * 0.001
        tl.store(x_ptr + offsets, (spun - spun + v).to(x_ptr.dtype.element_ty), mask=mask)

    return write_late


def _late_writer(x: torch.Tensor, values: torch.Tensor):
    """x = values, written by `_write_late` launched with PDL."""
    block = 1024
    _write_late()[(-(-x.numel() // block),)](x, values, x.numel(), SPIN=20000, BLOCK=block, launch_pdl=True)


def _replayed(compute, x: torch.Tensor, values: torch.Tensor, monkeypatch) -> tuple[torch.Tensor, int]:
    """compute(x) after the late writer, captured in a CUDA graph and replayed on a zeroed x, and how many
    programmatic launches the capture made."""
    launched = []
    programmatic = launch.launch_programmatic
    monkeypatch.setattr(launch, "launch_programmatic", lambda *args: launched.append(args) or programmatic(*args))
    _late_writer(x, values), compute(x)  # both compiled and loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _late_writer(x, values)
        out = compute(x)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return out, len(launched)


@HOPPER
@pytest.mark.parametrize("m", [1, 16])
def test_the_int4_kernel_waits_for_the_kernel_before_it(m, monkeypatch):
    from qfuse.kernels.cuda.int4_mma import int4_mma, repack

    torch.manual_seed(m)
    n, k, group_size = 4096, 4096, 128
    values = torch.randint(-8, 8, (k, n), device="cuda", dtype=torch.int8)
    scale = (torch.rand(k // group_size, n, device="cuda") / 16).to(torch.bfloat16)
    words, pairs = repack(values, scale, None)
    x_values = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros_like(x_values)
    out, launches = _replayed(lambda x: int4_mma(x, words, pairs, None, group_size, torch.bfloat16), x, x_values,
                              monkeypatch)
    assert launches == 1
    torch.testing.assert_close(out, int4_mma(x_values, words, pairs, None, group_size, torch.bfloat16), rtol=0, atol=0)


@HOPPER
@pytest.mark.parametrize("m", [1, 8])
def test_the_8_bit_kernel_waits_for_the_kernel_before_it(m, monkeypatch):
    from qfuse.kernels.cuda.w8_mma import repack, w8_mma

    torch.manual_seed(m)
    n, k = 4096, 4096
    weight = torch.randint(-127, 128, (k, n), device="cuda", dtype=torch.int8)
    words = repack(weight)
    x_values = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros_like(x_values)
    scale_b = torch.rand(n, device="cuda") / 64
    out, launches = _replayed(lambda x: w8_mma(x, words, torch.int8, None, scale_b, None, torch.bfloat16), x, x_values,
                              monkeypatch)
    assert launches == 1
    torch.testing.assert_close(out, w8_mma(x_values, words, torch.int8, None, scale_b, None, torch.bfloat16),
                               rtol=0, atol=0)
