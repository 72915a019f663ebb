"""`python -m qfuse <command>` (also the `qfuse` console script).

    demo     compile a small W8A8 transformer with backend="qfuse" and show what was fused
    kernels  the kernels of this machine and the scheme each one takes (--markdown: the tables
             of every kernel, as docs/kernels.md holds them)
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="qfuse", description="qfuse: fused quantized linears for torch.compile")
    commands = parser.add_subparsers(dest="command", required=True)

    from qfuse import demo

    demo_parser = commands.add_parser("demo", help="compile a small W8A8 transformer and show what qfuse fused")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.main)

    kernels_parser = commands.add_parser("kernels", help="which kernel runs which scheme, on this machine")
    kernels_parser.add_argument("--markdown", action="store_true",
                                help="print every kernel's capability table and the scheme matrix as markdown")
    kernels_parser.set_defaults(run=_kernels)

    args = parser.parse_args(argv)
    args.run(args)


def _kernels(args: argparse.Namespace) -> None:
    import torch

    from qfuse.kernels import matrix

    if args.markdown:
        print(matrix.markdown(), end="")
        return
    print(matrix.this_machine(("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)))


if __name__ == "__main__":
    main()
