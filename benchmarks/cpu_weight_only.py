"""CPU micro-benchmark for issue #14 (part 2): which kernel a weight-only linear should run on CPU.

Weight-only linears keep the activation in bf16 (or fp32) and quantize only the weight: int8 with a
scale per output channel, or int4 with a scale per group of `group` input channels (GPTQ style).
Plain Inductor compiles the hand-written forms of these into "dequantize the whole weight, then a
bf16 / fp32 GEMM" on every call. This script times, in one process and in turns, what qfuse could
run instead, at M in --m for each case "section:KxN" of --cases (K input, N output features):

    int8-bf16 / int8-fp32    int8 weight [N, K], scale [N] (activation dtype), activation bf16 / fp32
      inductor               torch.compile of F.linear(x, w_int8.to(x.dtype) * scale[:, None])
      inductor freezing      the same with torch._inductor.config.freezing = True
      qfuse                  the same compiled with backend="qfuse"
      qfuse freezing + max-autotune   the same, with freezing + max_autotune (ATen and CPP GEMM backends)
      inductor scale-after   torch.compile of F.linear(x3d, w_int8.to(x.dtype)) * scale, x3d = x[None]
                             (the form Inductor's weight-only pattern matches; bf16 only)
      int8pack eager         torch.ops.aten._weight_int8pack_mm(x, w_int8, scale)
      int8pack compiled      the same op inside torch.compile (Inductor's default lowering)
      int8pack C++ template  the same, compiled with freezing + max_autotune, CPP GEMM backend only
      F.linear bf16 / fp32   the weight dequantized once to the activation dtype (the float baseline)
      int8pack via bf16 x    (fp32 only) x cast to bf16, the bf16 int8pack kernel, the result cast back
    int4-g128 / int4-g32     int4 weight, group size 128 / 32, bf16 activation and scales
      inductor               torch.compile of the GPTQ-style form below
      inductor freezing      the same with freezing = True
      qfuse                  the same compiled with backend="qfuse" (qfuse::int4_weight_only_mm: int4pack
                             on the weight repacked once)
      qfuse freezing         the same with freezing = True (int4pack called from the generated code on
                             the weight packed at compile time)
      qfuse freezing + max-autotune   the same, with freezing + max_autotune (ATen and CPP GEMM backends)
      int4pack eager         aten._weight_int4pack_mm_for_cpu on the _convert_weight_to_int4pack_for_cpu
                             weight
      int4pack compiled      the same op inside torch.compile
      int4pack C++ template  the same, compiled with freezing + max_autotune, CPP GEMM backend only
      zentorch s4 eager      torch.ops.zentorch.zentorch_woq_linear, signed nibbles, no zero points
      zentorch u4+zp eager   the same on the GPTQ words as they are, with bf16 zero points (all 0)
      zentorch s4 compiled   zentorch s4 inside torch.compile
      F.linear bf16          the weight dequantized once to bf16
    intx-bf16-g32 / intx-fp32-g32   torchao's int4 "intx" form: int4 values stored one per int8 [N, K],
                             int8 zero points [N, K / 32] (all zero, as torchao's symmetric default
                             stores them), scales [N, K / 32] in the activation dtype (bf16 / fp32)
      inductor               torch.compile of the intx form below
      qfuse                  the same compiled with backend="qfuse" (intx_weight_only: the zero points
                             fold into the values once, then int4pack as for GPTQ)
      int4pack eager         as above
      F.linear               the weight dequantized once to the activation dtype

Every compiled candidate is compiled with fullgraph=True (a graph break would raise) and
dynamic=False, each from a module class of its own (Dynamo caches compiled code per code object:
two instances of one class compiled under different Inductor configs silently share the first
compilation), with the FX graph cache off so that the generated code is seen; a row records what
that code calls (`calls`), how often Inductor's weight-only int8 pattern fired (`woq_matches`) and
the compile time. Timing: `qfuse.bench.time_in_turns` (candidates a, b, a, b, ...), --runs timed
calls after warm-up, --repeats times per case, each round started only once other processes keep
under --max-busy of the CPUs busy (the share seen is kept in the rows: this machine is shared);
before every timed call a 256 MiB buffer is written so that no weight stays in the caches (a
model's many layers do not stay there); --warm skips that. The error of each candidate is the
largest |out - ref| (and ||out - ref|| / ||ref||) against a float64 reference on the same stored
values: x (as stored) @ (dequantized weight in float64).T.

Weights: a float weight randn(N, K) * 0.02, quantized symmetrically. int8: scale = absmax / 127 per
row (rounded to the activation dtype first), q = round(w / scale) in [-127, 127]; the reference
weight is q * scale. int4: scale = absmax / 7 per group of `group` along K (rounded to bf16),
q = round(w / scale) + 8 in [0, 15]; the reference weight is (q - 8) * scale.

GPTQ-style form (what the "inductor" int4 rows compile): int32 words `packed` [N, K / 8], nibble i
of word j (bits 4i .. 4i + 3) holding q[:, 8 j + i]; scales [N, K / group]:

    q = (packed[:, :, None] >> [0, 4, ..., 28]) & 0xF            # [N, K / 8, 8], arithmetic shift
    w = ((q.reshape(N, K / group, group) - 8).to(x.dtype) * scales[:, :, None]).reshape(N, K)
    y = F.linear(x, w)

torchao intx form (what the "inductor" intx rows compile; `IntxUnpackedToInt8Tensor`'s dequantize):

    v = values.view(N, K / group, group).to(x.dtype) - zeros.view(N, K / group, 1).to(x.dtype)
    y = F.linear(x, (v * scales.view(N, K / group, 1)).view(N, K))

Facts found here (torch 2.13.0+cpu, zentorch 2.13.0.2, AVX-512 Zen 4; checked by this script's error
columns where they are about numbers):

aten._weight_int8pack_mm(x [M, K], w [N, K] int8 contiguous, scales [N]) -> [M, N] in x's dtype.
  x must be 2-D (no batch dims) with a contiguous last dim; x and scales bf16, fp16 or fp32 and of
  one dtype (bf16 x with fp32 scales is refused); scales 1-D [N] ([N, 1] is refused); it computes
  x @ (w * scales[:, None]).T. With a bf16 x and K not a multiple of 16 (K = 8, 24, 100) it crashed
  the process with a segmentation fault, no error raised; fp32 x is fine at any K. Its fp32 kernel
  is slow beyond M = 1 (K = N = 4096: 115 ms at M = 16, 1.8 s at M = 256, against 4.6 / 62 ms for
  the bf16 kernel).
  Inside torch.compile Inductor lowers it (quantized_lowerings.py) to an autotuned choice: the ATen
  kernel as an extern call (extern_kernels._weight_int8pack_mm) by default; with max_autotune and a
  constant weight (freezing) also a C++ GEMM template (CppMicroGemmFP32Vec over a [N/32, K, 32]
  blocked copy of the weight) with the scale as a fused epilogue. No graph break.
Inductor's weight-only int8 pattern (fx_passes/quantization.py, _register_woq_lowerings, a lowering
  pattern: it does not need freezing) rewrites `F.linear(x, w.to(x.dtype)) * scales` into
  _weight_int8pack_mm, only when x, scales are bf16 and w int8, and only when the graph has the
  reshape around mm that a 3-D x gives (or bmm): a 2-D x (mm with no reshape) does not match, nor
  does the hand-written form with the scale folded into the weight (w.to(x.dtype) * scale[:, None]),
  with or without freezing. With freezing, the constant folder keeps int8 -> bf16 conversions out of
  folding (so a bf16 weight is not built), but folds int8 -> fp32: the fp32 hand-written form becomes
  a folded fp32 weight (4 bytes per weight) and mkl._mkl_linear. The int4 GPTQ form is not folded
  under freezing (its shifts come from torch.arange, a constructor, which freezing's folder skips):
  it still unpacks the whole weight on every call.
aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K] holding 0..15, innerKTiles) -> uint8
  [N, K / 2]: N must be a multiple of 16; innerKTiles is accepted and does not change the result on
  CPU (1 and 8 tried). The bytes are blocked, not plain nibbles: for N a multiple of 64,
  viewed as [N / 64, K, 32], byte [b, k, j] = q[64 b + j, k] | q[64 b + 32 + j, k] << 4.
aten._weight_int4pack_mm_for_cpu(x [M, K], packed, group, scales_and_zeros [K / group, N, 2])
  -> [M, N] in x's dtype: x 2-D, bf16 / fp16 / fp32, scales_and_zeros of x's dtype, group 32, 64,
  128 or 256 dividing K; scales_and_zeros[..., 0] is the scale s, [..., 1] a float zero z, and the
  weight is w[n, k] = (q[n, k] - 8) * s[k // group, n] + z[k // group, n] (checked against float64
  with random s and z: 3e-7 relative with an fp32 x, bf16 rounding with a bf16 x). A symmetric GPTQ
  weight (q - 8) * s has z = 0; an integer zero point zp ((q - zp) * s) has z = (8 - zp) * s.
  Inside torch.compile: an extern call to torch.ops.quantized.int4mm_packed_weight_cpu (the ATen
  kernel); with max_autotune and freezing also a C++ template (CppMicroGemmWoQInt4Avx512). No break.
zentorch.zentorch_woq_linear(x, weight, weight_scales, weight_zero_points, bias=None) -> x's shape
  with N last: x bf16 only (fp32 x fails in the kernel: "Weight quantization params are only
  supported for WOQ (BF16 src + S4 weights)"), any number of leading dims; int4 only (weight must be
  int32: an int8 weight is refused). weight: int32 [K / 8, N] that is the transposed view .t() of a
  contiguous [N, K / 8] (the same values made contiguous give wrong results, no error), nibble i of
  word [n, j] holding k = 8 j + i: the GPTQ-style words above, as they are. weight_scales [K / group,
  N] contiguous, bf16 or fp32 ([1, N]: per channel). The nibbles are read by the zero points' dtype:
    None: signed int4 (s4), w = s4 * s. The GPTQ words need q - 8 first: words ^ 0x88888888.
    bf16 [K / group, N]: unsigned (u4), w = (u4 - 8) * s + z, the _weight_int4pack_mm convention.
    int8 [K / group, N]: u4, w = (u4 - zp) * s (random zp 0..15: bf16 rounding). (fp32 and int32
      zero points are refused.)
  zentorch_woq_repack_weight(w int8 [N, K], values -8..7) -> int32 [N, K / 8]: the nibbles
  (w & 0xF), nibble i = column 8 j + i, so it takes torchao's int4-in-int8 weights to s4 words.
  zentorch_woq_repack_from_int4pack(packed uint8 from _convert_weight_to_int4pack_for_cpu) ->
  int32 [N, K / 8] u4 words, equal to the GPTQ-style words of the same q (used with the scales and
  zeros of scales_and_zeros, zentorch's own replacement of _weight_int4pack_mm_for_cpu).
  Inside torch.compile (plain Inductor, zentorch imported) it lowers to an extern call of its .out
  overload; no graph break.

What was measured (docs/benchmarks.md, section cpu_weight_only; benchmarks/results/cpu_weight_only.json):
with bf16 activations, _weight_int8pack_mm is the int8 kernel up to M of about 64 (10-18x Inductor
at M = 1, 3-4x at 16) and loses to Inductor's dequantize + GEMM from M = 128 (0.5x at 256);
_weight_int4pack_mm_for_cpu is the int4 kernel at M <= 16 (40-50x at M = 1), zentorch_woq_linear
from M of about 32 (2.2x Inductor at 256, where int4pack is 0.9x). All compile without graph breaks.

    .venv/bin/python benchmarks/cpu_weight_only.py [--m 1 16 256] [--cases int8-bf16:4096x4096 ...]
        [--threads 2] [--runs 15] [--repeats 2] [--max-busy 0.15] [--warm] [--quick] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import statistics
import time
import types
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

from qfuse.bench import (Timing, add_output_arguments, format_table, machine, out_path, progress, relative_error,
                         time_in_turns, write)

try:
    import zentorch  # noqa: F401  (registers torch.ops.zentorch)
except ImportError:
    zentorch = None

SECTIONS = ("int8-bf16", "int8-fp32", "int4-g128", "int4-g32", "intx-bf16-g32", "intx-fp32-g32")
DEFAULT_CASES = ["int8-bf16:4096x4096", "int8-fp32:4096x4096", "int4-g128:4096x4096", "int4-g32:4096x4096",
                 "int8-bf16:4096x14336", "int4-g128:4096x14336"]
QUICK_CASES = ["int8-bf16:512x256", "int8-fp32:512x256", "int4-g128:512x256", "int4-g32:512x256"]
BASELINE = "inductor"
FLIP_S4 = 0x88888888 - (1 << 32)  # as int32: XOR turns u4 nibbles q into s4 nibbles q - 8
TEMPLATE = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
MAX_AUTOTUNE = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "ATEN,CPP"}


# ---------------------------------------------------------------------------------------------
# Weights and the float64 reference


@dataclasses.dataclass
class Int8Weight:
    q: torch.Tensor       # int8 [N, K]
    scale: torch.Tensor   # [N], activation dtype
    reference: torch.Tensor  # float64 [N, K], q * scale


@dataclasses.dataclass
class Int4Weight:
    q: torch.Tensor       # int32 [N, K], 0..15
    packed: torch.Tensor  # int32 [N, K / 8], GPTQ-style words
    scale: torch.Tensor   # bf16 [N, K / group]
    group: int
    reference: torch.Tensor  # float64 [N, K], (q - 8) * scale


def int8_weight(k: int, n: int, dtype: torch.dtype, generator: torch.Generator) -> Int8Weight:
    w = torch.randn(n, k, generator=generator) * 0.02
    scale = (w.abs().amax(1) / 127).to(dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scale, q.double() * scale.double()[:, None])


def pack_gptq(q: torch.Tensor) -> torch.Tensor:
    """int32 [N, K] of 0..15 -> int32 [N, K / 8], nibble i of word j = q[:, 8 j + i]."""
    words = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for i in range(8):
        words |= q[:, i::8].long() << (4 * i)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def int4_weight(k: int, n: int, group: int, generator: torch.Generator) -> Int4Weight:
    w = (torch.randn(n, k, generator=generator) * 0.02).view(n, k // group, group)
    scale = (w.abs().amax(-1) / 7).to(torch.bfloat16)  # [N, K / group]
    q = (torch.round(w / scale.float()[..., None]).clamp(-8, 7) + 8).to(torch.int32).view(n, k)
    reference = ((q.double().view(n, k // group, group) - 8) * scale.double()[..., None]).view(n, k)
    return Int4Weight(q, pack_gptq(q), scale, group, reference)


# ---------------------------------------------------------------------------------------------
# The forms and ops


def int8_hand_written(x, w, scale):
    return F.linear(x, w.to(x.dtype) * scale[:, None])


def int8_scale_after(x, w, scale):
    return F.linear(x, w.to(x.dtype)) * scale


def int8pack(x, w, scale):
    return torch.ops.aten._weight_int8pack_mm(x, w, scale)


def gptq_form(group: int) -> Callable:
    def gptq_linear(x, packed, scales):
        n = packed.shape[0]
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
        q = (packed.unsqueeze(-1) >> shifts) & 0xF
        w = (q.reshape(n, -1, group) - 8).to(x.dtype) * scales.unsqueeze(-1)
        return F.linear(x, w.reshape(n, -1))
    return gptq_linear


def intx_form(group: int) -> Callable:
    def intx_linear(x, values, scales, zeros):
        n, k = values.shape
        v = values.view(n, k // group, group).to(x.dtype) - zeros.view(n, k // group, 1).to(x.dtype)
        return F.linear(x, (v * scales.view(n, k // group, 1)).view(n, k))
    return intx_linear


def int4pack(group: int) -> Callable:
    def int4pack_mm(x, packed, scales_and_zeros):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)
    return int4pack_mm


def zentorch_woq(x, words_t, scales_t, zeros=None):
    return torch.ops.zentorch.zentorch_woq_linear(x, words_t, scales_t, zeros, None)


# ---------------------------------------------------------------------------------------------
# Candidates


@dataclasses.dataclass
class Candidate:
    call: Callable[[], torch.Tensor] | None
    calls: str = ""               # what the compiled code calls
    woq_matches: int | None = None
    compile_s: float | None = None
    skipped: str | None = None    # why it did not run


class _Linear(torch.nn.Module):
    """`op(x, *tensors)` with the tensors as buffers (so freezing sees them as constants)."""

    def __init__(self, op: Callable, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.op, self.count = op, len(tensors)
        for index, tensor in enumerate(tensors):
            self.register_buffer(f"t{index}", tensor)

    def operands(self) -> list[torch.Tensor]:
        return [getattr(self, f"t{index}") for index in range(self.count)]


def _forward(self, x):
    return self.op(x, *self.operands())


_IDS = itertools.count()


def module_of_its_own(op: Callable, tensors: list[torch.Tensor]) -> torch.nn.Module:
    """A `_Linear` whose forward has a code object of its own: Dynamo caches per code object, and
    an instance of a class compiled before under another Inductor config would reuse that code."""
    code = _forward.__code__.replace(co_name=f"forward_{next(_IDS)}")
    forward = types.FunctionType(code, _forward.__globals__, code.co_name)
    return type(f"WeightOnlyLinear{code.co_name}", (_Linear,), {"forward": forward})(op, tensors).eval()


def summarize_code(codes: list[str]) -> str:
    """The kernels the generated `call` runs: extern / op calls and C++ kernels (template or not)."""
    names = []
    for code in codes:
        body = code[code.find("def call("):]
        body = body[:body.find("runner = Runner") if "runner = Runner" in body else len(body)]
        for match in re.finditer(r"(extern_kernels\.\w+|torch\.ops\.[\w.]+|cpp_fused_\w+)\(", body):
            name = match.group(1)
            if name.startswith("torch.ops.inductor") or name.startswith("torch.ops.aten.view"):
                continue
            if name.startswith("cpp_fused_"):
                kernel_source = re.search(rf"{name} = async_compile\.cpp_pybinding\(.*?'''\)", code, re.S)
                template = kernel_source is not None and "micro_gemm" in kernel_source.group(0)
                name = ("C++ template " if template else "C++ ") + re.sub(r"_\d+$", "", name[len("cpp_fused_"):])
            names.append(name)
    return ", ".join(dict.fromkeys(names))


def compiled(op: Callable, tensors: list[torch.Tensor], x: torch.Tensor, backend: str = "inductor", **config) -> Candidate:
    """torch.compile(fullgraph=True, dynamic=False, backend=backend) of op(x, *tensors) under the
    Inductor `config`; compiled and run once here."""
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    model = module_of_its_own(op, tensors)
    matches_before = counters["inductor"]["woq_matcher_count"]
    start = time.perf_counter()
    try:
        with inductor_config.patch({"fx_graph_cache": False, **config}), \
                mock.patch.object(GraphLowering, "save_output_code", codes.append):
            fn = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
            fn(x)
    except Exception as error:  # noqa: BLE001  (a candidate that does not compile is a result)
        return Candidate(None, skipped=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    return Candidate(lambda: fn(x), summarize_code(codes), counters["inductor"]["woq_matcher_count"] - matches_before,
                     time.perf_counter() - start)


def eager(call: Callable[[], torch.Tensor]) -> Candidate:
    try:
        call()
    except Exception as error:  # noqa: BLE001
        return Candidate(None, skipped=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
    return Candidate(call)


def int8_candidates(x: torch.Tensor, weight: Int8Weight) -> dict[str, Candidate]:
    dtype, w, scale = x.dtype, weight.q, weight.scale
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    dequantized = (w.to(dtype) * scale[:, None]).contiguous()
    candidates = {
        "inductor": compiled(int8_hand_written, [w, scale], x),
        "inductor freezing": compiled(int8_hand_written, [w, scale], x, freezing=True),
        "qfuse": compiled(int8_hand_written, [w, scale], x, backend="qfuse"),
        "qfuse freezing + max-autotune": compiled(int8_hand_written, [w, scale], x, backend="qfuse", **MAX_AUTOTUNE),
    }
    if dtype == torch.bfloat16:
        x3d = x.unsqueeze(0)
        scale_after = compiled(int8_scale_after, [w, scale], x3d)
        candidates["inductor scale-after 3-D"] = scale_after
    candidates |= {
        "int8pack eager": eager(lambda: int8pack(x, w, scale)),
        "int8pack compiled": compiled(int8pack, [w, scale], x),
        "int8pack C++ template": compiled(int8pack, [w, scale], x, **TEMPLATE),
        f"F.linear {name}": eager(lambda: F.linear(x, dequantized)),
    }
    if dtype == torch.float32:  # the bf16 kernel on a bf16 copy of x: other numerics, see the error
        scale_bf16 = scale.to(torch.bfloat16)
        candidates["int8pack via bf16 x"] = eager(lambda: int8pack(x.to(torch.bfloat16), w, scale_bf16).float())
    return candidates


def int4_candidates(x: torch.Tensor, weight: Int4Weight) -> dict[str, Candidate]:
    group, packed, scale = weight.group, weight.packed, weight.scale
    packed_cpu = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q, 1)
    scales_t = scale.t().contiguous()  # [K / group, N]
    scales_and_zeros = torch.stack([scales_t, torch.zeros_like(scales_t)], -1).contiguous()
    dequantized = weight.reference.to(torch.bfloat16)  # (q - 8) * scale, rounded once to bf16
    candidates = {
        "inductor": compiled(gptq_form(group), [packed, scale], x),
        "inductor freezing": compiled(gptq_form(group), [packed, scale], x, freezing=True),
        "qfuse": compiled(gptq_form(group), [packed, scale], x, backend="qfuse"),
        "qfuse freezing": compiled(gptq_form(group), [packed, scale], x, backend="qfuse", freezing=True),
        "qfuse freezing + max-autotune": compiled(gptq_form(group), [packed, scale], x, backend="qfuse", **MAX_AUTOTUNE),
        "int4pack eager": eager(lambda: int4pack(group)(x, packed_cpu, scales_and_zeros)),
        "int4pack compiled": compiled(int4pack(group), [packed_cpu, scales_and_zeros], x),
        "int4pack C++ template": compiled(int4pack(group), [packed_cpu, scales_and_zeros], x, **TEMPLATE),
    }
    if zentorch is None:
        skipped = Candidate(None, skipped="zentorch is not installed")
        candidates |= {"zentorch s4 eager": skipped, "zentorch u4+zp eager": skipped, "zentorch s4 compiled": skipped}
    else:
        words_s4 = (packed ^ FLIP_S4).t()  # [K / 8, N] view of the contiguous [N, K / 8]
        words_u4, zeros = packed.t(), torch.zeros_like(scales_t)
        candidates |= {
            "zentorch s4 eager": eager(lambda: zentorch_woq(x, words_s4, scales_t)),
            "zentorch u4+zp eager": eager(lambda: zentorch_woq(x, words_u4, scales_t, zeros)),
            "zentorch s4 compiled": compiled(zentorch_woq, [words_s4, scales_t], x),
        }
    candidates["F.linear bf16"] = eager(lambda: F.linear(x, dequantized))
    return candidates


def intx_candidates(x: torch.Tensor, weight: Int4Weight) -> dict[str, Candidate]:
    group = weight.group
    values = (weight.q - 8).to(torch.int8)  # [N, K], int4 values one per byte
    scales = weight.scale.to(x.dtype)  # exact: bf16 values
    zeros = torch.zeros_like(scales, dtype=torch.int8)
    packed_cpu = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q, 1)
    scales_t = scales.t().contiguous()
    scales_and_zeros = torch.stack([scales_t, torch.zeros_like(scales_t)], -1).contiguous()
    dequantized = weight.reference.to(x.dtype)
    return {
        "inductor": compiled(intx_form(group), [values, scales, zeros], x),
        "qfuse": compiled(intx_form(group), [values, scales, zeros], x, backend="qfuse"),
        "int4pack eager": eager(lambda: int4pack(group)(x, packed_cpu, scales_and_zeros)),
        f"F.linear {str(x.dtype).removeprefix('torch.')}": eager(lambda: F.linear(x, dequantized)),
    }


# ---------------------------------------------------------------------------------------------
# Running


@dataclasses.dataclass(frozen=True)
class Case:
    section: str
    k: int
    n: int

    @classmethod
    def parse(cls, text: str) -> Case:
        section, _, shape = text.partition(":")
        if section not in SECTIONS:
            raise ValueError(f"unknown section {section!r}: one of {SECTIONS}")
        k, n = (int(value) for value in shape.lower().split("x"))
        return cls(section, k, n)

    @property
    def label(self) -> str:
        return f"{self.section} K={self.k} N={self.n}"


def cache_flush() -> Callable[[], None]:
    """A call that writes a 256 MiB buffer (a new value each time): no operand stays in the caches."""
    buffer, count = torch.empty(64 * 2**20, dtype=torch.float32), itertools.count()
    return lambda: buffer.fill_(next(count))


def cpu_busy(seconds: float = 2.0) -> float:
    """Share of all CPUs busy (not idle / iowait) over `seconds`, from /proc/stat; 0 where there is none."""
    def sample() -> tuple[int, int]:
        fields = [int(value) for value in open("/proc/stat").readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]

    if not os.path.exists("/proc/stat"):
        return 0.0
    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def wait_for_quiet(max_busy: float | None, timeout_s: float = 900) -> float | None:
    """Waits (up to `timeout_s`) until other processes keep under `max_busy` of the CPUs busy, so that
    the candidates are timed while nobody else computes; the last busy share seen."""
    if max_busy is None:
        return None
    deadline, busy = time.monotonic() + timeout_s, cpu_busy()
    while busy > max_busy and time.monotonic() < deadline:
        progress(f"  the CPUs are {busy:.0%} busy: waiting")
        time.sleep(10)
        busy = cpu_busy()
    return busy


def run_case(case: Case, ms: list[int], runs: int, repeats: int, flush, generator: torch.Generator,
             max_busy: float | None = None) -> list[dict]:
    int8 = case.section.startswith("int8")
    dtype = torch.float32 if "fp32" in case.section else torch.bfloat16
    group = None if int8 else int(case.section.split("-g")[1])
    weight = int8_weight(case.k, case.n, dtype, generator) if int8 else int4_weight(case.k, case.n, group, generator)
    rows = []
    for m in ms:
        progress(f"{case.label} M={m}: compiling")
        torch._dynamo.reset()
        x = torch.randn(m, case.k, generator=generator).to(dtype)
        reference = x.double() @ weight.reference.t()
        if int8:
            candidates = int8_candidates(x, weight)
        else:
            candidates = (intx_candidates if case.section.startswith("intx") else int4_candidates)(x, weight)
        errors = {}
        for name, candidate in candidates.items():
            if candidate.call is not None:
                out = candidate.call().reshape(m, case.n)
                errors[name] = (float((out.double() - reference).abs().max()), relative_error(out, reference))
        graphs, load = counters["stats"]["unique_graphs"], os.getloadavg()[0]
        timings: dict[str, list[Timing]] = {name: [] for name, c in candidates.items() if c.call is not None}
        busy: list[float | None] = []
        for repeat in range(repeats):
            busy.append(wait_for_quiet(max_busy))
            progress(f"{case.label} M={m}: timing, repeat {repeat + 1}/{repeats}")
            times = time_in_turns({name: candidates[name].call for name in timings}, "cpu", runs=runs, warmup=2,
                                  before_each=flush)
            for name, timing in times.items():
                timings[name].append(timing)
        if counters["stats"]["unique_graphs"] != graphs:
            raise RuntimeError(f"{case.label} M={m}: a compiled candidate recompiled while timed")
        baseline = statistics.median(t.median_ms for t in timings[BASELINE]) if BASELINE in timings else None
        for name, candidate in candidates.items():
            row = {"section": case.section, "k": case.k, "n": case.n, "group": group, "act_dtype": str(dtype),
                   "m": m, "candidate": name, "calls": candidate.calls, "woq_matches": candidate.woq_matches,
                   "compile_s": candidate.compile_s, "skipped": candidate.skipped, "loadavg_1min": load,
                   "cpu_busy_before": busy}
            if name in timings:
                medians = [t.median_ms for t in timings[name]]
                median = statistics.median(medians)
                row |= {"median_ms": median, "repeat_medians_ms": medians,
                        "spread": (max(medians) - min(medians)) / median,
                        "speedup_vs_inductor": baseline / median if baseline else None,
                        "max_abs_error": errors[name][0], "rel_error": errors[name][1],
                        "timings": timings[name]}
            rows.append(row)
        del candidates
    return rows


def case_table(rows: list[dict], markdown: bool = False) -> str:
    """One row per candidate: 'ms (speedup)' per M, the largest max-abs error over M."""
    ms = list(dict.fromkeys(row["m"] for row in rows))
    names = list(dict.fromkeys(row["candidate"] for row in rows))
    by = {(row["candidate"], row["m"]): row for row in rows}
    cells = []
    for name in names:
        line, worst = [name], None
        for m in ms:
            row = by.get((name, m))
            if row is None or row.get("median_ms") is None:
                line.append("-")
                continue
            line.append(f"{row['median_ms']:.3g} ({row['speedup_vs_inductor']:.2f}x)")
            worst = max(worst or 0.0, row["max_abs_error"])
        line.append("-" if worst is None else f"{worst:.2g}")
        cells.append(line)
    return format_table(cells, ["candidate", *(f"M={m} ms (vs inductor)" for m in ms), "max abs err"],
                        markdown=markdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES,
                        help="section:KxN, section one of " + ", ".join(SECTIONS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2, help="timing rounds per case (their medians' spread is kept)")
    parser.add_argument("--warm", action="store_true", help="leave the caches warm between calls")
    parser.add_argument("--max-busy", type=float, default=0.15,
                        help="before each timing round wait (up to 15 min) until other processes keep under this "
                             "share of the CPUs busy; a negative value: do not wait")
    parser.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    add_output_arguments(parser, "cpu_weight_only", quick="M 1 and 16, K=512 N=256, 3 runs: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.m, args.cases, args.runs, args.repeats = [1, 16], QUICK_CASES, 3, 1
    torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    cases = [Case.parse(text) for text in args.cases]
    generator = torch.Generator().manual_seed(0)
    info = machine()
    print(f"torch {info['torch']}, zentorch {info['zentorch']}, {torch.get_num_threads()} threads, "
          f"{info['cpu']}, caches {'warm' if args.warm else 'flushed before each call'}")
    flush = None if args.warm else cache_flush()
    rows = []
    with torch.no_grad():
        for case in cases:
            case_rows = run_case(case, args.m, args.runs, args.repeats, flush, generator,
                                 None if args.max_busy < 0 else args.max_busy)
            rows += case_rows
            print(f"\n{case.label} (median ms of {args.repeats} x {args.runs} runs; speedup = inductor / candidate)")
            print(case_table(case_rows, args.markdown))
            for row in case_rows:
                if row["m"] == args.m[0] and (row["calls"] or row["skipped"]):
                    what = row["skipped"] or row["calls"] + (f"; woq pattern fired {row['woq_matches']}x"
                                                             if row["woq_matches"] else "")
                    print(f"  {row['candidate']}: {what}")
    out = write(out_path(args, "cpu_weight_only"), rows, m=args.m, cases=args.cases, threads=args.threads,
                runs=args.runs, repeats=args.repeats, caches="warm" if args.warm else "flushed")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
