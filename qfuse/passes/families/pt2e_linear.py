"""pt2e_linear: a PT2E Q/DQ linear (torch.ops.quantized_decomposed) -> qfuse::scaled_mm.

Plain Inductor (without freezing) dequantizes the weight to float on every call and runs a float
GEMM. This pass feeds the integer tensors straight into a real int8 GEMM instead, on CPU and GPU:

    linear      mm(A, B) | addmm(bias, A, B)            (3D inputs: A = reshape(...); operands
                                                         zero-padded by Inductor's shape padding)
                | bmm(expand(A), expand(B))              (3D inputs that are not contiguous)
    activation  A = dequantize_per_tensor(q, scale, zero_point, ...)     .default: Python numbers
                  | dequantize_per_tensor.tensor(q, scale, zero_point, ...)        tensors
                  | dequantize_per_token(q, scales, zero_points, ...)              per token
    weight      B = permute(dequantize_per_channel(w_q, scales, zero_points, axis=0, ...), [1, 0])
                  | permute(dequantize_per_tensor(w_q, scale, zero_point, ...), [1, 0])
                  (or without the permute for a [K, N] weight, per-channel axis 1)

Only the dequantize side matters for the math: q and w_q are integer tensors and
dequantize(q) = (q - zero_point) * scale, whoever produced q (the activation quantize op stays in
the graph, where Inductor generates code for it). uint8 activations are shifted to int8 (q - 128,
computed as q ^ 0x80 read as int8, which Inductor's CPU code vectorizes; zero_point - 128). Zero
points go to the fused op (`azp_a`, `azp_b`), so asymmetric activations and weights are exact.

Weight-only: when the activation is a plain float tensor (bf16 / fp16 / fp32, not dequantized) and
the weight an int8 (an integer zero point allowed) or fp8 dequantize, per tensor or per output
channel, the linear is
weight-only (W8A16) and becomes `qfuse::weight_only_scaled_mm(x, b, scale_b, bias, azp_b)`, for the
kernels whose capability table has a weight-only row.

The linear itself is read by `passes/forms/dequantized_linear.py` (shared with the fake-quant forms):
int8 / uint8 activation, int8 weight, per-channel axis on the output channels, addmm without
beta / alpha, a float result; a near miss leaves the graph untouched.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from qfuse.passes.forms.dequantized_linear import ANCHORS, Dequantized, analyze_dequantized_linear
from qfuse.passes.core.fused_linear import FusedLinear, PassContext, fuse_anchored_linears
from qfuse.schemes import Granularity


def _decomposed():
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)

    return torch.ops.quantized_decomposed


FAMILY = "pt2e_linear"


def match_dequantize(node) -> Dequantized | None:
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    qd = _decomposed()
    target = node.target
    if target in (qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor):
        kind = "dq_per_tensor" + (".tensor" if target == qd.dequantize_per_tensor.tensor else "")
        return Dequantized(node.args[0], node.args[1], node.args[2], Granularity.PER_TENSOR, kind)
    if target == qd.dequantize_per_token.default:
        return Dequantized(node.args[0], node.args[1], node.args[2], Granularity.PER_TOKEN, "dq_per_token")
    if target == qd.dequantize_per_channel.default:
        return Dequantized(
            node.args[0], node.args[1], node.args[2], Granularity.PER_CHANNEL, "dq_per_channel", axis=node.args[3]
        )
    return None


def analyze(anchor: Node) -> FusedLinear | None:
    return analyze_dequantized_linear(anchor, match_dequantize, FAMILY)


def run(graph: Graph, context: PassContext) -> None:
    fuse_anchored_linears(graph, context, FAMILY, ANCHORS, analyze)
