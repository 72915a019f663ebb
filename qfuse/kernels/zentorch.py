"""`zentorch`: AMD ZenDNN's int8 GEMM (`torch.ops.zentorch.zentorch_dynamic_qlinear`), W8A8 on Zen CPUs.

The op, as found in zentorch 2.13.0.2:

    zentorch_dynamic_qlinear(Tensor input, Tensor weight, Tensor weight_scales, Tensor? bias=None, *,
                             bool is_weight_prepacked=False, str zentorch_op_name=...) -> Tensor
    input [..., K] float32 or bfloat16 (float16 needs AVX512-FP16, which Zen 4 lacks); weight int8
    [N, K], read as raw contiguous memory; weight_scales float32 or bfloat16 [N]; bias [N] float32
    or bfloat16; the result has the input's dtype.

It quantizes the input itself, per token: scale = amax(|x|) / 127 in float32, round half to even,
bit-identical to `reference_math.dynamic_quant(x.float())` (measured: 0 of 32768 codes differ;
ties go to even); an all-zero row gives 0. Then int32 accumulation and acc * scale_x * scale_w + bias
in float32, rounded once to the input's dtype (measured: the correctly rounded float64 result).

What qfuse calls (`quant_apply` for qfuse::quant_scaled_mm, `apply` for qfuse::scaled_mm):

    quant_apply(x)  the op on x, in bfloat16 when x and the output are bfloat16, else on x.float()
                    with the result cast to the out dtype. eps is not applied: a row whose amax is
                    below eps is quantized on its own, finer grid (more accurate than the reference).
    apply(a)        zentorch has no entry point for an int8 activation with per-token scales
                    (zentorch_qlinear takes one input scale per tensor). So a is fed as float:
                    requantizing a row whose max |a| is 127 gives scale 1 and a itself, exactly, and
                    that is every row a symmetric dynamic quantizer produces. Other rows are split
                    a = hi + lo so that both requantize exactly (`split_for_exact_requant`), at the
                    cost of a second GEMM, run only when some row needs it. Then, in float32,
                    acc * scale_w * scale_a + bias, cast to the out dtype: exact up to float32 rounding.

What it accepts (machine: `is_supported`; the rest: the capability table `ZentorchKernel.capabilities`):

    rule        accepted
    ----------  ------------------------------------------------------------------------------------
    machine     CPU, AMD Zen, AVX-512 VNNI (Zen 4 and later: the int8 path verified here; AVX2-only
                Zen 2/3 is not), zentorch importable
    tensors     on the CPU
    scheme      int8 x int8, symmetric, activation dynamic per token; not weight-only
    weight      per channel, or per tensor (expanded to one scale per channel in prepare_weight: exact)
    out dtype   float32, bfloat16; float16 through a float32 GEMM and one cast
    bias        none, or float32 / bfloat16 / float16 (cast to float32: zentorch refuses float16 on Zen 4)
    sizes       any M, K, N (odd included), static or symbolic; M = 0 returns an empty result

Weight preparation (once per weight, `qfuse.kernels.prepared`): a private contiguous int8 [N, K]
copy, float32 [N] scales, and `zentorch_clear_weight_cache()`. Why, from what was measured here:
- ZenDNN declares the weight constant and caches its reordered copy keyed by the buffer's address:
  an in-place update of the weight, or another weight later allocated at a freed address, silently
  keeps using the stale copy (seen in practice with fresh tensors). The copy is private and never
  written, and the cache is cleared whenever a copy is made, so no stale entry can match it. The
  cost: every other weight is reordered once more on its next call (the clear is global).
- The copy must not share storage with the user's weight: the prepared-weight cache would keep
  that storage alive, so its entry would never expire. Memory: the copy plus ZenDNN's reordered
  copy, two int8 weights besides the model's own.
- The prepacked path (`zentorch_weight_prepack_for_dynamic_qlinear` + is_weight_prepacked=True)
  is not used: its results are wrong (relative error ~5) for K > 2048 with N >= 128, on this Zen 4
  CPU, for float32 and bfloat16, any M and any ZENDNNL_MATMUL_ALGO / ZENDNNL_DYNAMIC_QUANT_ALGO.
- Without ZenDNN's cache (ZENDNNL_MATMUL_WEIGHT_CACHE=0) the reorder runs on every call, many times the
  GEMM's own time (docs/benchmarks.md, "Measurements first quoted in code comments").
Tensors created under torch.inference_mode have no version counter and are prepared on every call:
a copy, a clear and a reorder each time (slow, but correct).

Scales stay float32: zentorch takes them exactly. With bfloat16 weight scales it also rounds the
per-token activation scale to bfloat16 (the two must share a dtype): measured 2.4e-3 relative
error (float32 activations, M=64, K=512, N=32; the float32 path is 3e-8), more than verify mode's
float32 tolerance (1e-3); 3.0e-3 instead of 1.6e-3 (one bfloat16 rounding) for bfloat16 outputs.

`import zentorch` is deferred to the first prepare/apply: it takes ~1.7 s, registers a "zentorch"
torch.compile backend and edits Inductor's config (its AOTI shim table and cache-key ignore list);
it patches no aten op.

What it costs against oneDNN, the torch kernel and float matmuls: docs/benchmarks.md, "The zentorch table".

Not used: zentorch's int4 weight-only GEMM (`zentorch_woq_linear`, issue #14; faster than Inductor at
M = 256 where ATen's int4pack is not: docs/benchmarks.md, "qfuse's int4 weight-only linear"). Its reordered
weights are cached by ZenDNN in a way `zentorch_clear_weight_cache()` does not reset: in one process, calls on new int4
weights made after others were freed returned nan or wrong results (relative error about 1) for 14
of 36 shape / group / zero-point combinations, with the clear before every call (this EPYC, zentorch
2.13.0.2, scratch test, 2026-11-25); with every weight kept alive, all of them were right, and each
failing combination was right in a fresh process. qfuse cannot keep every freed weight's storage
alive, so the kernel would be silently wrong after a model is replaced.
"""

from __future__ import annotations

import functools

import torch

from qfuse.kernels.base import OK, Kernel, Verdict
from qfuse.kernels.capabilities import DYNAMIC, Capability
from qfuse.kernels.prepared import PreparedWeight
from qfuse.kernels.torch_native import times_activation_scale
from qfuse.platform import Platform
from qfuse.schemes import Granularity

LIBRARY = "zentorch"
REQUIRED_OPS = ("zentorch_dynamic_qlinear", "zentorch_clear_weight_cache")
QUANT_DTYPE = torch.int8  # activation and weight
QMAX = 127  # zentorch's per-token scale is amax / 127
WEIGHT_GRANULARITIES = (Granularity.PER_CHANNEL, Granularity.PER_TENSOR)
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The input (= output) dtypes zentorch computes in on Zen 4; float16 would need AVX512-FP16.
NATIVE_DTYPES = (torch.float32, torch.bfloat16)
BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPE = torch.float32
BIAS_DTYPE = torch.float32  # what zentorch gets


@functools.cache
def zentorch_ops():
    """torch.ops.zentorch, importing zentorch on first use (see the module docstring)."""
    import zentorch

    missing = [op for op in REQUIRED_OPS if not hasattr(torch.ops.zentorch, op)]
    if missing:  # e.g. a zentorch built for another torch, which loads only its stable-ABI subset
        raise RuntimeError(f"zentorch {zentorch.__version__} has no {', '.join(missing)} with torch "
                           f"{torch.__version__}; install the zentorch release that matches this torch")
    return torch.ops.zentorch


def _machine_verdict(platform: Platform) -> Verdict:
    if platform.device_type != "cpu":
        return False, f"zentorch runs on CPUs, not on {platform.describe()}"
    if not platform.cpu_is_amd_zen:
        return False, f"zentorch is AMD's library for Zen CPUs; this is not one ({platform.describe()})"
    if not platform.cpu_has_avx512_vnni:
        return False, "zentorch's int8 GEMM is used with AVX-512 VNNI only (Zen 4 and later); this Zen CPU has none"
    if not platform.has(LIBRARY):
        return False, "zentorch is not installed (pip install 'qfuse[zentorch]')"
    return OK


def _as_channel_scales(scale_b: torch.Tensor | None, n: int) -> torch.Tensor:
    """None / one value / [1, N] -> float32 [N], contiguous (zentorch reads N values, whatever the shape)."""
    if scale_b is None:
        return torch.ones(n, dtype=SCALE_DTYPE)
    if scale_b.numel() not in (1, n):
        raise ValueError(f"zentorch takes one weight scale or one per output channel ({n}), "
                         f"got shape {tuple(scale_b.shape)}")
    return scale_b.to(SCALE_DTYPE).reshape(-1).expand(n).contiguous()


def split_for_exact_requant(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int8 [M, K] -> (hi, lo), hi + lo = a, each part exact under per-token requantization.

    Requantizing a row r gives round(r * 127 / max|r|): r itself when max|r| is 127 (or r is 0),
    and +-127 for a row with one nonzero value or with values in {-1, 0}. hi is a clamped to
    [-127, 127], with the largest entry of a row whose max |a| is below 127 moved to +-127; lo is
    the rest: -1 where a was -128, or one value (minus what was added) on such a short row.
    lo is None when no row needs it (the rows of a symmetric dynamic quantizer never do).
    """
    wide = a.to(torch.int32)  # abs(-128) overflows int8; int16 reductions are far slower on CPU (docs/benchmarks.md)
    row_max, peak_index = wide.abs().max(dim=-1, keepdim=True)
    short = (row_max > 0) & (row_max < QMAX)
    if not (short | (row_max > QMAX)).any():
        return a, None
    hi = wide.clamp(-QMAX, QMAX)
    peak = hi.gather(-1, peak_index)
    hi = hi.scatter(-1, peak_index, torch.where(short, peak.sign() * QMAX, peak))
    return hi.to(torch.int8), (wide - hi).to(torch.int8)


def compute_dtype(x_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype:
    """The dtype zentorch gets x in: x's own when the output is the same native dtype, else float32
    (x.float() is exact and quantizes identically; the float32 result is then rounded once)."""
    return x_dtype if x_dtype == out_dtype and x_dtype in NATIVE_DTYPES else torch.float32


class ZentorchKernel(Kernel):
    name = "zentorch"
    fuses_activation_quant = True  # zentorch_dynamic_qlinear takes the float activation
    prepares_weight = True  # a private [N, K] copy (see the module docstring), float32 [N] scales
    #: faster than Inductor from 1024 x 4096 (docs/benchmarks.md, "Measurements first quoted in code comments")
    min_weight_elements = 1 << 22

    capabilities = (
        Capability("zentorch_dynamic_qlinear", ("cpu",), (QUANT_DTYPE,), (QUANT_DTYPE,), (Granularity.PER_TOKEN,),
                   WEIGHT_GRANULARITIES, activation_scale_kinds=(DYNAMIC,), out_dtypes=OUT_DTYPES,
                   bias_dtypes=BIAS_DTYPES),
    )

    def is_supported(self, platform: Platform) -> Verdict:
        return _machine_verdict(platform)

    def prepare_weight(self, b, scale_b, azp_b) -> PreparedWeight:
        if b.dtype != QUANT_DTYPE or b.dim() != 2 or b.device.type != "cpu":
            raise ValueError(f"zentorch takes an int8 [K, N] CPU weight, got {b.dtype} {tuple(b.shape)} on {b.device}")
        if azp_b is not None:
            raise ValueError("zentorch_dynamic_qlinear takes symmetric weights; azp_b must be None")
        k, n = b.shape
        private_copy = torch.empty((n, k), dtype=QUANT_DTYPE).copy_(b.t())  # [N, K], shares nothing with b
        zentorch_ops().zentorch_clear_weight_cache()  # no reordered copy keyed by a freed address survives
        return PreparedWeight(private_copy, _as_channel_scales(scale_b, n), None, k, n)

    def quant_apply(self, x, weight, scale_a, bias, quant_dtype, eps, out_dtype):
        if scale_a is not None:
            raise ValueError("zentorch quantizes the activation dynamically per token; it takes no static scale_a")
        if quant_dtype != QUANT_DTYPE:
            raise ValueError(f"zentorch quantizes the activation to int8, not {quant_dtype}")
        out = self._dynamic_qlinear(x.to(compute_dtype(x.dtype, out_dtype)), weight, bias)
        # A row with an inf or nan has a nan per-token scale in eager, so a nan output row; zentorch's
        # quantizer returns finite numbers there. Adding 0 x the row's absmax carries eager's nan over.
        return (out + x.abs().amax(dim=-1, keepdim=True).mul(0)).to(out_dtype)

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        if a.dtype != QUANT_DTYPE or azp_a is not None:
            raise ValueError(f"zentorch takes a symmetric int8 activation (no azp_a), got {a.dtype}")
        hi, lo = split_for_exact_requant(a)
        out = self._dynamic_qlinear(hi.to(torch.float32), weight, None)  # acc * scale_w
        if lo is not None:
            out = out + self._dynamic_qlinear(lo.to(torch.float32), weight, None)
        if scale_a is not None:
            out = times_activation_scale(out, scale_a)
        if bias is not None:
            out = out + bias.to(torch.float32)
        return out.to(out_dtype)

    def _dynamic_qlinear(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """zentorch_dynamic_qlinear on a [M, K] float32 / bfloat16 x; its result has x's dtype."""
        if x.shape[0] == 0:  # zentorch fails on an empty input
            return x.new_empty((0, weight.n))
        return zentorch_ops().zentorch_dynamic_qlinear(
            x.contiguous(), weight.data, weight.scale, None if bias is None else bias.to(BIAS_DTYPE).contiguous(),
        )
