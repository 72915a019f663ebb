"""`qfuse.passes.core.graph_utils`: pending calls are read like nodes and inserted once, when asked."""

import torch
from torch._subclasses import FakeTensorMode
from torch.fx import Graph

from qfuse.passes.core.graph_utils import PendingCall, aten, dtype_of, materialize, shape_of


def _graph_with_input():
    with FakeTensorMode():
        value = torch.empty(4, 6, dtype=torch.uint8)
    graph = Graph()
    x = graph.placeholder("x")
    x.meta["val"] = value
    return graph, x


def test_a_pending_call_reads_like_a_node_without_touching_the_graph():
    graph, x = _graph_with_input()
    transposed = PendingCall(aten.permute.default, (PendingCall(aten.view.dtype, (x, torch.int8)), [1, 0]))
    assert shape_of(transposed) == (6, 4) and dtype_of(transposed) == torch.int8
    assert len(graph.nodes) == 1 and transposed.node is None


def test_materialize_inserts_each_pending_call_once_at_the_insertion_point():
    graph, x = _graph_with_input()
    as_int8 = PendingCall(aten.view.dtype, (x, torch.int8))
    transposed = PendingCall(aten.permute.default, (as_int8, [1, 0]))
    output = graph.output(x)
    with graph.inserting_before(output):
        node = materialize(graph, transposed)
        assert materialize(graph, transposed) is node and materialize(graph, as_int8) is node.args[0]
    assert [n.target for n in graph.nodes] == ["x", aten.view.dtype, aten.permute.default, "output"]
    assert node.meta["val"] is transposed.fake_value and node.args[1] == [1, 0]


def test_materialize_passes_anything_else_through():
    graph, x = _graph_with_input()
    assert materialize(graph, x) is x and materialize(graph, 3) == 3 and materialize(graph, None) is None
    assert len(graph.nodes) == 1
