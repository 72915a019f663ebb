"""A tiny Hugging Face Llama (built from a config) with quantized decoder linears: every one fuses."""

import pytest
import torch

import qfuse
from tests.helpers import FLOAT_WRITTEN_INT8
from tests.peers import hf_llama

AVAILABLE, WHY = hf_llama.available()
pytestmark = [pytest.mark.skipif(not AVAILABLE, reason=WHY), pytest.mark.slow]  # whole models: 15-35 s each


@pytest.mark.parametrize("build, scheme", [
    (hf_llama.llama_w8a8_reference, "int8 dyn-token x per-channel"),
    (hf_llama.llama_transformers_fp8, "fp8 dyn-token x per-channel"),
], ids=["plain_torch_int8", "transformers_fp8_scaled_mm"])
def test_every_decoder_linear_fuses_and_matches_eager(build, scheme):
    runs, why_not = hf_llama.eager_fp8_runs_on_cpu()
    if build is hf_llama.llama_transformers_fp8 and not runs:
        pytest.skip(why_not)
    model, input_ids = build()
    with torch.no_grad():
        expected = model(input_ids).logits
        explanation = qfuse.explain(model, input_ids)
        out = torch.compile(model, backend="qfuse")(input_ids).logits
    fused = [record for record in explanation.records if record.fused]
    assert len(fused) == 14 and len(explanation.records) == 14, explanation
    assert {record.scheme for record in fused} == {scheme}
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_llama_quantized_by_torchao_int8_dynamic_fuses_every_decoder_linear():
    from tests.peers import torchao_models

    ok, why = torchao_models.available()
    if not ok:
        pytest.skip(why)
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    model, input_ids = hf_llama.tiny_llama()
    decoder = lambda module, name: name.split(".")[-1] in hf_llama.DECODER_LINEARS  # noqa: E731
    quantize_(model, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False), filter_fn=decoder)
    with torch.no_grad():
        expected = model(input_ids).logits
        explanation = qfuse.explain(model, input_ids)
        out = torch.compile(model, backend="qfuse")(input_ids).logits
        torch._dynamo.reset()
        inductor = torch.compile(model)(input_ids).logits
    assert len(explanation.fused) == 14 and len(explanation.records) == 14, explanation
    # Compiled code may round an activation to a neighbouring int8 step (torchao quantizes with a
    # reciprocal multiply): qfuse must be as close to eager as plain Inductor is.
    error, inductor_error = ((y - expected).abs().max().item() for y in (out, inductor))
    print(f"max abs error vs eager: qfuse {error:.2e}, Inductor {inductor_error:.2e}")
    assert error <= max(2 * inductor_error, 1e-3), (error, inductor_error)


def test_llama_quantized_by_compressed_tensors_fuses_every_decoder_linear():
    """W8A8 fake-quantized by compressed-tensors, in a forward without its graph break."""
    from tests.peers import compressed_tensors_models as ct

    ok, why = ct.available()
    if not ok:
        pytest.skip(why)
    model, input_ids = ct.ct_llama("W8A8", "qdq", compile_friendly=True)
    with torch.no_grad():
        expected = model(input_ids).logits
        explanation = qfuse.explain(model, input_ids, options=FLOAT_WRITTEN_INT8 or None)
        out = torch.compile(model, backend="qfuse", options=FLOAT_WRITTEN_INT8 or None)(input_ids).logits
    assert len(explanation.fused) == 14 and len(explanation.records) == 14, explanation
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)
