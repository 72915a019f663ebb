"""`cpu`: qfuse's own C++ kernels for the CPU, compiled at first use by Inductor's C++ code cache (the compiler
that Inductor's own CPU code needs) and called through ctypes.

- `int4_zero_points`: int4 weight-only GEMM with zero points (AWQ, GPTQ with stored zeros, compressed-tensors
  asymmetric) and bf16 / fp16 activations, each weight value rounded as eager rounds it; the `torch` kernel's
  int4 path where ATen's `_weight_int4pack_mm_for_cpu` would round its float zero (`qfuse.kernels.int4_cpu`).
"""
