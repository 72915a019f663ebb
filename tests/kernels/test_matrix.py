"""The kernel x scheme matrix (`python -m qfuse kernels`) and the tables docs/kernels.md holds."""

import re
from pathlib import Path

from qfuse.__main__ import main
from qfuse.kernels import KERNELS, matrix

DOC = Path(__file__).resolve().parents[2] / "docs" / "kernels.md"
BLOCK = re.compile(r"<!-- KERNEL_TABLES begin[^>]*-->\n(.*)<!-- KERNEL_TABLES end -->", re.DOTALL)


def test_docs_hold_the_tables_the_code_declares():
    block = BLOCK.search(DOC.read_text())
    assert block, "docs/kernels.md lost its KERNEL_TABLES markers"
    assert block.group(1) == matrix.markdown(), (
        "docs/kernels.md is out of date: paste the output of `python -m qfuse kernels --markdown` between its markers")


def test_every_kernel_row_is_in_the_table():
    table = matrix.capability_table()
    for name, kernel in KERNELS.items():
        assert kernel.capabilities, f"{name} declares no capability rows"
        for row in kernel.capabilities:
            assert f"| {name} | {row.label} |" in table


def test_matrix_marks_what_each_table_takes():
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in matrix.scheme_matrix().splitlines()[2:]}
    header = matrix.scheme_matrix().splitlines()[0].strip("| ").split(" | ")
    cells = {scheme: dict(zip(header[1:], line.strip("| ").split(" | ")[1:])) for scheme, line in rows.items()}
    assert cells["int8 dyn-token x per-channel"]["cutlass"] == "cuda (vllm)"
    assert cells["int8 dyn-token x per-channel"]["torch"] == "cpu, cuda, rocm"
    assert cells["fp8 dyn-group x block"]["triton"] == "cuda"
    assert cells["fp8 dyn-group x block"]["torch"] == "-"
    assert cells["int8 dyn-token x int4 per-group-128"]["xpu"] == "xpu"
    assert cells["bf16 x fp8 block (weight-only)"]["onednn"] == "cpu"


def test_kernels_command_prints_this_machine(capsys):
    main(["kernels"])
    out = capsys.readouterr().out
    assert out.startswith("cpu: CPU")
    assert "reference  runs here" in out
    assert "registry's pick" in out and "int8 dyn-token x per-channel" in out


def test_kernels_command_prints_the_markdown(capsys):
    main(["kernels", "--markdown"])
    assert capsys.readouterr().out == matrix.markdown()
