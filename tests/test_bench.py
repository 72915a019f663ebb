"""The benchmark harness (`qfuse.bench`) on CPU, and the benchmark scripts on top of it.

What is checked: timing in turns gives a median and spread per candidate and really alternates
them; the writer records the command line, the machine and the rows; `plot` writes a PNG (or says
how to install matplotlib); `machine()` works without CUDA; the harness and the demo import
without Triton; every benchmark script compiles, and the CPU ones run at their smallest sizes.
No timing is asserted: nothing here says that one candidate is faster than another.
"""

import importlib.util
import json
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qfuse import bench
from qfuse.kernels import get_kernel
from qfuse.platform import current_platform

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").rglob("*.py"))  # benchmarks/explorations/ too
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_time_in_turns_gives_a_median_and_spread_per_name_and_alternates():
    calls, flushes = [], []
    timings = bench.time_in_turns({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                  "cpu", runs=5, warmup=2, before_each=lambda: flushes.append(1))
    assert set(timings) == {"a", "b"}
    for timing in timings.values():
        assert timing.runs == 5
        assert timing.min_ms <= timing.q1_ms <= timing.median_ms <= timing.q3_ms <= timing.max_ms
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 5  # warm-up of each, then in turns
    assert len(flushes) == 10  # before every timed call, not before the warm-up


def test_timing_of_one_sample_has_no_spread():
    assert bench.Timing.of([2.0]) == bench.Timing(2.0, 2.0, 2.0, 2.0, 2.0, 1)


def test_write_records_command_machine_extra_and_rows(tmp_path):
    timing = bench.Timing.of([1.0, 2.0, 3.0])
    path = bench.write(tmp_path / "sub" / "result.json", [{"m": 1, "timing": timing}], runs=3)
    payload = json.loads(path.read_text())
    assert payload["command"].split()[0] == Path(sys.executable).name
    assert payload["machine"]["torch"] == torch.__version__
    assert payload["runs"] == 3
    assert payload["rows"] == [{"m": 1, "timing": {"median_ms": 2.0, "q1_ms": 1.5, "q3_ms": 2.5, "min_ms": 1.0,
                                                   "max_ms": 3.0, "runs": 3}}]


def test_machine_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = bench.machine()
    assert info["cpu"] and info["cpus"] >= 1 and info["torch_threads"] >= 1
    assert info["python"] and info["torch"] == torch.__version__
    assert isinstance(info["cpu_flags"], list) and "gpu" not in info
    json.dumps(info)


def test_format_table_plain_and_markdown():
    assert bench.format_table([[1, "x"], [22, "yy"]], ["n", "s"]).splitlines() == ["n   s", "--  --", "1   x", "22  yy"]
    assert bench.format_table([[1, "x"]], ["n", "s"], markdown=True).splitlines() == ["| n | s |", "|---|---|", "| 1 | x |"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'qfuse[bench]')")
    rows = [{"m": m, "backend": backend, "shape": shape, "median_ms": m * factor}
            for m in (1, 32, 256) for backend, factor in (("a", 1.0), ("b", 2.0)) for shape in ("small", "large")]
    rows.append({"m": 1, "backend": "skipped here", "shape": "small", "median_ms": None})
    lines = bench.plot(tmp_path / "lines.png", rows, x="m", y="median_ms", series="backend", panels=("shape",))
    bars = bench.plot(tmp_path / "bars.png", [{"form": "q/dq", "qfuse_ms": 1.0, "inductor_ms": 3.0}],
                      x="form", y=("qfuse_ms", "inductor_ms"))
    for path in (lines, bars):
        assert path.read_bytes().startswith(PNG_SIGNATURE)


def test_heatmap_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'qfuse[bench]')")
    rows = [{"m": m, "shape": shape, "form": form, "speedup": m / 16 + factor}
            for m in (1, 16, 256) for shape in ("1024x1024", "4096x4096") for form, factor in (("a", 0.5), ("b", 1.5))]
    rows.append({"m": 64, "shape": "1024x1024", "form": "a", "speedup": None})  # a cell not measured
    path = bench.heatmap(tmp_path / "grid.png", rows, x="m", y="shape", value="speedup", panels=("form",))
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    with pytest.raises(ValueError, match="no row has a value for 'speedup'"):
        bench.heatmap(tmp_path / "never.png", rows[-1:], x="m", y="shape", value="speedup")


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'qfuse\[bench\]'"):
        bench.plot(tmp_path / "never.png", [{"m": 1, "ms": 1.0}], x="m", y="ms")


@pytest.mark.slow  # a fresh Python: CI's slow tier
def test_harness_and_demo_import_without_triton():
    code = "import sys; sys.modules['triton'] = None; import qfuse.bench, qfuse.demo; qfuse.bench.machine()"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.parametrize("script", SCRIPTS, ids=[script.name for script in SCRIPTS])
def test_benchmark_script_compiles(script, tmp_path):
    py_compile.compile(str(script), cfile=str(tmp_path / "compiled.pyc"), doraise=True)


CPU_RUNS = {  # each CPU script at its smallest settings: seconds, not a measurement
    "cpu_kernel_choice": ["--m", "8", "--k", "64", "--n", "64", "--runs", "2"],
    "cpu_gemm_backends": ["--m", "1", "--n", "256", "--k", "256", "--runs", "2"],
    "cpu_w8a16": ["--m", "1", "--k", "256", "--n", "256", "--runs", "1", "--w8a8"],
    "cpu_mlp": ["--quick"],
    "cpu_peers": ["--quick", "--only", "linear", "--runs", "2"],
    "cpu_weight_only": ["--quick", "--max-busy", "-1"],
    "cpu_int4_zero_points": ["--m", "1", "--shape", "256x64", "--runs", "2"],
    "cpu_grid": ["--forms", "gptq-int4", "--shapes", "128x256", "--ms", "1", "--dtypes", "fp32", "--runs", "2",
                 "--repeats", "1"],
}
PLOTS = {"cpu_kernel_choice", "cpu_gemm_backends", "cpu_w8a16", "cpu_mlp", "cpu_grid"}


def test_every_cpu_script_has_a_smoke_run():
    assert {script.stem for script in SCRIPTS if script.stem.startswith("cpu_")} == set(CPU_RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CPU_RUNS))
def test_cpu_script_runs_and_writes_its_results(name, tmp_path):
    if name == "cpu_peers":
        pytest.importorskip("torchao", reason="cpu_peers compares against torchao (the peers extra)")
    if name == "cpu_w8a16":  # oneDNN's paths, all of them: its bf16 reorder needs AVX-512
        supported, reason = get_kernel("onednn").is_supported(current_platform("cpu"))
        if not supported:
            pytest.skip(f"cpu_w8a16 measures the onednn kernel's paths: {reason}")
    out, png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    can_plot = importlib.util.find_spec("matplotlib") is not None
    plot = ["--plot", str(png)] if name in PLOTS and can_plot else []
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *CPU_RUNS[name], "--out", str(out), *plot],
                   check=True, cwd=ROOT, env=env, timeout=600)
    payload = json.loads(out.read_text())
    assert payload["rows"] and payload["machine"]["cpu"] and f"{name}.py" in payload["command"]
    if plot:
        assert png.read_bytes().startswith(PNG_SIGNATURE)

