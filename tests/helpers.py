"""Helpers shared by the pass tests."""

import copy

import pytest
import torch

import qfuse
from qfuse.platform import current_platform

#: this CPU multiplies int8 on int8 dot instructions (AVX-512 VNNI, AMX). Without them the `torch` kernel leaves an
#: int8 linear written in float (PT2E, fake quant, a float matmul of upcast integers) to Inductor's float GEMM, as
#: measured faster (`torch_native.EMULATED_INT8_MAX_ROWS`): tests of those rewrites force it there
#: (`FLOAT_WRITTEN_INT8`), and tests of kernel choice expect the linear unfused.
INT8_DOT_HERE = current_platform("cpu").cpu_has_int8_dot_products
FLOAT_WRITTEN_INT8: dict = {} if INT8_DOT_HERE else {"kernel": "torch"}


#: Triton kernels on the CPU run in its interpreter (tests/conftest.py): their larger grids go to the slow tier
slow_when_interpreted = pytest.mark.slow if not torch.cuda.is_available() else (lambda test: test)


def compile_and_run(fn, *args, dynamic=None, **options):
    """Compile `fn` with backend="qfuse", run it, return (output, the report of its last graph)."""
    marker = qfuse.graphs_compiled()
    compiled = torch.compile(fn, backend="qfuse", options=options or None, dynamic=dynamic)
    out = compiled(*args)
    reports = qfuse.reports_since(marker)
    assert reports, "qfuse's pass did not run"
    return out, reports[-1]


def compile_and_get_code(model, x, **compile_kwargs):
    """Compile `model` with backend="qfuse" (and `compile_kwargs`: mode, dynamic), run it on `x`:
    (output, the generated code, the report of its last graph)."""
    from torch._inductor.utils import run_and_get_code

    marker = qfuse.graphs_compiled()
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(model, backend="qfuse", **compile_kwargs), x)
    return out, "\n".join(code), qfuse.reports_since(marker)[-1]


def eager_compiled_and_explained(model, x):
    """(model(x), the output of `model` compiled with backend="qfuse", `qfuse.explain(model, x)`), without grad."""
    with torch.no_grad():
        return model(x), torch.compile(model, backend="qfuse")(x), qfuse.explain(model, x)


def outputs_and_code_per_call(compiled, calls):
    """Run `compiled(*args)` for each args of `calls` in turn, without resetting Dynamo: a list of
    (output, the code Inductor generated during that call: '' where an earlier compile served it)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    results = []
    for args in calls:
        code = []
        with mock.patch.object(GraphLowering, "save_output_code", code.append):
            results.append((compiled(*args), "\n".join(code)))
    return results


def assert_one_compile_per_m_bucket(model, template_mark: str, extern_call: str, bounds=(16,), k: int = 256,
                                     ms=(1, 16, 40, 1000, 5, 64, 200, 130, 33, 24)):
    """A weight-only GPU `model` compiled with dynamic=True and called at each M of `ms`: M = 1 is static
    (Dynamo specializes it); a dynamic M is guarded on the template's M buckets (`bounds`, ascending),
    the template (`template_mark` in its code) up to the last bound, Inductor's dequantize + mm above:
    each bucket compiled once, never the op's extern call; every output close to eager. Dynamo starts
    afresh (what it compiled for another model of the same class would count here)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="qfuse", dynamic=True)
    calls = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),) for m in ms]
    with torch.no_grad():
        results = outputs_and_code_per_call(compiled, calls)
        for (out, _), (x,) in zip(results, calls):
            assert_close_to_eager(out, model, x)

    def bucket(m):
        return next((bound for bound in bounds if m <= bound), None)

    seen, compiles = set(), []
    for m in ms:
        key = "static" if m == 1 else bucket(m)
        compiles.append(key not in seen)
        seen.add(key)
    codes = [code for _, code in results]
    assert [bool(code) for code in codes] == compiles
    for m, code in zip(ms, codes):
        assert (template_mark in code) == (bool(code) and bucket(m) is not None) and extern_call not in code, m


#: What the generated code of a W4A16 linear imports: either decode template's main loop (int4_mm.int4_dot,
#: int4_planes.plane_dot), and the prefill weight's dequantize template (lowerings/triton/dequantize.py).
DECODE_MARKS = ("import int4_dot", "import plane_dot")
DEQUANTIZE_MARK = "import int4_weight_tile"


def decode_template_in(code: str) -> bool:
    return any(mark in code for mark in DECODE_MARKS)


#: One rounding of a result in each activation dtype (the templates' numerics against eager).
ROUNDING = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}


def assert_close_to_eager(out, model, x):
    """`out` within two roundings of x's dtype (relative to the largest value) of `model(x)`."""
    eager = model(x)
    assert out.dtype == eager.dtype and out.shape == eager.shape
    scale = eager.float().abs().max().item()
    assert (out.float() - eager.float()).abs().max().item() <= 2 * ROUNDING[x.dtype] * scale


def eager_on_cpu(model, x):
    """`model(x)` run on a CPU copy of the model, moved back to x's device: where eager cannot run the form
    on the GPU (CUDA's `_int_mm` refuses M <= 16)."""
    return copy.deepcopy(model).cpu()(x.cpu()).to(x.device)


def records_under_cuda_graphs(model, x, eager=None):
    """The fused records of `model` compiled with mode="reduce-overhead", run three times (warm-up, capture,
    replay), its output checked against eager (`eager(x)` where given: e.g. `model` run on the CPU, where the
    GPU's eager cannot run it)."""
    compiled = torch.compile(model, backend="qfuse", mode="reduce-overhead")
    marker = qfuse.graphs_compiled()
    torch._dynamo.reset()
    with torch.no_grad():
        for _ in range(3):
            out = compiled(x)
        assert_close_to_eager(out.clone(), eager or model, x)
    report = qfuse.reports_since(marker)[-1]
    assert not report.errors, report.errors
    return report.fused


def record_under_cuda_graphs(model, x, eager=None):
    """The record of `model`'s one linear, as `records_under_cuda_graphs` makes it."""
    (record,) = records_under_cuda_graphs(model, x, eager)
    return record
