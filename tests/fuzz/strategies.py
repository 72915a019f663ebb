"""Hypothesis strategies that draw a valid `Case` of each form (tests/fuzz/cases.py).

Each form draws only the parameters its spelling has: PT2E has no fp8 here, weight-only has no
activation quantizer, a Python-number scale is per-tensor. Shapes cover M = 0, 1, odd and > 16,
K and N off multiples of 16 and K == 1, 2D and 3D. Half the cases force a kernel (each one that runs on the
machine, and `reference`): forcing is a documented option, and it keeps eager's semantics as choosing does.
"""

from __future__ import annotations

from hypothesis import strategies as st

from qfuse.kernels import get_kernel
from qfuse.platform import current_platform
from tests.fuzz.cases import DEVICE, FORMS, NEAR_FORMS, Case

ROWS = st.sampled_from([0, 1, 2, 5, 16, 17, 33])
K_SIZES = st.sampled_from([1, 3, 16, 24, 40, 64])
N_SIZES = st.sampled_from([1, 5, 16, 24, 48])
SCALE_SPELLINGS = ["[N]", "[1, N]", "[N, 1].t()", "one_element", "python"]
#: kernels forced through options={"kernel": ...}: each that runs on this machine, and `reference`; "" (qfuse
#: chooses) drawn as often as all of them together
_CANDIDATES = ("cutlass", "cuda", "triton", "torch") if DEVICE == "cuda" else ("zentorch", "onednn", "torch")
FORCED = [name for name in _CANDIDATES if get_kernel(name).is_supported(current_platform(DEVICE))[0]] + ["reference"]
KERNELS = st.sampled_from([""] * len(FORCED) + FORCED)


@st.composite
def leading_dims(draw) -> tuple[int, ...]:
    rows = draw(ROWS)
    return (rows,) if draw(st.booleans()) else (draw(st.sampled_from([1, 2, 3])), rows)


@st.composite
def cases(draw, forms=FORMS + NEAR_FORMS) -> Case:
    form = draw(st.sampled_from(forms))
    common = dict(
        form=form, leading=draw(leading_dims()), k=draw(K_SIZES.filter(lambda k: k > 1 or form != "scale_along_k")), n=draw(N_SIZES), bias=draw(st.booleans()),
        dynamic=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
        special=draw(st.sampled_from(["", "", "", "", "", "", "", "", "inf", "nan"])), kernel=draw(KERNELS),
    )
    spelling = draw(st.sampled_from(SCALE_SPELLINGS))
    weight = "tensor" if spelling in ("one_element", "python") else draw(st.sampled_from(["channel", "channel", "tensor"]))
    if form in ("weight_only", "row_scaled"):  # the CPU kernel takes bf16 with K % 16 == 0: draw those often
        common["k"] = draw(st.sampled_from([16, 32, 48, 64, 3, 40]))
        return Case(**common, quant="int8", activation="none", weight=weight, scale_spelling=spelling,
                    dtype=draw(st.sampled_from(["bfloat16", "bfloat16", "bfloat16", "float32", "float16"])))
    if form == "pt2e":
        quant = draw(st.sampled_from(["int8", "uint8"]))
        activation = "static_tensor" if quant == "uint8" else draw(st.sampled_from(["static_tensor", "dynamic_token"]))
        return Case(**common, quant=quant, activation=activation, weight=weight, scale_spelling=spelling,
                    dtype="float32", saturate=draw(st.booleans()) and activation == "static_tensor",
                    second_user=draw(st.sampled_from(["", "", "quantized"])))
    quant = "int8" if form in NEAR_FORMS or form == "mlp" else draw(st.sampled_from(["int8", "int8", "fp8"]))
    activation = draw(st.sampled_from(["dynamic_token", "dynamic_token", "dynamic_tensor", "static_tensor"]))
    second_users = ["", "", "quantized", "accumulator"] if form in ("hand_written", "mlp") else ["", "", "quantized"]
    hand_written_int8 = form in ("hand_written", "mlp") and quant == "int8"
    return Case(
        **common, quant=quant, activation=activation, weight=weight, scale_spelling=spelling,
        gemm=draw(st.sampled_from(["int_mm", "int_mm", "float_mm"])) if hand_written_int8 else "int_mm",
        clamp_low=draw(st.sampled_from([-128, -128, -127])) if hand_written_int8 else -128,
        dtype=draw(st.sampled_from(["float32", "float32", "bfloat16", "float16"])),
        saturate=draw(st.booleans()) and activation == "static_tensor",
        second_user=draw(st.sampled_from(second_users)),
    )
