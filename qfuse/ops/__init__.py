"""qfuse's custom ops (namespace `qfuse`); importing this package registers them."""

from qfuse.ops.int4_weight_only import int4_weight_only_mm
from qfuse.ops.quantize import dynamic_quant, dynamic_quant_asymmetric, silu_mul_quant, static_quant
from qfuse.ops.scaled_mm import quant_scaled_mm, scaled_mm
from qfuse.ops.siblings import SIBLING_ARGUMENTS, SIBLING_FORMS
from qfuse.ops.verify import check_close
from qfuse.ops.w4a8 import w4a8_scaled_mm
from qfuse.ops.weight_only import weight_only_scaled_mm

#: FX node.meta key of a fused op's `LinearRecord` (qfuse.passes.core.report): the passes put it there,
#: and the lowerings write into it how the op entered Inductor's generated code.
RECORD_KEY = "qfuse_record"

__all__ = [
    "SIBLING_ARGUMENTS", "SIBLING_FORMS", "check_close", "dynamic_quant", "dynamic_quant_asymmetric", "int4_weight_only_mm", "quant_scaled_mm", "scaled_mm", "silu_mul_quant",
    "static_quant", "w4a8_scaled_mm", "weight_only_scaled_mm",
]
