"""The kernel contract: what every GEMM / quant backend declares and implements.

A kernel answers two questions before it is used, each with a reason a user can read:
`is_supported(platform)` (can it run on this machine at all?) and "can it compute this scheme at
these sizes, on this machine's generation of hardware?", which its capability table answers as
data (`capabilities`, see `qfuse.kernels.capabilities`), with `can_implement(key, platform)` for
what a table cannot say. `qfuse.kernels.registry.choose_kernel` walks a priority list and asks both. The ops then call,
on the kernel that was chosen, `prepare_weight` (once per weight: see `prepared.prepare_once`)
and `apply` (or `quant_apply`, which quantizes the activation first; or `weight_only_apply`, whose
activation stays float: weight-only schemes, `QuantScheme.is_weight_only`).

Operand conventions (the ops normalise to these before a kernel sees them):
- `a`: quantized activation [M, K] (int8, uint8 is never passed: the passes shift it to int8, or fp8);
- `b`: quantized weight, logically [K, N], any strides (a `w.t()` view of a stored [N, K] weight);
- `scale_a`: None, one value, [M, 1] or [M, ceil(K/128)];
- `scale_b`: None, one value, [1, N] or [ceil(K/128), ceil(N/128)];
- `azp_a`: None, one value, or [M, 1] integer zero point of the activation;
- `azp_b`: None, one value, or [1, N] integer zero point of the weight;
- result: ((a - azp_a) * scale_a) @ ((b - azp_b) * scale_b) + bias, cast to `out_dtype`.
`prepare_weight(b, scale_b, azp_b)` turns the weight side into a `PreparedWeight` in the kernel's
own layout; `apply` receives that.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from qfuse.kernels import reference_math
from qfuse.kernels.capabilities import Capability
from qfuse.kernels.prepared import PreparedWeight
from qfuse.platform import Platform
from qfuse.schemes import Granularity, QuantScheme

Verdict = tuple[bool, str]
OK: Verdict = (True, "")

#: Up to this many rows (M) a linear is a decode step: it reads its weight once and does little
#: else, so GPU kernels take other tiles (and sometimes another kernel) than at prefill.
DECODE_ROWS = 16


@dataclass(frozen=True)
class GemmKey:
    """What a kernel must implement: the scheme, static sizes (None if symbolic), dtypes."""

    scheme: QuantScheme
    n: int | None
    k: int | None
    out_dtype: torch.dtype
    bias_dtype: torch.dtype | None  # None: no bias
    device_type: str
    weight_zero_point: bool = False  # the weight carries a zero point (asymmetric PT2E weights)
    #: int4 values and zero points stored one per int8 (torchao's intx), the zero points looked at when the weight
    #: is prepared: folded into the values where they fit (all zero for a symmetric weight), else the kernel's exact
    #: fallback; kernel choice reads it as "stored a byte a value" too (`int4_cpu.max_rows`)
    weight_zero_point_foldable: bool = False
    per_call_weight: bool = False  # the weight is quantized anew on every call (a fake-quantized float weight)
    m: int | None = None  # rows of the activation (M, all leading dims), None when symbolic
    weight_scale_dtype: torch.dtype | None = None  # an int4 weight's group scales (None: not recorded)
    cuda_graphs: bool = False  # the graph replays as CUDA graphs (mode="reduce-overhead"): an op's Python runs at capture only
    act_order: bool = False  # GPTQ's act order: an int4 weight's input channels grouped by g_idx, not in order
    cpp_wrapper: bool = False  # Inductor's C++ wrapper (or AOT Inductor) writes the calls: no Python function is called
    #: the linear as written multiplies float operands (dequantized, or integers upcast): Inductor's own code for it
    #: is a float GEMM, not the integer one a W8A8 kernel runs (PT2E, fake quant; not `_int_mm` forms)
    float_gemm_as_written: bool = False


class Kernel(abc.ABC):
    """One GEMM backend. Subclasses are stateless; the registry holds one instance of each."""

    name: ClassVar[str]
    #: What the kernel computes: one row per dtype combination (`qfuse.kernels.capabilities`).
    capabilities: ClassVar[tuple[Capability, ...]]
    #: Whether the passes should hand this kernel the float activation (qfuse::quant_scaled_mm)
    #: instead of leaving the activation quantization to Inductor's generated code.
    fuses_activation_quant: ClassVar[bool] = False
    #: Whether the kernel's lowering can leave its output as Inductor pointwise code (an epilogue after
    #: an ATen GEMM), which Inductor fuses into the op that reads it: a consumer that is a kernel of its
    #: own would make that output a buffer (`qfuse.passes.forms.triton_quantizer` asks).
    output_fuses_into_consumers: ClassVar[bool] = False
    #: Whether `prepare_weight` changes the weight (repacking, padding, re-encoding), so that its
    #: result is worth caching per weight. Kernels that consume the weight as it is leave it False.
    prepares_weight: ClassVar[bool] = False
    #: Whether `apply` / `weight_only_apply` read the weight scale as `prepare_weight` was given it (no layout of
    #: their own): `prepare_once` then prepares the weight alone and attaches each call's scale, so the weight is
    #: prepared once even where the model computes its scale on every call (torchao's bf16 linears cast a float32
    #: scale in the forward), which a preparation keyed by the scale would repeat on every call.
    reads_weight_scale_per_call: ClassVar[bool] = False
    #: Whether the W4A8 GEMM reads an int4 weight's [K / g, N] group scale as it is (any g); else the W4A8 op
    #: gives it one scale a value, [K, N] (the reference math reads scales per value, row, column or 128-block).
    reads_group_scales: ClassVar[bool] = False
    #: Below this many weight elements (K * N) the kernel's per-call cost (an opaque op: Python,
    #: weight lookup, activation shift) outweighs its faster GEMM, and Inductor's own GEMM (the
    #: `torch` kernel, lowered into the generated code) wins: the registry passes it over unless it
    #: is forced. A measured number, per kernel (docs/benchmarks.md, "Kernel choice on CPU").
    min_weight_elements: ClassVar[int] = 0
    #: The fused ops (by name: "scaled_mm", "weight_only_scaled_mm", "int4_weight_only_mm") whose sibling calls
    #: (linears reading one activation: q / k / v, gate / up) this kernel runs as one call on their weights
    #: concatenated along N (`qfuse.ops.siblings`): ops it runs as their extern call on a weight copy of its
    #: own, so one launch replaces several and the concatenation costs no memory the members did not.
    runs_siblings_of: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def is_supported(self, platform: Platform) -> Verdict: ...

    def can_implement(self, key: GemmKey, platform: Platform) -> Verdict:
        """What the capability table cannot say; the registry asks only when the table accepts `key`."""
        return OK

    def why_inductor_is_faster(self, key: GemmKey, platform: Platform) -> str:
        """Why Inductor's own code for this linear (the graph left as it is) is measured faster than this
        kernel, or ''. The registry then leaves the linear to Inductor unless the kernel is forced (a
        speed rule, not a limit: a forced kernel still runs it)."""
        return ""

    def why_slower_here(self, key: GemmKey, platform: Platform) -> str:
        """Why a later kernel of the priority list is faster on `key` here, or '' (measured, per
        kernel; the reason names the measurement). The registry then takes this kernel only if no
        later one can run the linear. Here: a weight below `min_weight_elements`."""
        if key.k is None or key.n is None or key.k * key.n >= self.min_weight_elements:
            return ""
        return (f"the weight ({key.k} x {key.n}) is below {self.min_weight_elements:,} elements, where its per-call "
                "cost outweighs its faster GEMM: Inductor's own GEMM is faster (measured, docs/benchmarks.md)")

    def speed_row_bounds(self, key: GemmKey, platform: Platform) -> tuple[int, ...]:
        """The M values at which `why_slower_here`'s or `why_inductor_is_faster`'s verdict on `key` changes (each
        is the same for every M between two of them): where M is dynamic, the lowering asks kernel choice again per
        bucket (`registry.KernelRequest.choose_by_rows`), and a bucket no kernel takes runs Inductor's own code
        where the op has it (`lowerings.dispatch`). A kernel whose rule looks at M declares its steps here."""
        return ()

    def prepare_weight(
        self, b: torch.Tensor, scale_b: torch.Tensor | None, azp_b: torch.Tensor | None
    ) -> PreparedWeight:
        """Put the [K, N] weight, its scale and zero point in the layout `apply` wants."""
        return PreparedWeight(b, scale_b, azp_b, *b.shape)

    @abc.abstractmethod
    def apply(
        self,
        a: torch.Tensor,
        weight: PreparedWeight,
        scale_a: torch.Tensor | None,
        bias: torch.Tensor | None,
        azp_a: torch.Tensor | None,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        """((a - azp_a) * scale_a) @ weight + bias as `out_dtype`, for a [M, K] activation."""

    def prepare_int4_weight(
        self, values: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
    ) -> PreparedWeight:
        """The int4 weight of `qfuse::int4_weight_only_mm` in this kernel's layout, made once per weight:
        `values` int8 [K, N] in [-8, 7], `scale` [K / g, N], `zero_point` int8 [K / g, N] in [-8, 7] or
        None. Kernels with an int4 weight-only row in their capability table implement it; the
        prepared weight goes to `weight_only_apply`."""
        raise NotImplementedError(f"kernel {self.name!r} has no int4 weight-only GEMM (no int4 row in its capability table)")

    def int4_checkpoint_weight(self, members: list[tuple], group_size: int, zero_convention: str) -> PreparedWeight | None:
        """The int4 weights of `qfuse::int4_weight_only_mm` (one member, or siblings side by side along N) read where
        the checkpoint holds them, nothing repacked or copied: each member (packed, shifts, scales, packed_zeros) as
        the op takes them (no act order, packed along K). None where this kernel cannot (the default): the weight is
        unpacked and prepared (`prepare_int4_weight`)."""
        return None

    def weight_only_apply(
        self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """x @ weight + bias as `out_dtype` for a float (not quantized) [M, K] activation (weight-only,
        `qfuse::weight_only_scaled_mm`). Kernels that implement it have a weight-only row (a float
        activation dtype) in their capability table; the others have none, so the registry never
        sends them here."""
        raise NotImplementedError(
            f"kernel {self.name!r} has no weight-only GEMM (float activation x quantized weight): "
            "its capability table has no row with a float activation dtype"
        )

    # Quantizers: plain torch math unless a kernel has a faster one.

    def dynamic_quant(self, x, quant_dtype: torch.dtype, granularity: Granularity, eps: float):
        return reference_math.dynamic_quant(x, quant_dtype, granularity, eps)

    def silu_mul_quant(self, gate, up, quant_dtype: torch.dtype, eps: float, scale_dtype: torch.dtype):
        """Dynamic per-token quant of silu(gate) * up (each rounded to up's dtype), computed in scale_dtype."""
        product = torch.nn.functional.silu(gate).to(up.dtype) * up
        return self.dynamic_quant(product.to(scale_dtype), quant_dtype, Granularity.PER_TOKEN, eps)

    def dynamic_quant_asymmetric(self, x, quant_dtype: torch.dtype, granularity: Granularity, eps: float):
        return reference_math.dynamic_quant_asymmetric(x, quant_dtype, granularity, eps)

    def static_quant(self, x, scale, zero_point, quant_dtype: torch.dtype):
        return reference_math.static_quant(x, scale, zero_point, quant_dtype)

    def quant_apply(self, x, weight: PreparedWeight, scale_a, bias, quant_dtype, eps, out_dtype):
        """Quantize x [M, K] (dynamic per-token if scale_a is None, else static) and `apply`."""
        if scale_a is None:
            q, scale_a = self.dynamic_quant(x, quant_dtype, Granularity.PER_TOKEN, eps)
        else:
            q = self.static_quant(x, scale_a, None, quant_dtype)
        return self.apply(q, weight, scale_a, bias, None, out_dtype)
