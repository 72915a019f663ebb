"""A tiny Hugging Face Llama (built from a config) with quantized decoder linears: every one fuses."""

import pytest
import torch

import qfuse
from tests.peers import hf_llama

AVAILABLE, WHY = hf_llama.available()
pytestmark = pytest.mark.skipif(not AVAILABLE, reason=WHY)


@pytest.mark.parametrize("build, scheme", [
    (hf_llama.llama_w8a8_reference, "int8 dyn-token x per-channel"),
    (hf_llama.llama_transformers_fp8, "fp8 dyn-token x per-channel"),
], ids=["plain_torch_int8", "transformers_fp8_scaled_mm"])
def test_every_decoder_linear_fuses_and_matches_eager(build, scheme):
    model, input_ids = build()
    with torch.no_grad():
        expected = model(input_ids).logits
        explanation = qfuse.explain(model, input_ids)
        out = torch.compile(model, backend="qfuse")(input_ids).logits
    fused = [record for record in explanation.records if record.fused]
    assert len(fused) == 14 and len(explanation.records) == 14, explanation
    assert {record.scheme for record in fused} == {scheme}
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
