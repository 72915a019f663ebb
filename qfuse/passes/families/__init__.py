"""The pattern families qfuse knows, in the order the pass manager runs them: the one list.

    reference_linear   hand-written W8A8: integer / fp8 matmul followed by a dequantize epilogue
    int4_weight_only   a float linear whose weight is unpacked from int4 words in the graph (GPTQ)
    intx_weight_only   the same with int4 values stored one per int8 (torchao's intx configs)
    pt2e_linear        PT2E Q/DQ form (torch.ops.quantized_decomposed) around a float linear
    fake_quant_linear  the same in plain torch ops: a float linear of fake-quantized operands
    activation_quant   hand-written activation quantization folded into the fused linear, for
                       kernels that quantize the activation themselves
    sibling_linears    fused linears that read one activation (q / k / v, gate / up) joined into
                       one call, for kernels that run them as one launch

Each family is the module `qfuse.passes.families.<name>`, with `run(graph, context)` and a docstring that
says what it matches. The pass manager imports the modules by these names (`family_module`);
`qfuse.config` reads the names without importing the passes (this file imports nothing, so
neither Inductor).
"""

PATTERN_FAMILIES: tuple[str, ...] = (
    "reference_linear", "int4_weight_only", "intx_weight_only", "pt2e_linear", "fake_quant_linear", "activation_quant",
    "sibling_linears",
)


def family_module(family: str) -> str:
    """The module that implements a family."""
    return f"qfuse.passes.families.{family}"
