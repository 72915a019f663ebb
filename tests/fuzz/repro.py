"""Re-run one generated case and show everything about it:

    python -m tests.fuzz.repro "Case(form='pt2e', quant='uint8', k=1, saturate=True)"

prints the verdict, the model's code path (the case's fields), eager's, plain Inductor's and
qfuse's outputs, and qfuse's report of the compiled graph.
"""

from __future__ import annotations

import sys
from unittest import mock

import torch

import qfuse
from qfuse.config import pass_skipping_caches_off
from tests.fuzz.cases import Case, build
from tests.fuzz.differential import _exact_int_mm, run_case


def main(text: str) -> None:
    case = eval(text, {"Case": Case})  # noqa: S307 - a Case literal printed by a failing test
    outcome = run_case(case)
    print(f"{case!r}\nproblems: {outcome.problems or 'none'}; fused {outcome.fused}; "
          f"plain Inductor agrees with eager: {outcome.inductor_agrees}")
    model, inputs = build(case)
    with torch.no_grad(), pass_skipping_caches_off():
        with mock.patch.object(torch, "_int_mm", _exact_int_mm):  # eager as the judge runs it; Inductor padded too
            eager = model(*inputs)
            print("eager:", eager)
            torch._dynamo.reset()
            inductor = torch.compile(model, dynamic=case.dynamic)(*inputs)
            print("inductor:", inductor)
        torch._dynamo.reset()
        explanation = qfuse.explain(model, *inputs, dynamic=case.dynamic)
        out = torch.compile(model, backend="qfuse", dynamic=case.dynamic)(*inputs)
        print("qfuse:", out)
    print(explanation)
    if all(isinstance(value, torch.Tensor) for value in (out, eager, inductor)) and out.shape == eager.shape:
        gap = (out.float() - eager.float()).abs()
        where = divmod(int(gap.argmax()), eager.shape[-1])
        print(f"largest |qfuse - eager| {gap.max().item():.4g} at (row, column) {where}: eager "
              f"{eager.reshape(-1, eager.shape[-1])[where].item():.6g}, Inductor "
              f"{inductor.reshape(-1, eager.shape[-1])[where].item():.6g}, qfuse {out.reshape(-1, eager.shape[-1])[where].item():.6g}")


if __name__ == "__main__":
    main(sys.argv[1])
