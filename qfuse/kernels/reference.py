"""`reference`: the plain-torch emulation of every qfuse op (see `reference_math`).

Always available and always exact in float64. The registry never picks it on its own (it is
slow); it runs when forced with `kernel="reference"`, and in tests, where every other kernel is
compared against it.
"""

from __future__ import annotations

from qfuse.kernels import reference_math
from qfuse.kernels.base import OK, GemmKey, Kernel, Verdict
from qfuse.platform import Platform


class ReferenceKernel(Kernel):
    name = "reference"
    takes_weight_zero_point = True
    fuses_activation_quant = True  # when forced, every step runs as qfuse's own emulated op

    def is_supported(self, platform: Platform) -> Verdict:
        return OK

    def can_implement(self, key: GemmKey, platform: Platform) -> Verdict:
        return OK

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        return reference_math.scaled_mm(a, weight.data, scale_a, weight.scale, bias, azp_a, weight.zero_point, out_dtype)

    def weight_only_apply(self, x, weight, bias, out_dtype):
        return reference_math.weight_only_scaled_mm(x, weight.data, weight.scale, bias, out_dtype)
