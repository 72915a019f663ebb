"""When the int8 template runs as the persistent TMA kernel (`lowerings.triton.template.why_not_persistent`),
asked of IR stand-ins: no GPU needed (the GPU runs are in test_triton_template.py)."""

import itertools

import torch
from torch._inductor import ir
from torch._inductor.graph import GraphLowering
from torch._inductor.virtualized import V
from torch.fx.experimental.proxy_tensor import make_fx

from qfuse.lowerings.triton.template import why_not_persistent

_NAMES = itertools.count()
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def buffer(size, stride, dtype):
    layout = ir.FixedLayout(torch.device("cuda"), dtype, size, stride)
    return ir.TensorBox.create(ir.InputBuffer(name=f"stand_in_{next(_NAMES)}", layout=layout))


def test_persistent_template_needs_k_contiguous_aligned_operands_and_hopper():
    """`why_not_persistent` on IR stand-ins: the layout rules hold on any machine; on a GPU without
    Hopper's TMA (or none) the device rule; on Hopper the M bound."""
    with V.set_graph_handler(GraphLowering(make_fx(lambda: None)())):
        a, b = buffer([4096, 256], [256, 1], torch.int8), buffer([256, 512], [1, 256], torch.int8)
        assert why_not_persistent(a, buffer([256, 512], [512, 1], torch.int8), 4096) == "A or B is not K-contiguous"
        assert why_not_persistent(buffer([4096, 256], [1, 4096], torch.int8), b, 4096) == "A or B is not K-contiguous"
        unaligned = "a row stride or an offset of A or B is not a static multiple of 16 bytes"
        assert why_not_persistent(buffer([4096, 200], [200, 1], torch.int8), b, 4096) == unaligned
        assert why_not_persistent(a, buffer([256, 512], [1, 260], torch.int8), 4096) == unaligned
        reason = why_not_persistent(a, b, 4096)
        if HOPPER:
            assert reason == ""
            assert "M below" in why_not_persistent(a, b, 100)
        else:
            assert reason == "this GPU or Triton has no device-side TMA descriptors"
