"""`reference`: the plain-torch emulation of every qfuse op (see `reference_math`).

Always available and always exact in float64. The registry never picks it on its own (it is
slow); it runs when forced with `kernel="reference"`, and in tests, where every other kernel is
compared against it.
"""

from __future__ import annotations

from qfuse.kernels import reference_math
from qfuse.kernels.base import OK, Kernel, Verdict
from qfuse.kernels.capabilities import Capability
from qfuse.kernels.prepared import PreparedWeight
from qfuse.platform import Platform
from qfuse.schemes import (
    ACTIVATION_GRANULARITIES,
    FLOAT_ACTIVATION_DTYPES,
    QUANT_DTYPES,
    WEIGHT_DTYPES,
    WEIGHT_GRANULARITIES,
)


class ReferenceKernel(Kernel):
    name = "reference"
    fuses_activation_quant = True  # when forced, every step runs as qfuse's own emulated op
    capabilities = (
        Capability("emulation in float64", ("cpu", "cuda", "xpu"), QUANT_DTYPES + FLOAT_ACTIVATION_DTYPES,
                   WEIGHT_DTYPES, ACTIVATION_GRANULARITIES, WEIGHT_GRANULARITIES, activation_zero_point=True,
                   weight_zero_point=True),
    )

    def is_supported(self, platform: Platform) -> Verdict:
        return OK

    def apply(self, a, weight, scale_a, bias, azp_a, out_dtype):
        return reference_math.scaled_mm(a, weight.data, scale_a, weight.scale, bias, azp_a, weight.zero_point, out_dtype)

    def prepare_int4_weight(self, values, scale, zero_point) -> PreparedWeight:
        """The int4 weight with its group scale and zero point expanded to [K, N] (one per value)."""
        group_size = values.shape[0] // scale.shape[0]
        expanded = (None if zero_point is None else zero_point.repeat_interleave(group_size, 0))
        return PreparedWeight(values, scale.repeat_interleave(group_size, 0), expanded, *values.shape)

    def weight_only_apply(self, x, weight, bias, out_dtype):
        return reference_math.weight_only_scaled_mm(x, weight.data, weight.scale, bias, weight.zero_point, out_dtype)
