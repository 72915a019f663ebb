"""`qfuse.ops.arguments`: each op's arguments by name, read from and written to FX nodes."""

import inspect

import pytest
import torch
from torch.fx import Graph

from qfuse.ops import check_close, quant_scaled_mm, scaled_mm
from qfuse.ops.scaled_mm import QuantScaledMmArgs, ScaledMmArgs
from qfuse.ops.verify import CheckCloseArgs

ARGUMENTS = [(ScaledMmArgs, scaled_mm), (QuantScaledMmArgs, quant_scaled_mm), (CheckCloseArgs, check_close)]


@pytest.mark.parametrize("arguments, op", ARGUMENTS, ids=lambda value: getattr(value, "__name__", ""))
def test_fields_are_the_ops_python_parameters_in_order(arguments, op):
    assert arguments._fields == tuple(inspect.signature(op._init_fn).parameters)
    assert arguments.op is getattr(torch.ops.qfuse, op._name.split("::")[-1]).default


def _scaled_mm_call(graph: Graph) -> ScaledMmArgs:
    a, b, scale_a, scale_b = (graph.placeholder(name) for name in ("a", "b", "scale_a", "scale_b"))
    return ScaledMmArgs(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=None, azp_a=None, azp_b=None,
                        out_dtype=torch.bfloat16, kernel="torch")


def test_an_emitted_node_reads_back_as_the_same_arguments():
    graph = Graph()
    call = _scaled_mm_call(graph)
    node = graph.call_function(call.op, call.as_args())
    assert type(call.as_args()) is tuple and node.args == call.as_args()
    assert ScaledMmArgs.of(node) == call
    assert ScaledMmArgs.of(node).kernel == "torch" and ScaledMmArgs.of(node).scale_b.name == "scale_b"


def test_keyword_arguments_read_back_alike():
    graph = Graph()
    call = _scaled_mm_call(graph)
    node = graph.call_function(call.op, call.as_args()[:2], {name: value for name, value in call._asdict().items()
                                                            if name not in ("a", "b")})
    assert ScaledMmArgs.of(node) == call


def test_replace_changes_one_argument_by_name():
    call = _scaled_mm_call(Graph())
    changed = call._replace(bias=None, out_dtype=torch.float32)
    assert changed.out_dtype == torch.float32 and changed.a is call.a and changed.kernel == call.kernel


def test_reading_a_call_of_another_op_names_both():
    graph = Graph()
    node = graph.call_function(torch.ops.aten.mm.default, (graph.placeholder("x"), graph.placeholder("w")))
    with pytest.raises(ValueError, match=r"calls aten.mm.default, not qfuse.scaled_mm.default"):
        ScaledMmArgs.of(node)
