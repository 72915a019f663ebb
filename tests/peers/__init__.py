"""Models built with other quantization tools (torchao, PT2E), for testing qfuse against them."""
