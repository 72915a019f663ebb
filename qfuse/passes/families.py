"""The pattern families qfuse knows, in the order the pass manager runs them.

    reference_linear   hand-written W8A8: integer / fp8 matmul followed by a dequantize epilogue
    pt2e_linear        PT2E Q/DQ form (torch.ops.quantized_decomposed) around a float linear
    fake_quant_linear  the same in plain torch ops: a float linear of fake-quantized operands
    activation_quant   hand-written activation quantization folded into the fused linear, for
                       kernels that quantize the activation themselves
"""

PATTERN_FAMILIES: tuple[str, ...] = ("reference_linear", "pt2e_linear", "fake_quant_linear", "activation_quant")
