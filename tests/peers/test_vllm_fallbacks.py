"""vLLM's fp8 torch fallbacks (tests/peers/vllm_fallbacks.py) fuse on this machine and match eager."""

import pytest
import torch

import qfuse
from tests.peers.vllm_fallbacks import VllmFp8Linear

K, N = 64, 48
FORMS = [("per_tensor", False), ("row_wise", True), ("channelwise", True), ("channelwise", False)]

pytestmark = pytest.mark.slow  # a grid of forms x shapes x dtypes: CI's slow tier


@pytest.mark.parametrize("pad_tokens", [False, True], ids=["unpadded", "padded17"])
@pytest.mark.parametrize("shape", [(1, K), (5, K), (2, 3, K)], ids=["M1", "M5", "3D"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind, dynamic", FORMS, ids=[f"{kind}-{'dyn' if dyn else 'static'}" for kind, dyn in FORMS])
def test_fallback_fuses_and_matches_eager(kind, dynamic, dtype, shape, pad_tokens):
    model = VllmFp8Linear(K, N, kind, dynamic=dynamic, pad_tokens=pad_tokens)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = model(x)
    explanation = qfuse.explain(model, x)
    (record,) = explanation.records
    assert record.fused, record.reason
    expected_scheme = "fp8 dyn-token" if dynamic else "fp8 static-tensor"
    assert record.scheme.startswith(expected_scheme)
    out = torch.compile(model, backend="qfuse")(x)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
