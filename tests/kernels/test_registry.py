"""Tests for `qfuse.kernels.registry`: the per-platform priority lists and `choose_kernel`.

Platforms are built here (Zen 4 and AMX Xeon CPUs, a CPU with neither, NVIDIA H100 / A100, an
MI300 with and without AITER, an Intel GPU), so no accelerator is needed: the registry reads only
the `Platform` facts and the `GemmKey`. Covered: the choice for each platform and scheme (a
table), forced kernels and their errors, disabled kernels, preference lists, the torch kernel's
CUDA alignment reasons, unknown names, and `KernelChoice.rejections()`. Each kernel's own constraint
table is tested beside it (tests/kernels/test_<kernel>.py).
"""

import dataclasses
import re

import pytest
import torch

from qfuse.kernels import KERNELS, GemmKey, KernelRequest, KernelUnavailableError, choose_kernel, get_kernel
from qfuse.kernels.registry import PRIORITY
from qfuse.platform import Platform
from qfuse.schemes import FP8_DTYPE, INT4_DTYPE, Granularity, QuantScheme

G = Granularity
ZEN4 = Platform("cpu", cpu_has_avx512_vnni=True, cpu_is_amd_zen=True, libraries=frozenset({"zentorch"}))
XEON_AMX = Platform("cpu", cpu_has_avx512_vnni=True, cpu_has_amx=True)
PLAIN_CPU = Platform("cpu")  # neither AMX nor VNNI
H100 = Platform("cuda", cuda_capability=(9, 0), libraries=frozenset({"triton"}))
A100 = Platform("cuda", cuda_capability=(8, 0), libraries=frozenset({"triton"}))
L40 = Platform("cuda", cuda_capability=(8, 9), libraries=frozenset({"triton"}))  # fp8, not Hopper
MI300 = Platform("cuda", is_rocm=True, cuda_capability=(9, 4), gpu_arch="gfx942", libraries=frozenset({"triton", "aiter"}))
MI300_BARE = Platform("cuda", is_rocm=True, cuda_capability=(9, 4), gpu_arch="gfx942", libraries=frozenset({"triton"}))
INTEL_GPU = Platform("xpu", libraries=frozenset({"vllm_xpu_kernels", "triton"}))

INT8_DYNAMIC = QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True)
INT8_STATIC = QuantScheme(torch.int8, torch.int8, G.PER_TENSOR, G.PER_CHANNEL, dynamic=False)
UINT8_ASYMMETRIC = QuantScheme(torch.uint8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True, symmetric=False)
FP8_DYNAMIC = QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True)
FP8_TENSOR = QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TENSOR, G.PER_TENSOR, dynamic=False)
FP8_BLOCK = QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_GROUP, G.BLOCK, dynamic=True)
W8A16_BLOCK = QuantScheme.weight_only(FP8_DTYPE, G.BLOCK)
W4A8 = QuantScheme(torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, dynamic=True, weight_group_size=128)
BF16, FP32 = torch.bfloat16, torch.float32
BLOCK_REASON = "fp8 upcast + torch.mm takes per-tensor / per-token activation scales, not per-group"


def key(scheme=INT8_DYNAMIC, device_type="cpu", out_dtype=BF16, n=4096, k=4096, m=None):
    return GemmKey(scheme, m=m, n=n, k=k, out_dtype=out_dtype, bias_dtype=out_dtype, device_type=device_type)


def test_priority_lists_name_registered_kernels_and_never_reference():
    assert PRIORITY == {
        "cpu": ("zentorch", "onednn", "torch"),
        "cuda": ("cutlass", "cuda", "triton", "torch"),
        "rocm": ("aiter", "triton", "torch"),
        "xpu": ("xpu", "triton"),
    }
    assert all(name in KERNELS and name != "reference" for names in PRIORITY.values() for name in names)


@pytest.mark.parametrize(
    "platform, scheme, out_dtype, chosen, passed_over",
    [
        (ZEN4, INT8_DYNAMIC, BF16, "zentorch", []),
        (ZEN4, INT8_STATIC, FP32, "onednn", ["zentorch"]),  # zentorch quantizes dynamically only
        (ZEN4, UINT8_ASYMMETRIC, FP32, "onednn", ["zentorch"]),
        (ZEN4, FP8_DYNAMIC, BF16, "torch", ["zentorch", "onednn"]),
        (ZEN4, W8A16_BLOCK, BF16, "onednn", ["zentorch"]),
        (XEON_AMX, INT8_DYNAMIC, BF16, "onednn", ["zentorch"]),
        (PLAIN_CPU, INT8_DYNAMIC, FP32, "torch", ["zentorch", "onednn"]),
        (PLAIN_CPU, W8A16_BLOCK, BF16, None, ["zentorch", "onednn", "torch"]),
        (H100, FP8_DYNAMIC, BF16, "cutlass", []),
        (H100, FP8_TENSOR, BF16, "cutlass", []),
        (H100, FP8_DYNAMIC, FP32, "triton", ["cutlass", "cuda"]),  # ATen's CUTLASS writes bf16 only
        (H100, FP8_BLOCK, BF16, "triton", ["cutlass", "cuda"]),
        (H100, INT8_DYNAMIC, BF16, "triton", ["cutlass", "cuda"]),  # int8 CUTLASS needs vLLM
        (H100, UINT8_ASYMMETRIC, FP32, "torch", ["cutlass", "cuda", "triton"]),
        (H100, W4A8, BF16, None, ["cutlass", "cuda", "triton", "torch"]),
        (A100, FP8_DYNAMIC, BF16, None, ["cutlass", "cuda", "triton", "torch"]),
        (A100, INT8_DYNAMIC, FP32, "triton", ["cutlass", "cuda"]),
        (MI300, INT8_DYNAMIC, BF16, "aiter", []),
        (MI300, FP8_DYNAMIC, BF16, "aiter", []),
        (MI300, INT8_DYNAMIC, FP32, "triton", ["aiter"]),  # AITER writes bf16 / fp16
        (MI300, UINT8_ASYMMETRIC, FP32, "torch", ["aiter", "triton"]),
        (MI300_BARE, FP8_DYNAMIC, BF16, None, ["aiter", "triton", "torch"]),  # e4m3fnuz needs AITER
        (INTEL_GPU, W4A8, torch.float16, "xpu", []),
        (INTEL_GPU, INT8_DYNAMIC, torch.float16, None, ["xpu", "triton"]),
    ],
)
def test_choice_per_platform(platform, scheme, out_dtype, chosen, passed_over):
    choice = choose_kernel(key(scheme, platform.device_type, out_dtype), platform)
    assert (choice.kernel.name if choice.kernel else None) == chosen
    assert list(choice.rejected) == passed_over
    assert all(choice.rejected.values())  # every rejection says why


def test_rejections_name_every_rejected_kernel_with_its_reason():
    choice = choose_kernel(key(INT8_DYNAMIC, "cpu", FP32), PLAIN_CPU)
    assert choice.kernel.name == "torch" and re.fullmatch(r"zentorch: .+; onednn: .+", choice.rejections())
    assert choose_kernel(key(), ZEN4).rejections() == ""
    assert choose_kernel(key(W4A8), PLAIN_CPU).rejections().startswith("zentorch: ")


@pytest.mark.parametrize("forced", ["reference", "torch"])
def test_forced_kernel_is_returned_without_rejections(forced):
    choice = choose_kernel(key(), ZEN4, forced=forced)
    assert choice.kernel is get_kernel(forced) and choice.rejected == {}


def test_forced_reference_implements_block_scales():
    assert choose_kernel(key(FP8_BLOCK), PLAIN_CPU, forced="reference").kernel.name == "reference"


def test_forced_kernel_that_cannot_implement_raises_with_its_reason():
    with pytest.raises(KernelUnavailableError) as raised:
        choose_kernel(key(FP8_BLOCK), PLAIN_CPU, forced="torch")
    assert str(raised.value) == f"forced kernel 'torch' cannot run fp8 dyn-group x block: {BLOCK_REASON}"


@pytest.mark.parametrize("forced, platform, reason", [
    ("torch", INTEL_GPU, "torch kernel runs on CPU and CUDA / ROCm GPUs only, not on XPU"),
    ("cutlass", MI300, "CUTLASS runs on NVIDIA GPUs, not on ROCm GPU (capability 94)"),
])
def test_forced_kernel_on_an_unsupported_platform_raises(forced, platform, reason):
    with pytest.raises(KernelUnavailableError, match=re.escape(reason)):
        choose_kernel(key(device_type=platform.device_type), platform, forced=forced)


def test_disabled_kernels_are_skipped_with_a_reason():
    choice = choose_kernel(key(), ZEN4, disabled=["zentorch", "onednn"])
    assert choice.kernel.name == "torch"
    assert choice.rejected == {"zentorch": "disabled by configuration", "onednn": "disabled by configuration"}
    assert choose_kernel(key(), PLAIN_CPU, disabled=["torch"]).kernel is None


@pytest.mark.parametrize(
    "preference, expected",
    [(("reference",), "reference"), (("reference", "torch"), "reference"), (("torch", "reference"), "torch")],
)
def test_preference_list_replaces_the_priority_list(preference, expected):
    choice = choose_kernel(key(), ZEN4, preference=preference)
    assert choice.kernel.name == expected and choice.rejected == {}


def test_preference_moves_on_past_disabled_and_unable_kernels():
    choice = choose_kernel(key(), PLAIN_CPU, preference=("torch", "reference"), disabled=("torch",))
    assert choice.kernel.name == "reference"
    assert choice.rejected == {"torch": "disabled by configuration"}
    block_choice = choose_kernel(key(FP8_BLOCK), PLAIN_CPU, preference=("torch", "reference"))
    assert block_choice.kernel.name == "reference" and block_choice.rejected == {"torch": BLOCK_REASON}


@pytest.mark.parametrize(
    "scheme, k, n, row, factor",
    [
        (INT8_DYNAMIC, 196, 256, "int8 torch._int_mm (cuBLASLt)", 8),
        (INT8_DYNAMIC, 512, 33, "int8 torch._int_mm (cuBLASLt)", 8),
        (FP8_TENSOR, 136, 256, "fp8 torch._scaled_mm (cuBLASLt)", 16),  # a multiple of 8 is not enough for fp8
        (INT8_DYNAMIC, None, 256, "int8 torch._int_mm (cuBLASLt)", 8),  # symbolic K
        (FP8_TENSOR, 512, None, "fp8 torch._scaled_mm (cuBLASLt)", 16),  # symbolic N
    ],
)
def test_torch_kernel_cuda_alignment_reasons(scheme, k, n, row, factor):
    choice = choose_kernel(key(scheme, "cuda", BF16, n=n, k=k), H100, preference=("torch", "triton"))
    assert choice.kernel.name == "triton"  # masked loads: any K and N
    assert choice.rejected == {"torch": f"{row} needs static K and N that are multiples of {factor} (K={k}, N={n})"}


@pytest.mark.parametrize(
    "call",
    [
        lambda: get_kernel("cublaslt"),
        lambda: choose_kernel(key(), PLAIN_CPU, forced="cublaslt"),
        lambda: choose_kernel(key(), PLAIN_CPU, preference=("cublaslt",)),
    ],
    ids=["get_kernel", "forced", "preference"],
)
def test_unknown_kernel_name_lists_known_kernels(call):
    known = "['aiter', 'cuda', 'cutlass', 'onednn', 'reference', 'torch', 'triton', 'xpu', 'zentorch']"
    with pytest.raises(KeyError, match=re.escape(f"unknown qfuse kernel 'cublaslt'; known kernels: {known}")):
        call()


@pytest.mark.parametrize(
    "m, scheme, out_dtype, platform, chosen, passed_over",
    [
        (None, FP8_DYNAMIC, BF16, H100, "cutlass", []),  # M unknown (dynamic): the priority list
        (4096, FP8_DYNAMIC, BF16, H100, "cutlass", []),
        (16, FP8_DYNAMIC, BF16, H100, "triton", ["cutlass", "cuda"]),  # decode: the Triton decode template
        (17, FP8_DYNAMIC, BF16, H100, "torch", ["cutlass", "cuda", "triton"]),  # cuBLAS up to 128 rows
        (128, FP8_DYNAMIC, BF16, H100, "torch", ["cutlass", "cuda", "triton"]),
        (129, FP8_DYNAMIC, BF16, H100, "cutlass", []),
        (16, FP8_DYNAMIC, BF16, L40, "triton", ["cutlass", "cuda"]),  # the small-M rules above 16 rows were measured on Hopper
        (64, FP8_DYNAMIC, BF16, L40, "cutlass", []),
        (4096, FP8_DYNAMIC, FP32, H100, "torch", ["cutlass", "cuda", "triton"]),  # ATen's row-wise writes bf16 only
        (16, FP8_DYNAMIC, FP32, H100, "triton", ["cutlass", "cuda"]),
        (None, FP8_DYNAMIC, FP32, H100, "triton", ["cutlass", "cuda"]),
        (4096, FP8_BLOCK, BF16, H100, "triton", ["cutlass", "cuda"]),  # the torch kernel has no block scales
        (4096, INT8_DYNAMIC, BF16, H100, "triton", ["cutlass", "cuda"]),  # int8 templates stay at any M
    ],
)
def test_gpu_choice_depends_on_a_static_m(m, scheme, out_dtype, platform, chosen, passed_over):
    """A decode or prefill M known at compile time picks the GPU kernel measured faster there."""
    choice = choose_kernel(key(scheme, "cuda", out_dtype, m=m), platform)
    assert choice.kernel.name == chosen
    assert list(choice.rejected) == passed_over
    if "cutlass" in passed_over and out_dtype == BF16 and scheme == FP8_DYNAMIC:
        assert "slower than the Triton template's decode tiles and than cuBLAS" in choice.rejected["cutlass"]
    if chosen == "torch":
        assert "cuBLAS" in choice.rejected["triton"]


@pytest.mark.parametrize("scheme, out_dtype, platform, bounds", [
    (FP8_DYNAMIC, BF16, H100, (16, 128)),  # cutlass's step at 128 rows, triton's at 16
    (FP8_DYNAMIC, FP32, H100, (16,)),  # no ATen row-wise GEMM for an fp32 output
    (FP8_DYNAMIC, BF16, L40, (16,)),
    (FP8_BLOCK, BF16, H100, ()),  # block scales stay on the template at any M
    (INT8_DYNAMIC, BF16, H100, ()),
])
def test_a_dynamic_m_is_chosen_for_by_bucket_as_a_static_m_is(scheme, out_dtype, platform, bounds):
    """The lowering asks kernel choice again per bucket of a dynamic M: the bounds are where a speed rule
    changes, only the bounds up to M's bucket are asked (each a guard), and every M gets the kernel a
    static M gets."""
    request = KernelRequest(key(scheme, "cuda", out_dtype))
    assert request.row_bounds(platform) == bounds
    for m in (1, 5, 16, 17, 64, 128, 129, 4096):
        asked = []
        choice, bucket = request.choose_by_rows(platform, lambda bound: asked.append(bound) or m <= bound)
        assert choice.kernel is choose_kernel(key(scheme, "cuda", out_dtype, m=m), platform).kernel, m
        assert asked == [bound for bound in bounds if bound < m] + [bound for bound in bounds if bound >= m][:1]
        assert bucket == ("" if not bounds else next((f"M {'above ' + str(low) + ', ' if low else ''}at most {high}"
                                                      for low, high in zip((0, *bounds), bounds) if m <= high),
                                                     f"M above {bounds[-1]}"))


def test_a_step_with_the_same_kernel_on_both_sides_is_no_bound():
    """With cutlass the only candidate (a preference list), its step at 128 rows changes nothing: no guard."""
    request = KernelRequest(key(FP8_DYNAMIC, "cuda", BF16), preference=("cutlass",))
    assert request.row_bounds(H100) == ()
    assert request.choose_by_rows(H100, lambda bound: pytest.fail("no bound is asked"))[0].kernel.name == "cutlass"


def test_a_forced_kernel_has_no_buckets():
    request = KernelRequest(key(FP8_DYNAMIC, "cuda", BF16), forced="cutlass")
    assert request.row_bounds(H100) == ()
    assert request.choose_by_rows(H100, lambda bound: pytest.fail("no bound is asked"))[0].kernel.name == "cutlass"


def test_a_kernel_slower_here_is_still_taken_when_no_later_one_can_run():
    """Forcing the order cutlass-only at decode: the slower kernel is better than none."""
    choice = choose_kernel(key(FP8_DYNAMIC, "cuda", BF16, m=1), H100, preference=("cutlass",))
    assert choice.kernel.name == "cutlass" and not choice.rejected


@pytest.mark.parametrize("group, activation, zero_point, m, reason", [
    (128, BF16, False, None, ""),
    (128, BF16, False, 128, ""),
    (128, FP32, True, 1, ""),
    (512, BF16, False, None, "takes groups of (32, 64, 128, 256), not 512"),
    (128, BF16, True, None, ""),  # zero points in bf16: qfuse's own kernel (kernels/cpu/int4_zero_points.py)
    (128, BF16, False, 256, "slower than Inductor's own dequantize + mm"),
    (128, FP32, False, None, ""),  # float32: qfuse's own kernel up to 128 rows (a dynamic M guarded there)
    (128, FP32, False, 4, ""),
    (128, FP32, True, 128, ""),
    (128, FP32, False, 129, "slower than Inductor's own dequantize + mm"),
    (128, BF16, "foldable", None, ""),  # torchao's int8-stored zero points: folded, else a dense weight
])
def test_int4_weight_only_on_cpu_is_the_torch_kernels(group, activation, zero_point, m, reason):
    """Which int4 linears the torch kernel takes on a CPU (the speed rules' reasons where it does not)."""
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, activation, weight_group_size=group)
    key = GemmKey(scheme, m=m, n=4096, k=4096, out_dtype=activation, bias_dtype=None, device_type="cpu",
                  weight_zero_point=bool(zero_point), weight_zero_point_foldable=zero_point == "foldable")
    choice = choose_kernel(key, ZEN4)
    if not reason:
        assert choice.kernel.name == "torch"
    else:
        assert choice.kernel is None and reason in choice.rejected["torch"]
        if "Inductor's own" in reason:  # a speed rule: a forced kernel still runs the linear
            assert choose_kernel(key, ZEN4, forced="torch").kernel.name == "torch"


@pytest.mark.parametrize("activation", [BF16, FP32])
def test_a_dynamic_m_of_cpu_int4_has_its_bucket_at_the_kernels_rows(activation):
    """The int4 kernels' step at 128 rows is a bound: above it no kernel (Inductor's own code), below the torch
    kernel, as a static M gets."""
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, activation, weight_group_size=128)
    request = KernelRequest(GemmKey(scheme, m=None, n=4096, k=4096, out_dtype=activation, bias_dtype=None,
                                    device_type="cpu"))
    assert request.row_bounds(ZEN4) == (128,)
    for m, kernel in ((1, "torch"), (128, "torch"), (129, None), (4096, None)):
        choice, _ = request.choose_by_rows(ZEN4, lambda bound: m <= bound)
        assert (choice.kernel and choice.kernel.name) == kernel, m


@pytest.mark.parametrize("activation, rows", [(BF16, 8), (FP32, 16)])
def test_on_amx_int4_stored_a_byte_a_value_goes_to_inductor_sooner(activation, rows):
    """On an AMX CPU Inductor's dequantize of byte-stored int4 (torchao's intx) + its AMX GEMM passes the CPU int4
    kernels above 8 (bf16) or 16 (float32) rows; words packed eight a value, and other CPUs, keep 128."""
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, activation, weight_group_size=32)

    def key(m, bytes_a_value=True):
        return GemmKey(scheme, m=m, n=4096, k=4096, out_dtype=activation, bias_dtype=None, device_type="cpu",
                       weight_zero_point_foldable=bytes_a_value)

    assert choose_kernel(key(rows), XEON_AMX).kernel.name == "torch"
    above = choose_kernel(key(rows + 1), XEON_AMX)
    assert above.kernel is None and f"above {rows} rows, on AMX with the int4 values stored a byte each" in \
        above.rejected["torch"]
    assert choose_kernel(key(rows + 1), ZEN4).kernel.name == "torch"
    assert choose_kernel(key(rows + 1, bytes_a_value=False), XEON_AMX).kernel.name == "torch"
    assert KernelRequest(key(None)).row_bounds(XEON_AMX) == (rows,)


@pytest.mark.parametrize("m, reason", [(1, ""), (4, "taken at a static M = 1 only, not at M = 4"),
                                       (None, "taken at a static M = 1 only, not at a dynamic M")])
def test_float32_int4_without_qfuses_cpu_kernel_is_atens_at_one_row_only(monkeypatch, m, reason):
    """Where qfuse's C++ kernel did not build, float32 int4 runs on ATen's kernel, whose time grows by its one-row
    time with every row: at a static M = 1 only."""
    from qfuse.kernels.cpu import int4_zero_points

    monkeypatch.setattr(int4_zero_points, "why_not_built", lambda dtype: "its C++ did not build here (no compiler)")
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, FP32, weight_group_size=128)
    key = GemmKey(scheme, m=m, n=4096, k=4096, out_dtype=FP32, bias_dtype=None, device_type="cpu")
    choice = choose_kernel(key, ZEN4)
    assert (choice.kernel.name == "torch") if not reason else reason in choice.rejected["torch"]


@pytest.mark.parametrize("group, zero_point, m", [(128, False, 1), (32, True, None), (4096, False, 4096)])
@pytest.mark.parametrize("platform", [H100, A100, MI300], ids=["H100", "A100", "MI300"])
def test_int4_weight_only_on_gpus_is_the_triton_kernels(group, zero_point, m, platform):
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, BF16, weight_group_size=group)
    key = GemmKey(scheme, m=m, n=4096, k=4096, out_dtype=BF16, bias_dtype=None, device_type="cuda",
                  weight_zero_point=zero_point)
    assert choose_kernel(key, platform).kernel.name == "triton"


@pytest.mark.parametrize("m, cuda_graphs, zero_point, scale_dtype, activation, platform, chosen", [
    (1, True, False, BF16, BF16, H100, "torch"),
    (1, True, False, BF16, BF16, A100, "torch"),
    (1, False, False, BF16, BF16, H100, "triton"),
    (16, True, False, BF16, BF16, H100, "triton"),
    (None, True, False, BF16, BF16, H100, "triton"),
    (1, True, True, BF16, BF16, H100, "triton"),  # a zero point: tinygemm's bf16 float zero would round
    (1, True, False, torch.float16, BF16, H100, "triton"),  # tinygemm holds the scales in bf16
    (1, True, False, torch.float16, torch.float16, H100, "triton"),
    (1, True, False, BF16, BF16, MI300, "triton"),
])
def test_int4_at_m_1_under_cuda_graphs_is_atens_tinygemm(m, cuda_graphs, zero_point, scale_dtype, activation, platform,
                                                         chosen):
    """Under CUDA graphs (no Python on a replay) tinygemm's extern call beats the Triton template at
    M = 1, for the symmetric bf16 weights it computes exactly; anything else stays on the template,
    which then is not called slower (`int4_tinygemm.wins_here`)."""
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, activation, weight_group_size=128)
    key = GemmKey(scheme, m=m, n=4096, k=4096, out_dtype=activation, bias_dtype=None, device_type="cuda",
                  weight_zero_point=zero_point, weight_scale_dtype=scale_dtype, cuda_graphs=cuda_graphs)
    choice = choose_kernel(key, platform)
    assert choice.kernel.name == chosen
    if chosen == "torch":
        assert "tinygemm" in choice.rejected["triton"]
    else:
        assert "torch" not in choice.rejected, choice.rejected


H100_NVRTC = Platform("cuda", cuda_capability=(9, 0), libraries=frozenset({"triton", "nvrtc"}))


@pytest.mark.parametrize("m, cuda_graphs, zero_point, group, scale_dtype, platform, chosen, reason", [
    (1, True, False, 128, BF16, H100_NVRTC, "cuda", ""),
    (16, True, True, 128, BF16, H100_NVRTC, "cuda", ""),  # zero points: exact, as eager rounds them
    (None, True, False, 4096, BF16, H100_NVRTC, "cuda", ""),  # a dynamic M: the lowering asks again per bucket
    (17, True, False, 128, BF16, H100_NVRTC, "triton", "a decode kernel (M <= 16)"),
    (1, False, False, 128, BF16, H100_NVRTC, "cuda", ""),  # without CUDA graphs: launched from Inductor's code
    (1, True, False, 32, BF16, H100_NVRTC, "torch", "a multiple of 64"),  # tinygemm takes g32 at M = 1
    (1, True, False, 128, torch.float16, H100_NVRTC, "triton", "the group scales are fp16, not bf16"),
    (1, True, False, 128, BF16, H100, "torch", "needs nvrtc"),  # no NVRTC: tinygemm at M = 1
])
def test_int4_decode_under_cuda_graphs_is_the_cuda_kernels(m, cuda_graphs, zero_point, group, scale_dtype, platform,
                                                           chosen, reason):
    """qfuse's CUDA W4A16 kernel runs as an extern call: taken under CUDA graphs at decode, where it is the
    fastest (docs/benchmarks.md), for the groups and scale dtypes it computes exactly."""
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, BF16, weight_group_size=group)
    key = GemmKey(scheme, m=m, n=4096, k=4096, out_dtype=BF16, bias_dtype=None, device_type="cuda",
                  weight_zero_point=zero_point, weight_scale_dtype=scale_dtype, cuda_graphs=cuda_graphs)
    choice = choose_kernel(key, platform)
    assert choice.kernel.name == chosen, choice.rejected
    assert reason in choice.rejected.get("cuda", "")


@pytest.mark.parametrize("change, reason", [
    ({"act_order": True}, "GPTQ's act order (the op sorts x's columns each call) runs as the op's extern call"),
    ({"weight_zero_point_foldable": True}, "an int4 weight stored as int8"),
    ({"bias_dtype": BF16}, "a linear with a bias (as one call with its siblings"),
    ({"out_dtype": torch.float16}, "an output of fp16 runs as the op's extern call"),
    ({"cpp_wrapper": True}, "under Inductor's C++ wrapper (which calls no Python function) the int4 kernel runs as"),
])
def test_int4_decode_without_cuda_graphs_is_the_cuda_kernel_where_inductors_code_launches_it(change, reason):
    """Without CUDA graphs the int4 kernel is taken where Inductor's generated code launches it (qfuse.lowerings.cuda);
    a linear the op's extern call would run (more host time a call) stays on the Triton template, saying why."""
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, BF16, weight_group_size=128)
    key = GemmKey(scheme, m=4, n=4096, k=4096, out_dtype=BF16, bias_dtype=None, device_type="cuda",
                  weight_scale_dtype=BF16)
    assert choose_kernel(key, H100_NVRTC).kernel.name == "cuda"
    assert KernelRequest(dataclasses.replace(key, m=None)).row_bounds(H100_NVRTC) == (16,)
    choice = choose_kernel(dataclasses.replace(key, **change), H100_NVRTC)
    assert choice.kernel.name == "triton" and reason in choice.rejected["cuda"], choice.rejected
    assert choose_kernel(dataclasses.replace(key, cuda_graphs=True, **change), H100_NVRTC).kernel.name == "cuda"


def test_a_dynamic_m_under_cuda_graphs_runs_the_cuda_kernel_at_decode_only():
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, BF16, weight_group_size=128)
    key = GemmKey(scheme, m=None, n=4096, k=4096, out_dtype=BF16, bias_dtype=None, device_type="cuda",
                  weight_scale_dtype=BF16, cuda_graphs=True)
    request = KernelRequest(key)
    # tinygemm's step at 1 is no change of kernel (the cuda kernel on both sides): no guard there
    assert request.row_bounds(H100_NVRTC) == (16,)
    assert request.choose_by_rows(H100_NVRTC, lambda bound: 8 <= bound)[0].kernel.name == "cuda"
    assert request.choose_by_rows(H100_NVRTC, lambda bound: 300 <= bound)[0].kernel.name == "triton"


@pytest.mark.parametrize("scheme", [INT8_DYNAMIC, FP8_DYNAMIC, QuantScheme.weight_only(torch.int8, G.PER_CHANNEL, BF16),
                                    QuantScheme.weight_only(FP8_DTYPE, G.PER_CHANNEL, BF16)], ids=str)
def test_8bit_decode_under_cuda_graphs_is_the_cuda_kernels(scheme):
    """Weight-only up to 16 rows, W8A8 up to 8 (the Triton W8A8 template as fast or faster above, measured); a
    dynamic M is guarded there first (fp8 then at the bounds of cuBLAS and CUTLASS, tested above)."""
    key = GemmKey(scheme, m=None, n=4096, k=4096, out_dtype=BF16, bias_dtype=None, device_type="cuda",
                  cuda_graphs=True)
    request = KernelRequest(key)
    last = 16 if scheme.is_weight_only else 8
    assert request.row_bounds(H100_NVRTC)[0] == last
    for m, chosen in ((1, "cuda"), (last, "cuda"), (last + 1, "triton")):
        assert request.choose_by_rows(H100_NVRTC, lambda bound, m=m: m <= bound)[0].kernel.name == chosen, m
    choice = choose_kernel(dataclasses.replace(key, m=12), H100_NVRTC)
    assert choice.kernel.name == ("cuda" if scheme.is_weight_only else "triton"), choice.rejected
    assert choose_kernel(dataclasses.replace(key, cuda_graphs=False, m=1), H100_NVRTC).kernel.name == "triton"


def test_tinygemm_states_why_it_is_not_taken_elsewhere():
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, BF16, weight_group_size=128)
    key = GemmKey(scheme, m=16, n=4096, k=4096, out_dtype=BF16, bias_dtype=None, device_type="cuda",
                  weight_scale_dtype=BF16, cuda_graphs=True)
    choice = choose_kernel(key, H100, preference=("torch", "triton"))
    assert choice.kernel.name == "triton" and "faster only at M = 1 under CUDA graphs" in choice.rejected["torch"]
    fp16_scales = GemmKey(scheme, m=1, n=4096, k=4096, out_dtype=BF16, bias_dtype=None, device_type="cuda",
                          weight_scale_dtype=torch.float16, cuda_graphs=True)
    choice = choose_kernel(fp16_scales, H100, preference=("torch", "triton"))
    assert "holds the group scales in bf16, and these are fp16" in choice.rejected["torch"]


def test_int4_groups_narrower_than_the_least_k_step_are_declined_on_gpus():
    scheme = QuantScheme.weight_only(INT4_DTYPE, G.PER_GROUP, BF16, weight_group_size=8)
    key = GemmKey(scheme, m=1, n=4096, k=4096, out_dtype=BF16, bias_dtype=None, device_type="cuda")
    choice = choose_kernel(key, H100)
    assert choice.kernel is None and "16" in choice.rejected["triton"]


@pytest.mark.parametrize("weight_dtype, granularity", [(torch.int8, G.PER_CHANNEL), (FP8_DTYPE, G.PER_CHANNEL),
                                                       (FP8_DTYPE, G.BLOCK), (FP8_DTYPE, G.PER_TENSOR)])
@pytest.mark.parametrize("activation", [BF16, torch.float16, torch.float32])
def test_w8a16_on_nvidia_gpus_is_the_triton_kernels(weight_dtype, granularity, activation):
    scheme = QuantScheme.weight_only(weight_dtype, granularity, activation)
    key = GemmKey(scheme, m=1, n=4096, k=4096, out_dtype=activation, bias_dtype=None, device_type="cuda")
    assert choose_kernel(key, H100).kernel.name == "triton"


def test_fp8_w8a16_needs_an_fp8_capable_gpu_and_int8_does_not():
    fp8 = GemmKey(QuantScheme.weight_only(FP8_DTYPE, G.BLOCK, BF16), m=1, n=4096, k=4096, out_dtype=BF16,
                  bias_dtype=None, device_type="cuda")
    choice = choose_kernel(fp8, A100)
    assert choice.kernel is None and "compute capability >= 89" in choice.rejected["triton"]
    int8 = GemmKey(QuantScheme.weight_only(torch.int8, G.PER_CHANNEL, BF16), m=1, n=4096, k=4096, out_dtype=BF16,
                   bias_dtype=None, device_type="cuda")
    assert choose_kernel(int8, A100).kernel.name == "triton"
    with_zero_point = GemmKey(int8.scheme, m=1, n=4096, k=4096, out_dtype=BF16, bias_dtype=None, device_type="cuda",
                              weight_zero_point=True)
    assert choose_kernel(with_zero_point, H100).kernel is None


@pytest.mark.parametrize("m, n, k, float_gemm, platform, chosen", [
    (16, 4096, 4096, True, PLAIN_CPU, None),  # PT2E / fake quant: Inductor's float GEMM is faster
    (None, 4096, 4096, True, PLAIN_CPU, None),
    (1, 2048, 2048, True, PLAIN_CPU, None),  # a small weight: faster at one row too
    (1, 4096, 4096, True, PLAIN_CPU, "torch"),
    (2, 4096, 4096, True, PLAIN_CPU, "torch"),
    (16, 4096, 4096, False, PLAIN_CPU, "torch"),  # written with _int_mm: Inductor runs the same emulated GEMM
    (16, 4096, 4096, True, dataclasses.replace(PLAIN_CPU, cpu_has_avx512_vnni=True), "onednn"),
])
def test_an_int8_linear_written_in_float_is_inductors_where_int8_is_emulated(m, n, k, float_gemm, platform, chosen):
    """Without int8 dot instructions (AVX-512 VNNI, AMX) `_int_mm` is emulated: slower than Inductor's float GEMM
    of a linear written in float except at M <= 2 on weights of 4096 x 4096 and more (docs/benchmarks.md)."""
    gemm = dataclasses.replace(key(INT8_STATIC, out_dtype=FP32, n=n, k=k, m=m), float_gemm_as_written=float_gemm)
    choice = choose_kernel(gemm, platform)
    assert (choice.kernel and choice.kernel.name) == chosen, choice.rejections()
    if chosen is None:
        assert "no int8 dot instructions" in choice.rejected["torch"], choice.rejected


@pytest.mark.parametrize("out_dtype, float_gemm, chosen", [
    (FP32, True, None),  # a fake quant written in float32: its fp8 tensor-core sum is coarser than eager's GEMM
    (FP32, False, "triton"),  # torch._scaled_mm as written: eager sums on the same tensor cores
    (BF16, True, "cutlass"),  # the output's rounding is coarser than the fp8 sum
])
def test_an_fp8_linear_written_as_a_float32_gemm_leaves_the_fp8_tensor_cores(out_dtype, float_gemm, chosen):
    """Hopper sums fp8 products below float32's precision (1.3e-4 to 4.5e-4 of the result measured on an H200,
    cuBLASLt's default included): no kernel runs an fp8 linear that eager multiplies as a float32 GEMM."""
    gemm = dataclasses.replace(key(FP8_DYNAMIC, "cuda", out_dtype=out_dtype), float_gemm_as_written=float_gemm)
    choice = choose_kernel(gemm, H100)
    assert (choice.kernel and choice.kernel.name) == chosen, choice.rejections()
    if chosen is None:
        assert all("below float32's precision" in choice.rejected[name] for name in ("triton", "torch"))
