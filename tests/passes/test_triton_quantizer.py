"""`triton_quantizer.too_few_rows`: which static M is too small for qfuse's quantizers to pay for a launch
(CPU: the rule reads shapes; the kernels it leads to run on CUDA, tests/lowerings/test_quant_lowering.py)."""

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from qfuse.passes.forms.triton_quantizer import MIN_ROWS, too_few_rows

DYNAMIC_QUANT, SILU_MUL_QUANT = torch.ops.qfuse.dynamic_quant.default, torch.ops.qfuse.silu_mul_quant.default


def test_a_static_m_below_the_bound_is_refused_with_its_reason():
    assert "M = 1024: below 2048 rows" in too_few_rows(DYNAMIC_QUANT, (1024, 4096))
    assert "M = 200: below 256 rows" in too_few_rows(SILU_MUL_QUANT, (4, 50, 14336))
    assert too_few_rows(DYNAMIC_QUANT, (2, 1024, 4096)) == "" and too_few_rows(SILU_MUL_QUANT, (256, 8)) == ""
    assert MIN_ROWS[SILU_MUL_QUANT] < MIN_ROWS[DYNAMIC_QUANT]


def test_a_dynamic_m_is_taken():
    rows = ShapeEnv().create_unbacked_symint()
    assert too_few_rows(DYNAMIC_QUANT, (rows, 4096)) == ""
