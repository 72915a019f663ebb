"""The `triton` kernel's lowerings: its Triton kernels in Inductor's generated code.

    qfuse::scaled_mm              a Triton template (`scaled_mm`, on `template`'s machinery)
    qfuse::weight_only_scaled_mm  the W8A16 template at decode, Inductor's dequantize + mm above (`w8a16`)
    qfuse::int4_weight_only_mm    the W4A16 templates at decode, Inductor's dequantize + mm above (`int4`)
    qfuse::dynamic_quant,         the one-pass quantizers, launched from the wrapper (`quantize`)
    qfuse::silu_mul_quant

Each reads the eager kernel's own @triton.jit functions (`qfuse.kernels.triton`), so a kernel's math is
written once. Importing this package imports no Triton: the templates import it when they are built.
"""

from qfuse.kernels.triton import TritonKernel
from qfuse.lowerings.dispatch import KernelLowering
from qfuse.lowerings.triton import int4, quantize, scaled_mm, w8a16
from qfuse.ops.int4_weight_only import Int4WeightOnlyMmArgs
from qfuse.ops.quantize import DynamicQuantArgs, SiluMulQuantArgs
from qfuse.ops.scaled_mm import ScaledMmArgs
from qfuse.ops.weight_only import WeightOnlyScaledMmArgs

KERNEL = TritonKernel.name
LOWERINGS = {
    ScaledMmArgs: KernelLowering(scaled_mm.why_not, scaled_mm.lower_call),
    WeightOnlyScaledMmArgs: KernelLowering(w8a16.why_not, w8a16.lower_call),
    Int4WeightOnlyMmArgs: KernelLowering(int4.why_not, int4.lower_call),
    DynamicQuantArgs: KernelLowering(quantize.why_not, quantize.lower_dynamic_quant),
    SiluMulQuantArgs: KernelLowering(quantize.why_not, quantize.lower_silu_mul_quant),
}
#: Inductor's own code for a dynamic M's bucket that no kernel runs faster (`dispatch.add_inductors_own`): the int4
#: dequantize + mm this module writes above its templates' rows, on any device
INDUCTORS_OWN = {Int4WeightOnlyMmArgs: int4.inductors_own}
