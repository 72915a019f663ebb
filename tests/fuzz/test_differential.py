"""The generated differential suite: quantized linears in every recognised form and in near forms,
run eagerly, under plain Inductor and under backend="qfuse" (rules: tests/fuzz/differential.py).

Hypothesis draws the cases (tests/fuzz/strategies.py), derandomized: every run checks the same
cases, and a failure prints the shrunk, minimal `Case` and the command that replays it
(`python -m tests.fuzz.repro "Case(...)"`). `QFUSE_FUZZ_EXAMPLES` sets how many cases are drawn
(a plain run: 20; CI: 300; the release profile in docs/testing.md: thousands). `QFUSE_FUZZ_SEED` draws other cases,
from that seed (shards of a long run in parallel processes, each its own seed). `QFUSE_FUZZ_SHRINK=0` reports a
failing case as drawn, without shrinking it (a shrink compiles hundreds of cases: a time-limited shard would lose
its report). The explicit examples
are cases an earlier run found wrong (`FOUND_BEFORE`), kept so they are checked on every run.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, Phase, event, given, seed, settings

from tests.fuzz.cases import DEVICE, NEAR_FORMS, Case
from tests.fuzz.differential import run_case
from tests.fuzz.strategies import cases
from tests.helpers import INT8_DOT_HERE

EXAMPLES = int(os.environ.get("QFUSE_FUZZ_EXAMPLES", "10"))  # a plain run; CI runs 300 (.ci/run)
SEED = os.environ.get("QFUSE_FUZZ_SEED")  # None: derandomized, the same cases every run
PHASES = tuple(phase for phase in Phase if phase is not Phase.shrink or os.environ.get("QFUSE_FUZZ_SHRINK") != "0")

FOUND_BEFORE = [
    # uint8 PT2E activation saturated, K == 1: the quantize chain inlined into the int32 outer product
    # lost its clamp in Inductor's CPU code, values wrapped around
    Case("pt2e", quant="uint8", activation="static_tensor", scale_spelling="[N, 1].t()", leading=(16,), k=1, n=5,
         saturate=True, seed=8745),
    # a nan in a row quantized by zentorch's own per-token quantizer gave finite numbers, eager nan
    Case("fake_quant", leading=(16,), k=40, n=48, dynamic=True, special="nan", seed=2671),
    # an inf in a row: eager's int8 cast of nan is 0 (a nan row), Inductor's is -128 (a +-inf row)
    Case("hand_written", leading=(16,), k=40, n=48, special="inf"),
    Case("pt2e", leading=(16,), k=40, n=48, special="inf"),
    # M == 1 (3D): Inductor gave the [1, K] activation row stride 0, which CPU _int_mm misreads
    Case("pt2e", activation="static_tensor", leading=(1, 1), k=3, n=5, bias=False),
    # the list: K == 1 on _int_mm, a static quantizer clamped at -127, fp16 integer sums that overflow
    Case("pt2e", activation="static_tensor", leading=(5,), k=1),
    Case("hand_written", activation="static_tensor", clamp_low=-127, saturate=True, leading=(9,)),
    Case("hand_written", dtype="float16", gemm="float_mm", leading=(5,)),
    Case("pt2e", quant="uint8", activation="static_tensor", saturate=True, leading=(2, 7)),
    # issue #41's forced kernels, as its note describes them (its seeds were not kept): an fp16 upcast whose
    # float sums overflow in eager, an fp32 linear with K == 3 whose quantized activation has a second user,
    # an fp16 static-scale linear clamped at -127 with an inf in the input
    Case("hand_written", dtype="float16", gemm="float_mm", leading=(5,), kernel="torch"),
    Case("hand_written", k=3, second_user="quantized", kernel="reference"),
    Case("hand_written", dtype="float16", activation="static_tensor", clamp_low=-127, special="inf", kernel="reference"),
    Case("hand_written", dtype="float16", activation="static_tensor", clamp_low=-127, special="inf", kernel="torch"),
    # session 26's 3,000-case run: an MLP whose hidden width is 1, so its second linear has K == 1 and Inductor
    # decomposes it before qfuse runs (the judge's rule looked at the first linear's K only)
    Case(form="mlp", activation="dynamic_token", bias=False, leading=(1, 5), k=3, n=1, gemm="float_mm"),
    # and an inf in a PT2E per-token asymmetric activation with K == 1: the row's scale is inf and its zero
    # point nan, cast to int64's minimum; eager dequantizes q - zero_point in float32 (+-inf out), the fused op
    # takes the zero point as int32 (0), so q - zero_point is 0 and 0 x inf is nan. Not fixed: a zero point
    # outside int32 is garbage in both; kept so a change of either side shows. On the GPU (an H200, session 36) the
    # case agrees with eager: expected to fail on the CPU only.
    pytest.param(Case("pt2e", activation="dynamic_token", weight="tensor", scale_spelling="one_element", bias=False,
                      leading=(1,), k=1, n=5, special="inf"),
                 marks=pytest.mark.xfail(DEVICE == "cpu", strict=True,
                                         reason="a nan zero point: eager's float32 dequantize vs int32")),
    # the same with the reference kernel forced (session 38's GPU run): eager's q - zero_point wraps around in int64
    # (0 - int64's minimum is int64's minimum: a -inf row), the reference kernel's int32 zero point is 0. Fails on
    # both devices.
    *(pytest.param(case, marks=pytest.mark.xfail(strict=True, reason="a nan zero point: eager's int64 wrap-around vs int32"))
      for case in (Case("pt2e", activation="dynamic_token", weight="tensor", scale_spelling="python", leading=(33,), k=1,
                        n=16, dynamic=True, special="inf", kernel="reference", seed=65536),
                   Case("pt2e", activation="dynamic_token", weight="tensor", scale_spelling="one_element", bias=False,
                        leading=(2,), k=3, n=5, special="inf", kernel="reference", seed=98))),
    # session 37's GPU run (1,500 cases, an H200). A Python float scale under dynamic=True: Dynamo leaves it
    # unspecialized, the graph holds it as a 0-dim CPU tensor, which the Triton kernels cannot read (the
    # template failed to compile, the extern call raised)
    Case("fake_quant", activation="dynamic_token", weight="tensor", scale_spelling="python", bias=False,
         leading=(1, 2), k=16, n=16, dtype="float16", dynamic=True, seed=803),
    Case("hand_written", activation="static_tensor", weight="tensor", scale_spelling="python", leading=(3, 33), k=40,
         n=5, dtype="float16", second_user="quantized", dynamic=True, saturate=True, clamp_low=-127, seed=140),
    # one output element (M = N = 1): Inductor's store of a template tile at a constant index drops the mask
    Case("weight_only", weight="channel", bias=False, leading=(1, 1), k=16, n=1, dtype="bfloat16"),
    # a nan in a fake quant with a static scale: eager's float round / clamp keeps it, the int8 operand cannot
    Case("fake_quant", activation="static_tensor", leading=(2, 1), k=1, n=1, dtype="bfloat16", dynamic=True,
         special="nan", seed=305),
    Case("fake_quant", activation="static_tensor", leading=(5,), k=32, n=16, special="nan"),
    # fp8 with N = 24: the cutlass kernel pads N to 32 and returned a strided view, where the fake says contiguous
    Case("fake_quant", quant="fp8", weight="tensor", scale_spelling="python", leading=(17,), k=1, n=24,
         dtype="bfloat16", seed=3817),
    # MLPs whose K == 3 or M <= 16 lifts CUDA _int_mm's limits, once judged against eager on the CPU (their hidden
    # activation there one rounding away, re-quantized one int8 step off): eager now runs on the same device, its
    # _int_mm padded where cuBLASLt refuses (`_exact_int_mm`)
    Case("mlp", weight="tensor", bias=False, leading=(17,), k=3, n=48, dtype="float16", dynamic=True),
    Case("mlp", weight="channel", bias=False, leading=(3, 5), k=24, n=16, dtype="float16", second_user="quantized",
         dynamic=True, special="inf", seed=26369),
    Case("mlp", weight="tensor", leading=(3, 16), k=64, n=5, dtype="bfloat16", second_user="quantized",
         clamp_low=-127, seed=1),
    Case("mlp", activation="static_tensor", weight="tensor", scale_spelling="python", bias=False, leading=(3, 5),
         k=24, n=16, dtype="bfloat16", kernel="torch", seed=6483),
    Case("mlp", activation="static_tensor", weight="tensor", scale_spelling="one_element", bias=False,
         leading=(2, 17), k=40, n=5, dtype="bfloat16", second_user="quantized", dynamic=True, clamp_low=-127, seed=2130),
    Case("hand_written", activation="dynamic_tensor", weight="tensor", scale_spelling="python", leading=(16,), k=24,
         n=1, dtype="bfloat16", second_user="quantized", dynamic=True, clamp_low=-127, seed=7471),
    # an fp8 fake quant with a float32 output: Hopper's tensor cores sum fp8 products below float32's precision
    # (1.6e-4 of the output here): such a linear stays Inductor's float32 GEMM (`Capability.sums_below_float32`)
    Case("fake_quant", quant="fp8", weight="tensor", scale_spelling="one_element", bias=False, leading=(3, 16), k=64,
         n=16, seed=15112),
    # session 37's open case: a float16 fake quant per token whose quantizer is Inductor's code, which computed
    # amax / 127 and x / s in float32 without eager's float16 roundings between: one q one step off. Now the
    # quantizer's nodes ask Inductor for eager's roundings (`qfuse.passes.forms.eager_roundings`)
    Case("fake_quant", weight="tensor", leading=(16,), k=16, n=1, dtype="float16", dynamic=True, seed=10204),
    # session 39's GPU run (seed 36): a float16 MLP with static scales, K = 3 and N = 3 lifted; its second linear's
    # quantizer is Inductor's code (fused with the SiLU of the first linear's float16 output, which qfuse's op
    # stores rounded as eager does), and one q is one step off eager's (3.5e-3 of the output's largest against
    # 2e-3) where plain Inductor, whose code is one kernel from the first GEMM's sums on, lands on eager's. Open:
    # marking the SiLU's rounding (`low_precision_pointwise_barrier`) did not bring eager's q on the GPU. Session 40:
    # the post-grad graph already computes SiLU and the quotient in float32 (the decomposition's upcast), so eager's
    # float16 roundings of SiLU's output, of the scale and of the quotient are gone before qfuse's pass sees it
    pytest.param(Case("mlp", activation="static_tensor", weight="tensor", scale_spelling="[N, 1].t()", bias=False,
                      leading=(1, 33), k=3, n=16, dtype="float16", saturate=True, clamp_low=-127, seed=12475),
                 marks=pytest.mark.xfail(DEVICE == "cuda", strict=True, reason="one q of Inductor's quantizer code one "
                                         "step off eager's (session 39)")),
    # and the same run's second shards (seed 46): a float16 fake quant with a one-element static scale, M = 1, N = 5
    # (lifted): eager's CUDA kernel divides x by the float32 scale of no dimensions converted to float16 first,
    # Inductor's code by its float32 value (a conversion of a constant folds into the unrounded constant): one q one
    # step off. The quantizer's quotient now reads the scale rounded as eager does (`eager_roundings`, session 40)
    Case("fake_quant", activation="static_tensor", weight="tensor", scale_spelling="one_element", bias=False,
         leading=(1,), k=64, n=5, dtype="float16", seed=25480),
]


#: the share of the drawn cases each group of forms gets
GROUPS = {
    "hand_written": (("hand_written", "mlp"), 0.35),
    "pt2e": (("pt2e",), 0.2),
    "fake_quant": (("fake_quant",), 0.15),
    "weight_only": (("weight_only",), 0.1),
    "near_forms": (NEAR_FORMS, 0.2),
}


@pytest.mark.parametrize("case", FOUND_BEFORE, ids=repr)
def test_cases_found_before(case: Case):
    outcome = run_case(case)
    assert not outcome.problems, outcome.failure()
    if case.int8_written_in_float and not case.kernel and not INT8_DOT_HERE:  # left to Inductor here: the rewrite
        forced = run_case(dataclasses.replace(case, kernel="torch"))  # as a CPU with int8 dot instructions runs it
        assert not forced.problems, forced.failure()


def differential_test(forms: tuple[str, ...], share: float):
    """A test drawing `share` of QFUSE_FUZZ_EXAMPLES cases of `forms`."""
    @settings(max_examples=max(1, round(EXAMPLES * share)), derandomize=SEED is None, deadline=None, database=None,
              phases=PHASES, print_blob=False, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases(forms=forms))
    def test(case: Case):
        outcome = run_case(case)
        event("fused" if outcome.fused else "not fused")
        if not outcome.inductor_agrees:
            event("plain Inductor differs from eager (numerics not judged)")
        assert not outcome.problems, outcome.failure()
    return test if SEED is None else seed(int(SEED))(test)


for _group, (_forms, _share) in GROUPS.items():
    globals()[f"test_{_group}_agrees_with_eager_wherever_inductor_does"] = differential_test(_forms, _share)
