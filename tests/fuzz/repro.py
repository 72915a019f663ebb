"""Re-run one generated case and show everything about it:

    python -m tests.fuzz.repro "Case(form='pt2e', quant='uint8', k=1, saturate=True)"

prints the verdict, the model's code path (the case's fields), eager's, plain Inductor's and
qfuse's outputs, and qfuse's report of the compiled graph.
"""

from __future__ import annotations

import sys

import torch

import qfuse
from qfuse.config import pass_skipping_caches_off
from tests.fuzz.cases import Case, build
from tests.fuzz.differential import run_case


def main(text: str) -> None:
    case = eval(text, {"Case": Case})  # noqa: S307 - a Case literal printed by a failing test
    outcome = run_case(case)
    print(f"{case!r}\nproblems: {outcome.problems or 'none'}; fused {outcome.fused}; "
          f"plain Inductor agrees with eager: {outcome.inductor_agrees}")
    model, inputs = build(case)
    with torch.no_grad(), pass_skipping_caches_off():
        print("eager:", model(*inputs))
        torch._dynamo.reset()
        print("inductor:", torch.compile(model, dynamic=case.dynamic)(*inputs))
        torch._dynamo.reset()
        explanation = qfuse.explain(model, *inputs, dynamic=case.dynamic)
        print("qfuse:", torch.compile(model, backend="qfuse", dynamic=case.dynamic)(*inputs))
    print(explanation)


if __name__ == "__main__":
    main(sys.argv[1])
