"""A long run of the generated suite split over processes, each its own seed (docs/testing.md):

    QFUSE_FUZZ_DEVICE=cuda python -m tests.fuzz.shards --processes 15 --examples 100 --first-seed 1 \
        --limit 540 --out $OUT/fuzz.txt

Each process runs the drawn tests of `pytest tests/fuzz` (not the found-before cases: they are the same in every
shard; run them once, `pytest tests/fuzz -k found_before`) with QFUSE_FUZZ_SEED = its seed and QFUSE_FUZZ_SHRINK=0 (a failing case
is reported as drawn, at once), under a time limit that interrupts it (SIGINT: pytest still prints what failed).
The summary, one file: each shard's last line, then every failing case with its problem and repro command.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

FAILURE = re.compile(r"^E       AssertionError: (Case\(.*?\))\n((?:E         .*\n)+)", re.MULTILINE)


def run_shards(processes: int, examples: int, first_seed: int, limit: int) -> list[tuple[int, str]]:
    """(seed, output) of each shard, run side by side."""
    logs = Path(tempfile.mkdtemp(prefix="qfuse_shards_"))
    environment = os.environ | {"QFUSE_FUZZ_EXAMPLES": str(examples), "QFUSE_FUZZ_SHRINK": "0",
                                "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    running = []
    for seed in range(first_seed, first_seed + processes):
        log = (logs / f"shard_{seed}.txt").open("w")
        command = ["timeout", "-k", "5", "-s", "INT", str(limit), sys.executable, "-u", "-m", "pytest", "-q", "-rfE",
                   "-p", "no:cacheprovider", "-k", "not found_before", "tests/fuzz"]
        running.append((seed, log, subprocess.Popen(command, env=environment | {"QFUSE_FUZZ_SEED": str(seed)},
                                                    stdout=log, stderr=subprocess.STDOUT)))
    outputs = []
    for seed, log, process in running:
        process.wait()
        log.close()
        outputs.append((seed, Path(log.name).read_text(errors="replace")))
    return outputs


def summary(outputs: list[tuple[int, str]]) -> str:
    lines = [f"shard {seed}: {(output.strip().splitlines() or ['no output'])[-1]}" for seed, output in outputs]
    for seed, output in outputs:
        for case, problem in FAILURE.findall(output):
            lines += [f"\nseed {seed}: {case}", problem.replace("E         ", "  ").rstrip()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--examples", type=int, default=100, help="drawn cases a process")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--limit", type=int, default=540, help="seconds a process may run")
    parser.add_argument("--out", type=Path, help="the summary's file (also printed)")
    args = parser.parse_args()
    text = summary(run_shards(args.processes, args.examples, args.first_seed, args.limit))
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
