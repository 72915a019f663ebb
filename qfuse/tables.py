"""Tables of text: what `python -m qfuse kernels`, the demo and the benchmarks print."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(rows: Sequence[Sequence[object]], header: Sequence[str], markdown: bool = False) -> str:
    """Plain text columns (or a markdown table) of `rows` under `header`."""
    cells = [[str(cell) for cell in row] for row in [header, *rows]]
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in cells]
        lines.insert(1, "|" + "---|" * len(header))
        return "\n".join(lines)
    widths = [max(len(cell) for cell in column) for column in zip(*cells)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
