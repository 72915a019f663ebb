"""CPU benchmark: a 2-layer int8 MLP (1024 -> 2048 -> ReLU -> 1024, M=256, float32 input), qfuse vs Inductor.

Two ways of writing the same quantized MLP:

    reference   `qfuse.demo_model.W8A8Linear`: activations quantized dynamically per token,
                weights int8 per channel, torch._int_mm, then the scales and bias in float
    pt2e_qdq    PT2E Q/DQ form: the activation goes through quantized_decomposed.quantize_per_tensor
                and dequantize_per_tensor with a static scale / zero point (Python numbers,
                calibrated once on a sample input, asymmetric int8); the int8 per-channel weight is
                a buffer, dequantized in forward with dequantize_per_channel; then F.linear

Each form is compiled in this process with backend="qfuse" and with plain torch.compile
(Inductor), and timed in turns under torch.no_grad() (`qfuse.bench.time_in_turns`: median and
quartiles of --runs runs after warm-up). Reported per form: the two medians and the speedup
(Inductor median / qfuse median), the max abs error of each against eager, and how many linears
qfuse fused (from qfuse's reports, compiled with Inductor's caches off, since a cache hit skips
the passes). Writes JSON to --out; --plot draws the two medians per form.

    .venv/bin/python benchmarks/cpu_mlp.py [--runs 50] [--threads N] [--out benchmarks/results/cpu_mlp.json] [--plot FILE.png]
    .venv/bin/python benchmarks/cpu_mlp.py --quick     # 64 -> 128 -> 64, M=16, 3 runs: checks the set-up, seconds
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.ao.quantization.fx._decomposed  # registers torch.ops.quantized_decomposed
from torch import nn

from qfuse.bench import add_output_arguments, format_table, machine, out_path, plot, time_in_turns, write
from qfuse.demo import compile_and_report, max_error
from qfuse.demo_model import quantize_linears, quantize_per_channel

quantized_decomposed = torch.ops.quantized_decomposed
SIZES = {"m": 256, "hidden": 1024, "intermediate": 2048}
QUICK_SIZES = {"m": 16, "hidden": 64, "intermediate": 128}


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def calibrate_per_tensor(x: torch.Tensor) -> tuple[float, int]:
    """Asymmetric int8 per-tensor (scale, zero_point) covering [min(x, 0), max(x, 0)]."""
    low, high = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
    scale = max((high - low) / 255.0, 1e-8)
    zero_point = int(min(127, max(-128, round(-128 - low / scale))))
    return scale, zero_point


class QDQLinear(nn.Module):
    """A linear in PT2E Q/DQ form: static per-tensor activation, int8 per-channel weight."""

    def __init__(self, linear: nn.Linear, sample_input: torch.Tensor) -> None:
        super().__init__()
        self.x_scale, self.x_zero_point = calibrate_per_tensor(sample_input)  # Python numbers
        weight_q, weight_scale = quantize_per_channel(linear.weight, torch.int8)
        self.register_buffer("w_q", weight_q)
        self.register_buffer("w_scale", weight_scale)
        self.register_buffer("w_zero_point", torch.zeros(weight_q.shape[0], dtype=torch.int64))
        self.register_buffer("bias", linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = quantized_decomposed.quantize_per_tensor(x, self.x_scale, self.x_zero_point, -128, 127, torch.int8)
        x_dq = quantized_decomposed.dequantize_per_tensor(q, self.x_scale, self.x_zero_point, -128, 127, torch.int8)
        w_dq = quantized_decomposed.dequantize_per_channel(
            self.w_q, self.w_scale, self.w_zero_point, 0, -128, 127, torch.int8
        )
        return nn.functional.linear(x_dq, w_dq, self.bias)


def qdq_mlp(model: MLP, sample: torch.Tensor) -> MLP:
    """The MLP with both linears in Q/DQ form, activation ranges calibrated on `sample`."""
    qdq = MLP(model.fc1.in_features, model.fc1.out_features)
    with torch.no_grad():
        qdq.fc1 = QDQLinear(model.fc1, sample)
        qdq.fc2 = QDQLinear(model.fc2, torch.relu(model.fc1(sample)))
    return qdq.eval()


def run_form(name: str, model: nn.Module, x: torch.Tensor, runs: int, warmup: int) -> dict:
    with torch.no_grad():
        eager = model(x)
        qfuse_model, qfuse_out, records = compile_and_report(model, x, "qfuse")
        inductor_model, inductor_out, _ = compile_and_report(model, x, "inductor")
        times = time_in_turns({"qfuse": lambda: qfuse_model(x), "inductor": lambda: inductor_model(x)},
                              "cpu", warmup=warmup, runs=runs)
    return {
        "form": name,
        "linears_seen": len(records),
        "linears_fused": sum(record.fused for record in records),
        "records": [{"node": r.node, "module": r.module, "fused": r.fused, "pattern": r.pattern, "scheme": r.scheme,
                     "kernel": r.kernel, "reason": r.reason} for r in records],
        "qfuse_ms": times["qfuse"].median_ms,
        "inductor_ms": times["inductor"].median_ms,
        "speedup": times["inductor"].median_ms / times["qfuse"].median_ms,
        "qfuse_timing": dataclasses.asdict(times["qfuse"]),
        "inductor_timing": dataclasses.asdict(times["inductor"]),
        "qfuse_max_error_vs_eager": max_error(qfuse_out, eager),
        "inductor_max_error_vs_eager": max_error(inductor_out, eager),
        "eager_max_abs_output": eager.abs().max().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=None, help="timed runs per model (>= 30; default 50, quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 5, quick 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    add_output_arguments(parser, "cpu_mlp", plot=True, quick="64 -> 128 -> 64, M=16, 3 runs: checks the set-up")
    args = parser.parse_args()
    runs, warmup = args.runs or (3 if args.quick else 50), args.warmup or (1 if args.quick else 5)
    if runs < 30 and not args.quick:
        parser.error("--runs must be at least 30")
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK_SIZES if args.quick else SIZES

    torch.manual_seed(0)
    float_model = MLP(sizes["hidden"], sizes["intermediate"]).eval()
    x, calibration_sample = torch.randn(sizes["m"], sizes["hidden"]), torch.randn(sizes["m"], sizes["hidden"])
    forms = {
        "reference int8 (dynamic per-token)": quantize_linears(float_model, torch.int8),
        "pt2e Q/DQ int8 (static per-tensor)": qdq_mlp(float_model, calibration_sample),
    }
    results = [run_form(name, model, x, runs, warmup) for name, model in forms.items()]

    rows = [[r["form"], f"{r['linears_fused']}/{r['linears_seen']}", f"{r['qfuse_ms']:.3f}",
             f"{r['inductor_ms']:.3f}", f"{r['speedup']:.2f}x",
             f"{r['qfuse_max_error_vs_eager']:.2e}", f"{r['inductor_max_error_vs_eager']:.2e}"] for r in results]
    shape = f"M={sizes['m']}, {sizes['hidden']}->{sizes['intermediate']}->{sizes['hidden']}"
    info = machine()
    print(f"cpu_mlp: {shape}, float32 input, median of {runs} runs; {info['cpu']}, {info['cpus']} CPUs, "
          f"{info['torch_threads']} torch threads, torch {info['torch']}\n")
    print(format_table(rows, ["form", "fused", "qfuse ms", "inductor ms", "speedup", "qfuse err", "inductor err"]))
    for r in results:
        for record in r["records"]:
            if not record["fused"]:
                print(f"  {r['form']}: {record['node']} not fused: {record['reason']}")
    out = write(out_path(args, "cpu_mlp"), results, shape=sizes, runs=runs, warmup=warmup)
    print(f"\nwrote {out}")
    if args.plot:
        plot(args.plot, results, x="form", y=("qfuse_ms", "inductor_ms"), title=f"cpu_mlp {shape}: median ms")


if __name__ == "__main__":
    main()
