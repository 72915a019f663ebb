"""qfuse's custom ops (namespace `qfuse`); importing this package registers them."""

from qfuse.ops.quantize import dynamic_quant, dynamic_quant_asymmetric, static_quant
from qfuse.ops.scaled_mm import quant_scaled_mm, scaled_mm

__all__ = ["dynamic_quant", "dynamic_quant_asymmetric", "quant_scaled_mm", "scaled_mm", "static_quant"]
