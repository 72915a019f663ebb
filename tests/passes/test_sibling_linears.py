"""sibling_linears: fused linears that read one activation (q / k / v) become one `qfuse::<op>_siblings` call
where the kernel runs them as one (on this CPU: the `torch` kernel's int4), match eager, and say why where they
stay apart: act order, another activation, a kernel that runs no siblings, freezing."""

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import qfuse
from tests.peers import weight_only_models as wo

BF16 = torch.bfloat16
SIBLINGS_OP = "qfuse.int4_weight_only_mm_siblings.default"
MEMBER_OP = "qfuse.int4_weight_only_mm.default"


class Attention(nn.Module):
    """q, k, v of a GQA block (N = 128, 64, 64) read x; what follows reads them in different ways."""

    def __init__(self, act_order=(False, False, False), bias=True):
        super().__init__()
        self.q, self.k, self.v = [
            wo.gptq_packed_int4(BF16, group_size=64, out_features=n, bias=bias, seed=seed, act_order=order)
            for seed, (n, order) in enumerate(zip((128, 64, 64), act_order))]

    def forward(self, x, y=None):
        q, k, v = self.q(x), self.k(x), self.v(x if y is None else y)
        return torch.cat([q.view(*q.shape[:-1], 2, 64).sum(-2) * k, v.sin()], dim=-1)


def compiled_code_and_report(model, x, *args, **options):
    marker = qfuse.graphs_compiled()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend="qfuse", options=options or None)
        out, (code, *_) = run_and_get_code(compiled, x, *args)
    return out, code, qfuse.reports_since(marker)[-1]


def assert_close(out, expected):
    assert out.shape == expected.shape and out.dtype == expected.dtype
    if expected.numel():
        assert (out.float() - expected.float()).abs().max() <= 2 * 2**-7 * expected.float().abs().max()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)], ids=["M1", "M5", "3D"])
def test_q_k_v_become_one_call(lead, bias):
    model = Attention(bias=bias).eval()
    x = torch.randn(*lead, 256).to(BF16)
    out, code, report = compiled_code_and_report(model, x)
    with torch.no_grad():
        assert_close(out, model(x))
    assert code.count("qfuse.int4_weight_only_mm_siblings.default(") == 1 and MEMBER_OP not in code
    assert [record.kernel for record in report.fused] == ["torch"] * 3
    for record in report.fused:
        assert "one call with its siblings q, k, v" in record.note and "N = 128 + 64 + 64" in record.note
    assert report.fused[1].lowered == "in the sibling call of q"
    assert report.matches["int4_weight_only_mm siblings joined"] == 1


def test_a_dynamic_batch_stays_one_call():
    model = Attention().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="qfuse", dynamic=True)
    with torch.no_grad():
        for tokens in (3, 7, 12):
            x = torch.randn(tokens, 256).to(BF16)
            out, (code, *_) = run_and_get_code(compiled, x) if tokens == 3 else (compiled(x), ("",))
            assert_close(out, model(x))
            if tokens == 3:
                assert "int4_weight_only_mm_siblings" in code


def test_a_dynamic_m_is_one_call_in_the_buckets_whose_kernel_runs_siblings(monkeypatch):
    """A dynamic M is asked at its bucket, guarded: with the torch kernel said slower than Inductor above 4 rows
    (so no kernel runs the joined weight there), 3 and 2 rows are one sibling call of one compiled graph, and 7 rows
    compile again with the members apart (each Inductor's own code there). Asked for every bucket at once, the
    3-row graph kept them apart too."""
    from qfuse.kernels.torch_native import TorchKernel

    faster = TorchKernel.why_inductor_is_faster
    monkeypatch.setattr(TorchKernel, "speed_row_bounds", lambda self, key, platform: (4,))
    monkeypatch.setattr(TorchKernel, "why_inductor_is_faster", lambda self, key, platform: (
        "slower above 4 rows (this test's rule)" if key.m is not None and key.m > 4 else faster(self, key, platform)))
    model = Attention().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="qfuse", dynamic=True)
    codes, graphs = {}, []
    with torch.no_grad():
        for tokens in (3, 2, 7):
            x = torch.randn(tokens, 256).to(BF16)
            before = counters["stats"]["unique_graphs"]
            out, code = run_and_get_code(compiled, x) if tokens != 2 else (compiled(x), [])
            graphs.append(counters["stats"]["unique_graphs"] - before)
            assert_close(out, model(x))
            codes[tokens] = "\n".join(code)
    assert graphs == [1, 0, 1]  # 2 rows: the 3-row graph (its guard: 2 <= M <= 4)
    assert codes[3].count(SIBLINGS_OP + "(") == 1 and MEMBER_OP + "(" not in codes[3]
    assert "siblings" not in codes[7] and MEMBER_OP not in codes[7]  # each member: Inductor's own dequantize + mm


@pytest.mark.parametrize("case, expected", [
    ("act order", "not one call with its siblings (q, k, v): GPTQ's act order"),
    ("forced reference", "kernel reference runs no sibling calls of int4_weight_only_mm"),
])
def test_siblings_that_stay_apart_say_why(case, expected):
    model = Attention(act_order=(True, True, True) if case == "act order" else (False,) * 3).eval()
    x = torch.randn(5, 256).to(BF16)
    options = {"kernel": "reference"} if case == "forced reference" else {}
    out, code, report = compiled_code_and_report(model, x, **options)
    with torch.no_grad():
        assert_close(out, model(x))
    assert "siblings" not in code and code.count(MEMBER_OP + "(") == 3
    assert all(expected in record.note for record in report.fused), [record.note for record in report.fused]


def test_linears_of_other_activations_are_no_siblings():
    model = Attention().eval()
    x, y = torch.randn(5, 256).to(BF16), torch.randn(5, 256).to(BF16)
    out, code, report = compiled_code_and_report(model, x, y)
    with torch.no_grad():
        assert_close(out, model(x, y))
    assert code.count("int4_weight_only_mm_siblings.default(") == 1  # q and k; v reads y
    assert "one call with its siblings q, k " in report.fused[0].note
    assert "siblings" not in report.fused[2].note


def test_switched_off_with_the_family():
    model = Attention().eval()
    x = torch.randn(5, 256).to(BF16)
    families = [family for family in qfuse.config.PATTERN_FAMILIES if family != "sibling_linears"]
    _, code, report = compiled_code_and_report(model, x, patterns=families)
    assert "siblings" not in code and len(report.fused) == 3


def test_not_under_freezing():
    """Freezing's lowerings take constant weights one by one (the CPU int4pack packed at compile time)."""
    model = Attention().eval()
    x = torch.randn(5, 256).to(BF16)
    with torch._inductor.config.patch(freezing=True):
        out, code, report = compiled_code_and_report(model, x)
    with torch.no_grad():
        assert_close(out, model(x))
    assert "siblings" not in code and len(report.fused) == 3


def test_weight_side_inputs_computed_on_every_call_are_named():
    """A joined weight is made once, so its members' weights, scales and zero points must be the same memory on every
    call: graph inputs and views of them. A scale the graph computes (torchao's bf16 linears cast a float32 scale in
    the forward) is a new tensor every call: such siblings stay apart (the GPU test runs torchao's own,
    tests/test_cuda.py::test_torchao_int8_weight_only_under_cuda_graphs)."""
    from qfuse.passes.families.sibling_linears import _computed_per_call

    graph = torch.fx.Graph()
    weight, scale = graph.placeholder("weight"), graph.placeholder("scale")
    viewed = graph.call_function(torch.ops.aten.permute.default, (graph.call_function(
        torch.ops.aten.reshape.default, (weight, [4, 4])), [1, 0]))
    cast = graph.call_function(torch.ops.prims.convert_element_type.default, (scale, BF16))
    cast_view = graph.call_function(torch.ops.aten.reshape.default, (cast, [4]))
    assert _computed_per_call(weight) is None and _computed_per_call(viewed) is None and _computed_per_call(None) is None
    assert _computed_per_call(cast) is cast and _computed_per_call(cast_view) is cast


class QuantizingSiblings(nn.Module):
    """Three W8A8 linears that each quantize x per token with a chain of their own, as model code writes them."""

    def __init__(self):
        super().__init__()
        from tests.peers.hf_llama import ReferenceW8A8Linear

        torch.manual_seed(0)
        self.linears = nn.ModuleList(ReferenceW8A8Linear.from_linear(nn.Linear(256, n)) for n in (96, 32, 32))

    def forward(self, x):
        return torch.cat([linear(x) * 2 for linear in self.linears], dim=-1)


@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)], ids=["M1", "M5", "3D"])
def test_activations_quantized_alike_are_one_activation(lead, monkeypatch):
    """Equal chains of pure ops on one input are one value (the CPU `torch` kernel declared to run 8-bit
    siblings here: on this CPU no kernel does); the later members' weight views are moved before the call."""
    from qfuse.kernels.torch_native import TorchKernel

    monkeypatch.setattr(TorchKernel, "runs_siblings_of", ("scaled_mm",))
    model = QuantizingSiblings().eval()
    x = torch.randn(*lead, 256)
    out, code, report = compiled_code_and_report(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert code.count("qfuse.scaled_mm_siblings.default(") == 1 and "qfuse.scaled_mm.default(" not in code
    assert all("one call with its siblings linears.0, linears.1, linears.2" in record.note for record in report.fused)


def test_value_numbers_stay_shallow_on_a_deep_residual_stream():
    """Equal pure calls on equal values get one number, and a key holds numbers, not the calls under them: a
    residual stream's calls written out in full double with every layer (a decoder's 8 layers hung the compile)."""
    from qfuse.passes.families.sibling_linears import _ValueNumbers

    def stream(x):
        for _ in range(64):
            x = x + torch.sin(x)
        return torch.abs(x).amax(-1) / 127, torch.abs(x).amax(-1) / 127, torch.abs(x).amax(-1) / 128

    graph = torch.fx.experimental.proxy_tensor.make_fx(stream)(torch.randn(4, 8)).graph
    numbers = _ValueNumbers(graph)
    first, second, third = next(node for node in graph.nodes if node.op == "output").args[0]
    assert numbers.key(first) == numbers.key(second) != numbers.key(third)


def test_buffers_written_in_place_and_fresh_memory_are_no_shared_value():
    from qfuse.passes.families.sibling_linears import _ValueNumbers

    def written(x):
        first, second = torch.empty_like(x), torch.empty_like(x)
        torch.ops.aten.copy_(first, x)
        torch.ops.aten.copy_(second, x * 2)
        return first.abs(), second.abs(), torch.rand_like(x), torch.rand_like(x)

    graph = torch.fx.experimental.proxy_tensor.make_fx(written)(torch.randn(4, 8)).graph
    numbers = _ValueNumbers(graph)
    first, second, random_one, random_two = next(node for node in graph.nodes if node.op == "output").args[0]
    assert numbers.key(first) != numbers.key(second) and numbers.key(random_one) != numbers.key(random_two)
