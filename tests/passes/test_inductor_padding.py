"""inductor_padding: a quantized linear whose rows Inductor's pad_mm padded (CUDA, by a cached timing) is
fused as if unpadded. On CPU pad_mm never pads, so these models write its graph themselves:
mm(constant_pad_nd(x, [0, 0, 0, p]), w) sliced back to x's rows."""

import pytest
import torch
import torch.nn.functional as F

from qfuse.passes.core.inductor_padding import UNPADDED
from tests.helpers import assert_close_to_eager, compile_and_get_code
from tests.peers.weight_only_models import gptq_packed_int4, hand_written_int8

PADDING = 3


def linear_with_padded_rows(x, weight, bias=None):
    """F.linear as pad_mm leaves it: the activation's rows padded to a multiple of 8, the output sliced."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.mm(F.pad(rows, (0, 0, 0, PADDING)), weight.t())[:-PADDING]
    out = out if bias is None else out + bias
    return out.reshape(*x.shape[:-1], -1)


class ScaleAfterPaddedMatmul(torch.nn.Module):
    """torchao's int8 weight-only linear, `(x @ w.t().to(x.dtype)) * s`, its matmul padded by pad_mm."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        rows = F.pad(x.reshape(-1, x.shape[-1]), (0, 0, 0, PADDING))
        out = torch.mm(rows, self.inner.weight.t().to(x.dtype))[:x.numel() // x.shape[-1]]
        return (out * self.inner.weight_scale.to(x.dtype)).reshape(*x.shape[:-1], -1)


@pytest.fixture
def padded_linear(monkeypatch):
    monkeypatch.setattr(F, "linear", linear_with_padded_rows)


@pytest.mark.parametrize("lead", [(5,), (2, 3), (1,)], ids=["M5", "3D", "M1"])
@pytest.mark.parametrize("form", ["gptq int4", "int8 weight-only, scale after"])
def test_a_padded_quantized_linear_is_fused_unpadded(padded_linear, form, lead):
    if form == "gptq int4":
        model = gptq_packed_int4(torch.bfloat16, group_size=32, bias=True)
    else:
        model = ScaleAfterPaddedMatmul(hand_written_int8(torch.bfloat16, scale_after_matmul=True, in_features=256,
                                                         bias=False))
    x = torch.randn(*lead, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    (record,) = report.fused
    assert UNPADDED in record.note, record.note
    assert report.unpadded_from_inductor == [record.node]
    assert "constant_pad_nd" not in code  # the activation is not copied


def test_what_is_not_a_quantized_linears_row_padding_stays(padded_linear):
    """A float linear keeps Inductor's padding; a pad of the columns too, or a slice keeping other rows, is
    no row padding to take back."""

    def float_linear(x, w):
        return F.linear(x, w)

    def columns_padded_too(x, model):  # pad_mm's padding of K: x's columns and w's rows
        w = F.pad(model.weight.t().to(x.dtype), (0, 0, 0, 8))
        return torch.mm(F.pad(x, (0, 8, 0, PADDING)), w)[:-PADDING]

    def rows_dropped(x, model):
        return torch.mm(F.pad(x, (0, 0, 0, PADDING)), model.weight.t().to(x.dtype))[:-PADDING - 1]

    x = torch.randn(5, 256, dtype=torch.bfloat16)
    int8 = hand_written_int8(torch.bfloat16, scale_after_matmul=True, in_features=256, bias=False)
    for fn, args in ((float_linear, (torch.randn(64, 256, dtype=torch.bfloat16),)), (columns_padded_too, (int8,)),
                     (rows_dropped, (int8,))):
        torch._dynamo.reset()
        with torch.no_grad():
            out, _, report = compile_and_get_code(lambda x: fn(x, *args), x)
            torch.testing.assert_close(out, fn(x, *args), rtol=2**-7, atol=1e-2)
        assert not report.unpadded_from_inductor, fn.__name__
