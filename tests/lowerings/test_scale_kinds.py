"""How the scaled-mm lowering reads a scale's kind from its IR sizes, as the op's normalisation does
(by the count of values and the last dimension(s)), checked on the CPU without compiling: a
[K / 128, N / 128] block scale can hold exactly N values (K = 16384), and is still no per-column scale."""

from types import SimpleNamespace

import pytest
import sympy
from torch._inductor.virtualized import V

from qfuse.kernels.triton.scaled_mm import BLOCK_SCALE, NO_SCALE, TENSOR_SCALE, VECTOR_SCALE
from qfuse.lowerings import aten_linear
from qfuse.lowerings.triton import scaled_mm


class Sizes:
    """An IR node as the lowering's scale checks see it: its sizes."""

    def __init__(self, *sizes):
        self.sizes = list(map(sympy.sympify, sizes))

    def get_size(self):
        return self.sizes


@pytest.fixture(autouse=True)
def graph():
    sizevars = SimpleNamespace(statically_known_equals=lambda left, right: sympy.simplify(left - right) == 0)
    with V.set_graph_handler(SimpleNamespace(sizevars=sizevars)):
        yield


M, K, N = 8, 16384, 256  # K / 128 x N / 128 = 128 x 2 = N


@pytest.mark.parametrize("scale_a, scale_b, kinds", [
    (None, None, (NO_SCALE, NO_SCALE)),
    (Sizes(), Sizes(1), (TENSOR_SCALE, TENSOR_SCALE)),
    (Sizes(M, 1), Sizes(N), (VECTOR_SCALE, VECTOR_SCALE)),
    (Sizes(M, 1), Sizes(1, N), (VECTOR_SCALE, VECTOR_SCALE)),
    (Sizes(M, 1), Sizes(K // 128, N // 128), (VECTOR_SCALE, BLOCK_SCALE)),
    (Sizes(M, K // 128), Sizes(K // 128, N // 128), (BLOCK_SCALE, BLOCK_SCALE)),
    (Sizes(2, 4, 1), Sizes(N), (VECTOR_SCALE, VECTOR_SCALE)),  # a 3D activation's per-token scale
])
def test_the_triton_kind_of_each_scale(scale_a, scale_b, kinds):
    found = scaled_mm.scale_kinds(scale_a, scale_b, M, K, N)
    assert tuple(kind for kind, _ in found) == kinds


def test_scales_of_no_kind_are_refused_with_a_reason():
    # N values, but neither per column (last dim N) nor the block grid: what the op rejects too
    assert scaled_mm.scale_kinds(None, Sizes(N, 1), M, K, N)[1] is None
    assert "scale_b is neither" in scaled_mm._why_not_scales(None, Sizes(N, 1), M, Sizes(K, N))
    # M values whose last dimension is not 1 are no per-row scale
    assert scaled_mm.scale_kinds(Sizes(1, M), None, M, K, N)[0] is None


def test_the_torch_lowering_reads_a_block_scale_as_no_per_column_scale():
    assert aten_linear.column_scale_shape(Sizes(K // 128, N // 128), N) is None
    assert aten_linear.column_scale_shape(Sizes(N), N) == [1, N]
    assert aten_linear.row_scale_shape(Sizes(M, 1), M) == [M, 1]
    assert aten_linear.row_scale_shape(Sizes(), M) == [1, 1]
