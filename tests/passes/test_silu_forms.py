"""`match_silu_and_mul`: the SiLU * mul of a Llama MLP as the post-grad graph spells it (CPU: the
matcher reads graphs; the kernel it leads to runs on CUDA, tests/lowerings/test_quant_lowering.py)."""

import pytest
import torch
import torch.nn.functional as F

from qfuse.config import pass_skipping_caches_off
from qfuse.passes.forms.triton_quantizer import producer_fuses_into_quant
from qfuse.passes.core.graph_utils import aten
from qfuse.passes.forms.quant_forms import float_source
from qfuse.passes.forms.silu_forms import match_silu_and_mul


def post_grad_graph(fn, *args):
    """The post-grad graph Inductor compiles for fn(*args)."""
    import torch._inductor.config as inductor_config

    graphs = []
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=graphs.append), pass_skipping_caches_off():
        torch.compile(fn)(*args)
    return graphs[0]


def output_mul(graph):
    """The mul node the graph returns."""
    (output,) = graph.find_nodes(op="output")
    node = output.args[0][0]
    assert node.target == aten.mul.Tensor, node.format_node()
    return node


def inputs(*dtypes, shape=(4, 64)):
    return [torch.randn(shape).to(dtype) for dtype in dtypes]


FORMS = {
    "silu": (lambda g, u: (F.silu(g) * u,), (torch.bfloat16, torch.bfloat16)),
    "up_first": (lambda g, u: (u * F.silu(g),), (torch.bfloat16, torch.bfloat16)),
    "sigmoid": (lambda g, u: ((g.float() * torch.sigmoid(g.float())).to(torch.bfloat16) * u,), (torch.bfloat16, torch.bfloat16)),
    "fp32_gate": (lambda g, u: (F.silu(g).to(torch.bfloat16) * u,), (torch.float32, torch.bfloat16)),
    "fp16": (lambda g, u: (F.silu(g) * u,), (torch.float16, torch.float16)),
}


@pytest.mark.parametrize("form", FORMS)
def test_forms_match(form):
    fn, dtypes = FORMS[form]
    graph = post_grad_graph(fn, *inputs(*dtypes))
    mul = output_mul(graph)
    gate, up = match_silu_and_mul(mul)
    assert [gate.op, up.op] == ["placeholder", "placeholder"]
    assert producer_fuses_into_quant(mul)


NOT_SILU_MUL = {
    "gelu": (lambda g, u: (F.gelu(g) * u,), (torch.bfloat16, torch.bfloat16)),
    "float32_product": (lambda g, u: (F.silu(g) * u,), (torch.float32, torch.float32)),
    "silu_of_other": (lambda g, u: ((g.float() / (1 + torch.exp(-u.float()))).to(torch.bfloat16) * u,),
                      (torch.bfloat16, torch.bfloat16)),
}


@pytest.mark.parametrize("form", NOT_SILU_MUL)
def test_other_products_do_not_match(form):
    fn, dtypes = NOT_SILU_MUL[form]
    assert match_silu_and_mul(output_mul(post_grad_graph(fn, *inputs(*dtypes)))) is None


def test_a_broadcast_up_does_not_match():
    gate, up = torch.randn(4, 64).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)
    assert match_silu_and_mul(output_mul(post_grad_graph(lambda g, u: (F.silu(g) * u,), gate, up))) is None


def test_a_graph_input_or_a_matmul_has_no_producer_to_fuse():
    graph = post_grad_graph(lambda x, w: (x @ w,), torch.randn(4, 8), torch.randn(8, 8))
    (placeholder, _) = graph.find_nodes(op="placeholder")
    (mm,) = graph.find_nodes(op="call_function", target=aten.mm.default)
    assert not producer_fuses_into_quant(placeholder) and not producer_fuses_into_quant(mm)


def test_float_source_strips_exact_upcasts_only():
    """bf16 -> float32 is exact; fp16 -> bf16 rounds (and bf16 -> fp16 may overflow): not stripped.
    (A graph built by hand: torch 2.11's `pointless_convert` folds such a chain, 2.13's keeps it.)"""
    graph = torch.fx.Graph()

    def convert(node, dtype):
        converted = graph.call_function(torch.ops.prims.convert_element_type.default, (node, dtype))
        converted.meta["val"] = torch.empty(4, 8, dtype=dtype)
        return converted

    h = graph.placeholder("h")
    h.meta["val"] = torch.empty(4, 8, dtype=torch.float16)
    rounded = convert(h, torch.bfloat16)
    assert float_source(convert(rounded, torch.float32)) is rounded
    assert float_source(convert(h, torch.float32)) is h
