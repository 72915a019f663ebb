"""`python -m qfuse <command>` (also the `qfuse` console script).

    demo    compile a small W8A8 transformer with backend="qfuse" and show what was fused
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

    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
