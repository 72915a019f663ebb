"""The `onednn` kernel's lowering of `qfuse::scaled_mm` with a per-row activation scale: oneDNN's qlinear
takes one activation scale, so the extern op runs qlinear with the weight scale alone (float32 out), and
the per-row scale, the bias and the cast follow in Inductor's pointwise code, where they fuse with the
linear's consumer (in the op they would be eager torch ops after it):

    out = (qfuse.scaled_mm(a, b, None, scale_b, None, azp_a, azp_b, float32) * scale_a + bias).to(out_dtype)

Every other call of the kernel is the op's extern call, whole.
"""

from __future__ import annotations

import torch

from qfuse.kernels.onednn import OneDnnKernel
from qfuse.lowerings.aten_linear import scaled_epilogue
from qfuse.lowerings.dispatch import KernelLowering
from qfuse.lowerings.ir import as_matrix, rows_and_k, extern_call, known_equal, lower, numel, record_lowering
from qfuse.ops.scaled_mm import ScaledMmArgs

aten = torch.ops.aten


def _why_not(call: ScaledMmArgs) -> str:
    """'' where the call has a per-row int8 activation scale (and at most one activation zero point)."""
    rows = rows_and_k(call.a)[0]
    per_row = (call.a.get_dtype() == torch.int8 and call.scale_a is not None and not known_equal(numel(call.scale_a), 1)
               and known_equal(numel(call.scale_a), rows) and (call.azp_a is None or known_equal(numel(call.azp_a), 1)))
    return "" if per_row else "kernel 'onednn' runs as an extern call (oneDNN's qlinear takes the call whole)"


def _lower(call: ScaledMmArgs):
    _, lead, rows, _ = as_matrix(call.a)
    n = call.b.get_size()[1]
    record_lowering("extern call (oneDNN qlinear, weight scale); per-row scale, bias and cast in Inductor's pointwise code")
    acc = lower(aten.reshape.default, extern_call(call._replace(scale_a=None, bias=None, out_dtype=torch.float32)), [rows, n])
    out = scaled_epilogue(acc, call.scale_a, None, call.bias, rows, call.out_dtype)
    return lower(aten.reshape.default, out, [*lead, n])


KERNEL = OneDnnKernel.name
LOWERINGS = {ScaledMmArgs: KernelLowering(_why_not, _lower)}
