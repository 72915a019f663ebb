"""Generated quantized linears: the forms users write, and near forms that must not fuse.

A `Case` is plain data, so a failing case prints as its own repro; `build(case)` writes the model
the way that form's users write it and returns (function, inputs). Forms:

    hand_written   quantize the activation, torch._int_mm / torch._scaled_mm, scales, bias (vLLM's
                   torch fallbacks, model code); int8 or fp8; dynamic per-token / per-tensor or static
    pt2e           quantized_decomposed Q/DQ around F.linear (int8 / uint8, zero points)
    fake_quant     F.linear of fake-quantized operands (QAT, compressed-tensors' qdq state)
    weight_only    F.linear of an int8 weight dequantized per channel (float activation)
    mlp            two hand-written int8 linears with SiLU between

Near forms (same look, different math; qfuse must leave them alone):

    unrounded      fake_quant without the round: the activation is not an integer grid
    wide_clamp     fake_quant clamped to [-300, 300]: not int8
    scale_along_k  fake_quant with a weight scale that varies along K: no per-channel scheme
    row_scaled     F.linear(x, int8 weight) times a per-row scale of x: not a weight dequantize
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers quantized_decomposed)
import torch.nn.functional as F

from qfuse.kernels.torch_native import EMULATED_INT8_MAX_ROWS, EMULATED_INT8_MIN_WEIGHT
from tests.helpers import INT8_DOT_HERE

qd = torch.ops.quantized_decomposed
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
STATIC_SCALE = 0.05
FORMS = ("hand_written", "pt2e", "fake_quant", "weight_only", "mlp")
NEAR_FORMS = ("unrounded", "wide_clamp", "scale_along_k", "row_scaled")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: where the cases run: CI runs them on the CPU; `QFUSE_FUZZ_DEVICE=cuda` on a GPU machine, where only
#: the numerics are judged (which linears must fuse is written down for the CPU kernels)
DEVICE = os.environ.get("QFUSE_FUZZ_DEVICE", "cpu")


@dataclass(frozen=True)
class Case:
    form: str
    quant: str = "int8"  # int8 | uint8 | fp8: the quantized dtype (the weight's, for weight_only)
    activation: str = "dynamic_token"  # dynamic_token | dynamic_tensor | static_tensor
    weight: str = "channel"  # channel | tensor
    scale_spelling: str = "[N]"  # the weight scale: [N] | [1, N] | [N, 1].t() | one_element | python
    bias: bool = True
    leading: tuple[int, ...] = (9,)  # the activation's leading dims: (M,) or (B, M)
    k: int = 64
    n: int = 48
    dtype: str = "float32"  # the model's float dtype
    second_user: str = ""  # "" | "quantized" | "accumulator": that intermediate is returned too
    dynamic: bool = False  # torch.compile(dynamic=True)
    saturate: bool = False  # the activation goes far outside a static scale's range
    special: str = ""  # "" | "inf" | "nan": one activation element
    gemm: str = "int_mm"  # hand_written int8: "int_mm" | "float_mm" (a float matmul of the upcast integers)
    clamp_low: int = -128  # hand_written int8: the quantizer's lower bound (-127: symmetric)
    kernel: str = ""  # a kernel forced through options={"kernel": ...} ("": qfuse chooses)
    seed: int = 0

    @property
    def float_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def near(self) -> bool:
        return self.form in NEAR_FORMS

    def repro(self) -> str:
        return f"python -m tests.fuzz.repro \"{self!r}\""

    @property
    def int8_written_in_float(self) -> bool:
        """An int8 W8A8 linear whose graph multiplies float operands (PT2E, fake quant, a float matmul of upcast
        integers): Inductor's own code for it is a float GEMM."""
        float_matmul = self.form in ("pt2e", "fake_quant") or self.gemm == "float_mm"
        return float_matmul and self.quant != "fp8" and not (self.form == "fake_quant" and self.dtype != "float32")

    def why_it_may_stay_unfused(self) -> str:
        """'' when qfuse must fuse every linear of the case on this CPU, else why it need not."""
        if self.near:
            return "a near form: only a weight-only linear of its float activation may fuse"
        if self.second_user == "accumulator":
            return "the accumulator has another user, so the epilogue cannot move into a fused op"
        if self.kernel not in ("", "reference"):
            return f"the forced kernel {self.kernel!r} takes what its capability table takes; the rest stays Inductor's"
        float_matmul = self.form in ("pt2e", "fake_quant", "weight_only") or self.gemm == "float_mm"
        rows = math.prod(self.leading)
        # Inductor's CPU decompositions (torch 2.13): decompose_mem_bound_mm takes M == 1 with K, N <= 2048,
        # the mm decomposition K == 1 with M + N <= 32
        shapes = [(self.k, self.n)] + ([(self.n, self.k)] if self.form == "mlp" else [])  # each linear's (K, N)
        if float_matmul and (rows == 1 or any(k == 1 and rows > 1 and n > 1 and rows + n <= 32 for k, n in shapes)):
            return "Inductor turns this small float matmul into pointwise code and a sum before qfuse runs"
        if self.gemm == "float_mm" and self.dtype != "float32":
            return "a bf16 / fp16 matmul rounds (fp16: overflows) the integer sums an int8 GEMM keeps exact"
        weight_only_runs = self.dtype == "bfloat16" and self.quant == "int8" and self.k % 16 == 0
        if self.form == "weight_only" and not weight_only_runs:
            return "weight-only int8 runs on CPU only for bf16 activations with K % 16 == 0"
        if self.form == "fake_quant" and self.dtype != "float32" and not weight_only_runs:
            return ("a fake-quantized activation in bf16 / fp16 rounds q * s, so it is no integer GEMM; "
                    "weight-only runs for bf16 with K % 16 == 0 only")
        if self.int8_written_in_float and not INT8_DOT_HERE and (
                rows > EMULATED_INT8_MAX_ROWS or min(k * n for k, n in shapes) < EMULATED_INT8_MIN_WEIGHT):
            return ("this CPU has no int8 dot instructions: the torch kernel leaves an int8 linear written in float "
                    "to Inductor's float GEMM (tests/helpers.INT8_DOT_HERE)")
        return ""


def _generator(case: Case, offset: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(case.seed * 7919 + offset)


def activation(case: Case) -> torch.Tensor:
    generator = _generator(case)
    x = torch.randn(*case.leading, case.k, generator=generator)
    if case.saturate:
        x = x * 40  # |x| / 0.05 far beyond 127: a static quantizer saturates
    if case.special and x.numel():
        x.view(-1)[x.numel() // 2] = float(case.special)
    return x.to(case.float_dtype)


def quantized_weight(case: Case, n: int, k: int, offset: int = 1) -> torch.Tensor:
    """[n, k] in the case's quantized dtype (fp8: integers up to 127 are exact in e4m3 only below 16,
    so fp8 weights are drawn in fp8's own range)."""
    generator = _generator(case, offset)
    if case.quant == "fp8":
        return (torch.randn(n, k, generator=generator) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)


def weight_scale(case: Case, n: int, offset: int = 2):
    """The weight scale as the case spells it; per-channel values differ per column."""
    generator = _generator(case, offset)
    if case.weight == "tensor" or case.scale_spelling in ("one_element", "python"):
        value = 0.002
        return value if case.scale_spelling == "python" else torch.tensor([value])
    scale = torch.rand(n, generator=generator) * 0.01 + 0.001
    return {"[N]": scale, "[1, N]": scale.reshape(1, n), "[N, 1].t()": scale.reshape(n, 1)}[case.scale_spelling]


def column_scale(scale):
    """A weight scale spelled per column of the [M, N] output ([N, 1] is stored that way and transposed)."""
    return scale.t() if isinstance(scale, torch.Tensor) and scale.dim() == 2 and scale.shape[1] == 1 else scale


def bias_of(case: Case, n: int, offset: int = 3):
    return torch.randn(n, generator=_generator(case, offset)).to(case.float_dtype) if case.bias else None


# --- hand-written: quantize, integer / fp8 GEMM, scales ---------------------------------------

def activation_scale(case: Case, x: torch.Tensor, qmax: float):
    if case.activation == "dynamic_token":
        return x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5) / qmax
    if case.activation == "dynamic_tensor":
        return x.abs().amax().clamp(min=1e-5) / qmax
    return STATIC_SCALE if case.scale_spelling == "python" else torch.tensor(STATIC_SCALE, device=x.device)


def hand_written_linear(case: Case, x, w, w_scale, bias, extras: list):
    """x [..., K] float -> [..., N]: vLLM's torch fallback shape (quantize in fp32, GEMM on 2D rows)."""
    xf = x.to(torch.float32)
    k = xf.shape[-1]
    if case.quant == "fp8":
        s = activation_scale(case, xf, FP8_MAX)
        q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        one = torch.ones((), dtype=torch.float32, device=x.device)
        acc = torch._scaled_mm(q.reshape(-1, k), w.t(), one, one, out_dtype=torch.float32)
    else:
        s = activation_scale(case, xf, 127.0)
        q = torch.clamp(torch.round(xf / s), case.clamp_low, 127).to(torch.int8)
        if case.gemm == "float_mm":  # in the model's dtype: fp16 overflows where the int32 sum does not
            acc = q.reshape(-1, k).to(x.dtype) @ w.to(x.dtype).t()
        else:
            acc = torch._int_mm(q.reshape(-1, k), w.t())
    row_scale = s.reshape(-1, 1) if isinstance(s, torch.Tensor) and s.dim() == xf.dim() else s
    y = acc.to(torch.float32) * row_scale * column_scale(w_scale)
    if bias is not None:
        y = y + bias.to(torch.float32)
    extras += {"quantized": [q], "accumulator": [acc]}.get(case.second_user, [])
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


# --- PT2E Q/DQ ---------------------------------------------------------------------------------

def pt2e_linear(case: Case, x, w, w_scale, bias, extras: list):
    low, high, zero_point = (0, 255, 131) if case.quant == "uint8" else (-128, 127, 3)
    dtype = torch.uint8 if case.quant == "uint8" else torch.int8
    if case.activation == "dynamic_token":
        scales, zero_points = qd.choose_qparams_per_token_asymmetric(x, torch.int8)
        q = qd.quantize_per_token(x, scales, zero_points, -128, 127, torch.int8)
        x_hat = qd.dequantize_per_token(q, scales, zero_points, -128, 127, torch.int8, torch.float32)
    elif case.scale_spelling == "python":
        q = qd.quantize_per_tensor(x, STATIC_SCALE, zero_point, low, high, dtype)
        x_hat = qd.dequantize_per_tensor(q, STATIC_SCALE, zero_point, low, high, dtype)
    else:
        scale, zp = torch.tensor([STATIC_SCALE], device=x.device), torch.tensor([zero_point], device=x.device)
        q = qd.quantize_per_tensor.tensor(x, scale, zp, low, high, dtype)
        x_hat = qd.dequantize_per_tensor.tensor(q, scale, zp, low, high, dtype)
    if case.weight == "tensor":
        w_hat = qd.dequantize_per_tensor(w, 0.002, 0, -128, 127, torch.int8)
    else:
        w_hat = qd.dequantize_per_channel(w, w_scale.reshape(-1), torch.zeros(w.shape[0], dtype=torch.int64, device=w.device), 0, -128, 127, torch.int8)
    extras += [q] if case.second_user == "quantized" else []
    return F.linear(x_hat, w_hat, bias)


# --- fake-quantized float operands, and the near forms of it -------------------------------------

def fake_quant_linear(case: Case, x, w, w_scale, bias, extras: list):
    qmax = FP8_MAX if case.quant == "fp8" else 127.0
    s = activation_scale(case, x, qmax)
    if case.quant == "fp8":
        x_hat = (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).to(x.dtype) * s
    elif case.form == "unrounded":
        x_hat = torch.clamp(x / s, -128, 127) * s
    elif case.form == "wide_clamp":
        x_hat = torch.clamp(torch.round(x / s), -300, 300) * s
    else:
        x_hat = torch.clamp(torch.round(x / s), -128, 127) * s
    per_row = w_scale.reshape(-1, 1) if isinstance(w_scale, torch.Tensor) and w_scale.numel() > 1 else w_scale
    per_row = per_row.to(x.dtype) if isinstance(per_row, torch.Tensor) else per_row  # stored in the model's dtype
    if case.form == "scale_along_k":
        per_row = torch.linspace(0.001, 0.01, w.shape[1], dtype=x.dtype, device=x.device)
    w_hat = w.to(x.dtype) * per_row
    extras += [x_hat] if case.second_user == "quantized" else []
    return F.linear(x_hat, w_hat.to(x.dtype), bias)


# --- weight-only --------------------------------------------------------------------------------

def weight_only_linear(case: Case, x, w, w_scale, bias, extras: list):
    """The scale is stored in the activation's dtype, as GPTQ / AWQ / torchao store it."""
    per_row = w_scale.reshape(-1, 1) if isinstance(w_scale, torch.Tensor) and w_scale.numel() > 1 else w_scale
    per_row = per_row.to(x.dtype) if isinstance(per_row, torch.Tensor) else per_row
    if case.form == "row_scaled":
        return F.linear(x, w.to(x.dtype), bias) * x.abs().amax(dim=-1, keepdim=True)
    return F.linear(x, (w.to(x.dtype) * per_row).to(x.dtype), bias)


LINEARS = {
    "hand_written": hand_written_linear, "mlp": hand_written_linear, "pt2e": pt2e_linear,
    "fake_quant": fake_quant_linear, "unrounded": fake_quant_linear, "wide_clamp": fake_quant_linear,
    "scale_along_k": fake_quant_linear, "weight_only": weight_only_linear, "row_scaled": weight_only_linear,
}


class GeneratedModel(torch.nn.Module):
    """The case's linear (or MLP) with its weights as buffers, as a model holds them: static shapes
    under `dynamic=True`, where only the activation's sizes vary. Python-number scales stay numbers."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.case = case
        weights = [quantized_weight(case, case.n, case.k), weight_scale(case, case.n), bias_of(case, case.n)]
        if case.form == "mlp":
            weights += [quantized_weight(case, case.k, case.n, offset=11), weight_scale(case, case.k, offset=12),
                        bias_of(case, case.k, offset=13)]
        self.names = []
        for index, value in enumerate(weights):
            name = f"weight_{index}"
            if isinstance(value, torch.Tensor):
                self.register_buffer(name, value)
            else:
                setattr(self, name, value)
            self.names.append(name)

    def weights(self, first: int) -> list:
        return [getattr(self, name) for name in self.names[first:first + 3]]

    def forward(self, x):
        extras: list = []
        linear = LINEARS[self.case.form]
        y = linear(self.case, x, *self.weights(0), extras)
        if self.case.form == "mlp":
            y = linear(self.case, F.silu(y), *self.weights(3), extras)
        return (y, *extras) if extras else y


def build(case: Case, device: str = DEVICE) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """(model, inputs) of the case on `device`: model(x) returns the output, or a tuple of it and the
    intermediates the case returns as well."""
    return GeneratedModel(case).to(device), [activation(case).to(device)]
