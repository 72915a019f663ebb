"""Models quantized with compressed-tensors: what fuses, and what a user sees where it cannot.

compressed-tensors' own forward graph-breaks before the matmul (`patch_attr`), so the peers use
its ops in a forward without that break (`compile_friendly=True`, see compressed_tensors_models).
"""

import pytest
import torch

import qfuse
from tests.helpers import FLOAT_WRITTEN_INT8
from tests.peers import compressed_tensors_models as ct

AVAILABLE, WHY = ct.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY)


def explain_and_run(model, x, options=None):
    with torch.no_grad():
        expected = model(x)
        explanation = qfuse.explain(model, x, options=options)
        out = torch.compile(model, backend="qfuse", options=options)(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    return explanation


@pytest.mark.parametrize("three_d", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["2D", "3D"])
@pytest.mark.parametrize("scheme, expected", [("W8A8", "int8 dyn-"), ("W8A8_STATIC", "int8 static-tensor asym")])
def test_fake_quantized_state_fuses_into_a_real_gemm(scheme, expected, three_d):
    model, x = ct.ct_mlp(scheme, "qdq", compile_friendly=True, three_d=three_d)
    explanation = explain_and_run(model, x, FLOAT_WRITTEN_INT8 or None)
    assert len(explanation.records) == 2 and all(record.fused for record in explanation.records), explanation
    assert all(record.scheme.startswith(expected) and record.family == "fake_quant_linear"
               for record in explanation.records)


def test_fp8_weight_with_a_zero_point_tensor_is_a_near_miss():
    """compressed-tensors keeps an fp8 weight zero point (zeros, but a graph input qfuse cannot see
    into) in the fake-quantized fp8 state; an fp8 GEMM has no zero point, so the linear stays."""
    for scheme in ("FP8_DYNAMIC", "FP8"):
        model, x = ct.ct_mlp(scheme, "qdq", compile_friendly=True)
        explanation = explain_and_run(model, x)
        assert len(explanation.records) == 2 and not explanation.fused, explanation
        assert all("has a zero point" in record.reason for record in explanation.records), explanation


def test_decompressed_checkpoint_state_is_a_near_miss_that_says_why():
    """A loaded checkpoint runs with the dequantized float weight: no integer weight is left in the graph."""
    model, x = ct.ct_mlp("W8A8", "decompressed", compile_friendly=True)
    explanation = explain_and_run(model, x)
    assert len(explanation.records) == 2 and not explanation.fused
    assert all("the weight is a float tensor" in record.reason for record in explanation.records)


@pytest.mark.slow  # a whole Llama model, as tests/peers/test_hf_llama.py's: CI's slow tier
def test_converted_to_plain_torch_int8_every_llama_linear_fuses():
    model, input_ids = ct.ct_llama_as_reference()
    with torch.no_grad():
        explanation = qfuse.explain(model, input_ids)
    assert len(explanation.fused) == 14, explanation
