"""The forms real code writes, matched for the families: quantize and dequantize spellings, scale algebra, block scales, SwiGLU, W4A8."""
