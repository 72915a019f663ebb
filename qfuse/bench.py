"""The benchmark harness: how `benchmarks/*.py` and `python -m qfuse demo` time, describe the
machine, and write, print and plot their results.

One way to time each question:

    time_in_turns   candidates called in turns (a, b, a, b, ...), CPU or GPU: wall-clock median
                    and spread (quartiles, min, max) in ms per candidate
    time_call       a GPU call as a user meets it: wall clock per call of calls issued back to
                    back, and the host (Python / launch) time of one call
    gpu_time        the GPU time of one call: many calls in one CUDA graph (`graph_ms_per_call`)
    kernel_ms       one kernel alone: `triton.testing.do_bench`'s median

Results are rows (plain dicts): `write` puts them in one JSON file with the command line and
`machine()`; `format_table` (`qfuse.tables`) prints them; `plot` draws them to a PNG (matplotlib: the `bench`
extra); `progress` says on stderr where a long run is. Every script takes `--out FILE.json` (and
`--plot FILE.png` where a plot helps) through `add_output_arguments` and `out_path`.

Only torch is imported at module level: Triton, matplotlib and the CUDA calls are reached inside
the functions that need them, so the demo runs on a CPU-only machine without Triton.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from qfuse.tables import format_table  # noqa: F401  (the harness's table printer, for the scripts)

RESULTS_DIR = Path("benchmarks/results")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
LIBRARIES = ("triton", "zentorch", "torchao", "vllm")  # distributions whose versions a result records
_START = time.perf_counter()


@dataclasses.dataclass(frozen=True)
class Timing:
    """Milliseconds of one candidate's timed runs: the median and the spread around it."""

    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    max_ms: float
    runs: int

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> Timing:
        ordered = sorted(samples_ms)
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
        return cls(statistics.median(ordered), q1, q3, ordered[0], ordered[-1], len(ordered))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_in_turns(fns: dict[str, Callable[[], object]], device: str = "cpu", runs: int = 20, warmup: int = 3,
                  before_each: Callable[[], object] | None = None) -> dict[str, Timing]:
    """Wall-clock Timing of each `fns[name]()`, after `warmup` untimed calls of each.

    The functions are timed in turns (a, b, a, b, ...), so a slow spell of a shared machine
    slows them alike and their ratio stays meaningful. On "cuda" the device is synchronised
    before and after each call: a time is the whole call. `before_each` runs, untimed, before
    every timed call (e.g. writing a large buffer, so that no operand is left in the caches).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            if before_each is not None:
                before_each()
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: Timing.of(values) for name, values in samples.items()}


def warm(fn: Callable, *args, times: int = 3):
    """Calls `fn(*args)` `times` times (compiles, autotunes, records CUDA graphs); its last output."""
    for _ in range(times):
        out = fn(*args)
    synchronize("cuda" if torch.cuda.is_available() else "cpu")
    return out


def time_call(fn: Callable, *args, calls: int = 50, repeats: int = 5, host_calls: int = 10) -> dict[str, float]:
    """{'per_call_us', 'host_us'} of a warm GPU call `fn(*args)`, medians over `repeats` rounds.

    per_call_us: `calls` calls issued back to back, synchronised at the end, wall clock / calls.
    host_us: right after a synchronisation, `host_calls` calls issued to the idle GPU, host clock
    / calls (the GPU work queues up behind them, so it is the Python and launch time alone).
    """
    per_call, host = [], []
    for _ in range(repeats):
        synchronize("cuda")
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        synchronize("cuda")
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        start = time.perf_counter()
        for _ in range(host_calls):
            fn(*args)
        host.append((time.perf_counter() - start) / host_calls * 1e6)
        synchronize("cuda")
    return {"per_call_us": statistics.median(per_call), "host_us": statistics.median(host)}


def graph_ms_per_call(calls: Sequence[Callable[[], object]]) -> float:
    """Median replay time of one CUDA graph holding `calls`, per call, in ms.

    Decode-sized calls need this care. A step of a decoder runs layer after layer, each reading
    its own weight, so a weight that fits in the L2 is still read from HBM every time. Give each
    call its own buffers (enough weights that together they are several times the L2): one graph
    of them has no launch gaps and no cache hits. `do_bench` instead writes 256 MB to empty the
    L2 before each run, and a short kernel timed right after it reads slowly (likely behind the
    write-back of the dirty lines it evicts): a read-only pass over a weight reads well below the
    graph's bandwidth under do_bench (measured: docs/benchmarks.md, "Measurements first quoted in code comments").
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture stream, as CUDA graph capture wants
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / len(calls)


def graph_us_in_turns(graphs: dict[str, Sequence[Callable[[], object]]], rounds: int = 3) -> dict[str, float]:
    """µs per call of each named list of calls (`graph_ms_per_call`), the best of `rounds` rounds that time every
    list in turns, so that a drift of the GPU's clock or of its neighbours touches them alike."""
    samples = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, calls in graphs.items():
            samples[name].append(graph_ms_per_call(calls) * 1e3)
    return {name: min(values) for name, values in samples.items()}


def gpu_time(fn: Callable, *args, calls: int = 20) -> float | None:
    """GPU µs per call of a warm `fn(*args)`: `calls` calls in one CUDA graph (`graph_ms_per_call`).
    None where the call cannot be captured (a CPU sync, an op that CUDA graphs refuse): said on stderr."""
    try:
        return graph_ms_per_call([lambda: fn(*args)] * calls) * 1e3
    except RuntimeError as error:
        progress(f"  not capturable in a CUDA graph: {str(error).splitlines()[0]}")
        return None


def kernel_ms(fn: Callable[[], object]) -> float:
    """`triton.testing.do_bench` median in ms (25 ms warm-up, 100 ms of runs, the L2 emptied before each)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def relative_error(out, reference) -> float:
    """||out - reference|| / ||reference|| (Frobenius, in float64); of tensors or of tuples of them."""
    if isinstance(out, (tuple, list)):
        out, reference = (torch.cat([t.double().flatten() for t in ts]) for ts in (out, reference))
    out, reference = out.double(), reference.double()
    return float((out - reference).norm() / reference.norm().clamp_min(1e-30))


def geomean(values: Iterable[float]) -> float:
    values = list(values)
    return math.prod(values) ** (1 / len(values)) if values else float("nan")


def _first_processor() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo; {} where there is no such file (not Linux)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return {}
    fields = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu() -> dict:
    properties = torch.cuda.get_device_properties()
    return {"gpu": properties.name, "capability": f"{properties.major}.{properties.minor}",
            "cuda": torch.version.cuda or f"hip {torch.version.hip}", "multiprocessors": properties.multi_processor_count,
            "gpu_memory_gib": round(properties.total_memory / 2**30, 1), "l2_bytes": properties.L2_cache_size}


def machine() -> dict:
    """The CPU (model, the vector / matrix flags that decide int8 and bf16 GEMMs, threads), the GPU
    where CUDA is available, the load average, and the versions of Python, torch and the optional
    kernel libraries (None where not installed)."""
    from qfuse.platform import current_platform

    processor = _first_processor()
    flags = set(processor.get("flags", "").split())
    info = {"cpu": processor.get("model name") or platform.processor() or platform.machine(),
            "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "platform": current_platform("cpu").describe(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(), "torch": torch.__version__,
            **{name: _version(name) for name in LIBRARIES}}
    return info | _gpu() if torch.cuda.is_available() else info


def _jsonable(value):
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else str(value)


def write(path: str | Path, rows: list[dict], **extra) -> Path:
    """One JSON file: the command line, `machine()`, `extra` (the run's settings), then the rows."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), **extra, "rows": rows}
    path.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n")
    return path


def progress(message: str) -> None:
    """One line on stderr, stamped with the seconds since the harness was imported."""
    print(f"[{time.perf_counter() - _START:7.1f} s] {message}", file=sys.stderr, flush=True)


def _pyplot():
    try:
        import matplotlib
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("plotting needs matplotlib: pip install 'qfuse[bench]'") from error
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def _series(rows, x, ys, series, panels) -> dict[tuple, dict[str, list]]:
    """panel values -> series name -> [(x, y)], rows without a y value left out."""
    groups: dict[tuple, dict[str, list]] = {}
    for row in rows:
        for y in ys:
            if row.get(x) is not None and row.get(y) is not None:
                panel = groups.setdefault(tuple(row.get(key) for key in panels), {})
                panel.setdefault(str(row[series]) if series else y, []).append((row[x], row[y]))
    return groups


def _draw(axis, lines: dict[str, list]) -> None:
    """Lines over a numeric x (log 2 where it spans 16x or more), grouped bars over any other x."""
    xs = [x for points in lines.values() for x, _ in points]
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs):
        for name, points in lines.items():
            axis.plot(*zip(*sorted(points)), marker="o", label=name)
        if min(xs) > 0 and max(xs) >= 16 * min(xs):
            axis.set_xscale("log", base=2)
        return
    categories = list(dict.fromkeys(str(x) for x in xs))
    width = 0.8 / len(lines)
    for index, (name, points) in enumerate(lines.items()):
        positions = [categories.index(str(x)) + (index - (len(lines) - 1) / 2) * width for x, _ in points]
        axis.bar(positions, [y for _, y in points], width, label=name)
    axis.set_xticks(range(len(categories)), categories, rotation=20, ha="right")


def _panels(pyplot, count: int, width: float, height: float):
    """(figure, axes) of `count` panels, three a row, each `width` x `height` inches."""
    columns = min(3, count)
    rows = math.ceil(count / columns)
    return pyplot.subplots(rows, columns, squeeze=False, figsize=(width * columns, height * rows))


def _saved(pyplot, figure, axes, used: int, title: str, path: str | Path, top: float = 1.0) -> Path:
    """`figure` with its unused panels hidden and `title` above them (the panels below `top`), written to `path`."""
    for axis in list(axes.flat)[used:]:
        axis.set_visible(False)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0, 1, top))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path


def plot(path: str | Path, rows: list[dict], x: str, y: str | Sequence[str], series: str | None = None,
         panels: Sequence[str] = (), title: str = "") -> Path:
    """A PNG of `y` against `x`: one line (bars, where x is not a number) per value of `series`, or
    per key where `y` lists several keys; one subplot per distinct value of the `panels` keys.
    Rows without a value for `x` or `y` (a candidate skipped here) are left out."""
    pyplot = _pyplot()
    ys = [y] if isinstance(y, str) else list(y)
    groups = _series(rows, x, ys, series, tuple(panels))
    if not groups:
        raise ValueError(f"no row has values for both {x!r} and {ys}")
    figure, axes = _panels(pyplot, len(groups), 5.5, 4.2)
    for axis, (panel, lines) in zip(axes.flat, groups.items()):
        _draw(axis, lines)
        axis.set_title(", ".join(f"{key}={value}" for key, value in zip(panels, panel)), fontsize=9)
        axis.set(xlabel=x, ylabel=ys[0] if len(ys) == 1 else "")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    return _saved(pyplot, figure, axes, len(groups), title, path)


def heatmap(path: str | Path, rows: list[dict], x: str, y: str, value: str, panels: Sequence[str] = (),
            title: str = "", center: float = 1.0) -> Path:
    """A PNG of `value` (a positive ratio) in a grid of `x` (columns) by `y` (rows), each cell written with its
    value, colored on a log scale diverging around `center` (a speedup of 1: red below, blue above); one grid per
    distinct value of the `panels` keys. Rows without a value are left blank."""
    pyplot = _pyplot()
    from matplotlib.colors import TwoSlopeNorm

    grids: dict[tuple, list[dict]] = {}
    for row in rows:
        if row.get(value) is not None:
            grids.setdefault(tuple(row.get(key) for key in panels), []).append(row)
    if not grids:
        raise ValueError(f"no row has a value for {value!r}")
    logs = [math.log(row[value]) for grid in grids.values() for row in grid]
    norm = TwoSlopeNorm(math.log(center), min(min(logs), math.log(center) - 0.01), max(max(logs), math.log(center) + 0.01))
    figure, axes = _panels(pyplot, len(grids), 4.8, 3.6)
    for axis, (panel, grid) in zip(axes.flat, grids.items()):
        xs = sorted({row[x] for row in grid}, key=lambda v: (isinstance(v, str), v))
        ys = list(dict.fromkeys(row[y] for row in grid))
        cells = [[float("nan")] * len(xs) for _ in ys]
        for row in grid:
            cells[ys.index(row[y])][xs.index(row[x])] = row[value]
        axis.imshow([[math.log(v) if v == v else v for v in line] for line in cells], cmap="RdBu", norm=norm,
                    aspect="auto")
        for i, j in itertools.product(range(len(ys)), range(len(xs))):
            if not math.isnan(cells[i][j]):  # white on the dark ends of the scale
                color = "white" if abs(float(norm(math.log(cells[i][j]))) - 0.5) > 0.3 else "black"
                axis.text(j, i, f"{cells[i][j]:.2f}", ha="center", va="center", fontsize=7, color=color)
        axis.set_xticks(range(len(xs)), [str(v) for v in xs])
        axis.set_yticks(range(len(ys)), [str(v) for v in ys], fontsize=7)
        axis.set(xlabel=x, title=", ".join(f"{key}={v}" for key, v in zip(panels, panel)))
    return _saved(pyplot, figure, axes, len(grids), title, path, top=0.97)  # the title above the panels' own


def add_output_arguments(parser: argparse.ArgumentParser, name: str, plot: bool = False, quick: str = "") -> None:
    """Every benchmark's output convention: --out FILE.json; --plot FILE.png where the results plot;
    --quick (its help: `quick`) where the script has a small mode for a smoke run."""
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results JSON (default {RESULTS_DIR / name}.json; with --quick {name}_quick.json "
                             "in the temporary folder, so a smoke run leaves the recorded results alone)")
    if plot:
        parser.add_argument("--plot", type=Path, default=None, help="also draw the results to this PNG")
    if quick:
        parser.add_argument("--quick", action="store_true", help=quick)


def out_path(args: argparse.Namespace, name: str) -> Path:
    """--out, or the default file of the benchmark `name` (see `add_output_arguments`)."""
    if args.out is not None:
        return args.out
    if getattr(args, "quick", False):
        return Path(tempfile.gettempdir()) / f"{name}_quick.json"
    return RESULTS_DIR / f"{name}.json"
