"""Where the GPU time of the compiled Llama MLP block goes, per kernel: Inductor against qfuse (GPU).

    python benchmarks/profile_block.py [--m 4096] [--dtypes int8,fp8]

Compiles `gpu_linear.LlamaMLP` with each backend, profiles three warm calls (torch.profiler, CUDA
activity) and prints the kernels by total GPU time, with the registers of each Triton kernel
Inductor compiled (`template_code.py` explains why registers matter for the template).
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_linear import FP8, LlamaMLP, compiled
from harness import warm

parser = argparse.ArgumentParser()
parser.add_argument("--m", type=int, default=4096)
parser.add_argument("--dtypes", default="int8,fp8")
args = parser.parse_args()
torch._inductor.config.use_static_cuda_launcher = False
for name in args.dtypes.split(","):
    model = LlamaMLP({"int8": torch.int8, "fp8": FP8}[name])
    x = torch.randn(args.m, 4096, device="cuda", dtype=torch.bfloat16)
    for variant in ("inductor", "qfuse"):
        with torch.no_grad():
            fn = compiled(model, variant)
            warm(fn, x)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn(x)
                torch.cuda.synchronize()
        print(f"== {name} M={args.m} {variant}")
        events = sorted(prof.key_averages(), key=lambda event: -event.device_time_total)
        for event in events[:14]:
            print(f"  {event.device_time_total / 3:9.1f} us  x{event.count // 3}  {event.key[:110]}")
