"""The Triton W4A16 kernel as an Inductor template (GPU only; run on the GPU machine): the GPTQ and
compressed-tensors forms compile to one template kernel that reads the stored words (no extern call
of qfuse's op, no unpacked weight), with numerics equal to eager for symmetric and asymmetric
weights, groups and per channel, bias, 3D, static and dynamic M, default mode, max-autotune and
CUDA graphs; GPTQ's act order, zero points stored minus one and AutoGPTQ's [K / 8, N] layout at decode
and prefill (act order: Inductor's own dequantize + mm at every M, lowerings/triton/int4.py; else, above the
decode templates' rows, the weight dequantized by a template and Inductor's mm: lowerings/triton/dequantize.py); AWQ's
words packed along N; torchao's intx weights (int8 storage); the nibble-plane template where a step of
128 lies in one group (`int4_planes`)."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from qfuse.kernels.triton.int4_planes import PLANE_MAX_ROWS, PLANE_TILES
from tests.helpers import (DECODE_MARKS, DEQUANTIZE_MARK, assert_close_to_eager, assert_one_compile_per_m_bucket,
                           compile_and_get_code, decode_template_in, record_under_cuda_graphs)
from tests.peers.weight_only_models import autogptq_int4, awq_int4, gptq_packed_int4, torchao_intx_int4

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PLANES_MARK = "from qfuse.kernels.triton.int4_planes import plane_dot"
EXTERN_CALL = "torch.ops.qfuse.int4_weight_only_mm.default("
CUDA_CALL = "extern_kernels.qfuse_cuda_int4_mma"  # the cuda kernel called from Inductor's code (lowerings/cuda.py)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("symmetric, group_size", [(True, 32), (False, 32), (True, 128), (False, 128), (True, None),
                                                    (False, None)],
                         ids=["g32", "g32_zeros", "g128", "g128_zeros", "per_channel", "per_channel_zeros"])
def test_gptq_form_runs_as_the_template(dtype, symmetric, group_size):
    model = gptq_packed_int4(dtype, group_size=group_size, symmetric=symmetric, in_features=512, out_features=136).cuda()
    x = torch.randn(5, 512, device="cuda", dtype=dtype)
    with torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    assert decode_template_in(code) and EXTERN_CALL not in code
    (record,) = report.fused
    assert record.kernel == "triton" and record.lowered.startswith("Triton template"), record.lowered
    # groups of 128 and per channel (one group a step of 128): the nibble-plane loop; groups of 32: the words'
    assert (PLANES_MARK in code) == (group_size != 32), record.lowered
    assert ("by nibble plane, two values a register" in record.lowered) == (group_size != 32 and dtype != FP32)


@pytest.mark.parametrize("shape", [(1, 256), (2, 3, 256), (17, 256), (100, 256), (3, 70, 256), (257, 256), (300, 256)],
                         ids=["M1", "3D_decode", "M17", "M100", "3D", "M257", "M300"])
@pytest.mark.parametrize("group_size", [64, 128], ids=["words", "planes"])
def test_decode_is_the_template_and_prefill_the_dequantize_template_and_mm(shape, group_size):
    """The words template up to 16 rows; the plane template (a step of 128 in one group) up to 256 rows,
    batched decode included; above, the weight dequantized by a template and Inductor's mm."""
    model = gptq_packed_int4(BF16, group_size=group_size, symmetric=False).cuda()
    x = torch.randn(*shape, device="cuda", dtype=BF16)
    with torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    (record,) = report.fused
    assert EXTERN_CALL not in code
    if x.numel() // 256 <= (PLANE_MAX_ROWS if group_size == 128 else 16):
        assert decode_template_in(code) and record.lowered.startswith("Triton template"), record.lowered
        assert (PLANES_MARK in code) == (group_size == 128)
    else:
        assert not decode_template_in(code) and DEQUANTIZE_MARK in code, record.lowered
        assert record.lowered.startswith("the weight dequantized by a Triton template"), record.lowered
        assert f"M above {PLANE_MAX_ROWS if group_size == 128 else 16}" in record.lowered, record.lowered


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("symmetric, group_size, k", [(True, 32, 512), (False, 128, 512), (False, None, 320),
                                                       (True, 64, 320)],
                         ids=["g32", "g128_zeros", "per_channel_zeros_uneven_k", "g64_k320"])
def test_prefill_weight_dequantized_by_the_template(dtype, symmetric, group_size, k):
    """Above the decode templates' rows the weight is dequantized by a template (its K steps fitted to the
    group; a K that is not a multiple of the step masked), then Inductor's mm: eager's numerics, 3D, N = 136."""
    model = gptq_packed_int4(dtype, group_size=group_size, symmetric=symmetric, in_features=k, out_features=136).cuda()
    x = torch.randn(2, 150, k, device="cuda", dtype=dtype)
    with torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    (record,) = report.fused
    assert DEQUANTIZE_MARK in code and not decode_template_in(code) and EXTERN_CALL not in code, record.lowered
    assert record.lowered.startswith("the weight dequantized by a Triton template"), record.lowered


def test_dynamic_m_compiles_once_per_m_bucket():
    """The words template (groups of 64) at decode only; the plane template (groups of 128) up to 256 rows,
    in the buckets of `int4_planes.PLANE_TILES`."""
    assert_one_compile_per_m_bucket(gptq_packed_int4(BF16, group_size=64).cuda(), DECODE_MARKS[0], EXTERN_CALL)
    assert_one_compile_per_m_bucket(gptq_packed_int4(BF16, group_size=128).cuda(), PLANES_MARK, EXTERN_CALL,
                                    bounds=tuple(PLANE_TILES))


@pytest.mark.parametrize("mode", ["max-autotune-no-cudagraphs", "reduce-overhead"])
def test_modes(mode):
    """max-autotune: the template. Under CUDA graphs at decode the `cuda` kernel's extern call
    (test_decode_under_cuda_graphs_runs_the_cuda_kernel); groups of 32, which it does not take, the template."""
    model = gptq_packed_int4(BF16, group_size=32, symmetric=False).cuda()
    x = torch.randn(16, 256, device="cuda", dtype=BF16)
    with torch.no_grad():
        out, code, _ = compile_and_get_code(model, x, mode=mode)
        assert_close_to_eager(out, model, x)
    assert decode_template_in(code) and EXTERN_CALL not in code


def test_the_cast_and_next_op_fuse_into_the_store():
    model = gptq_packed_int4(BF16, group_size=128, in_features=128).cuda()  # one K step: no split

    def block(x):
        return torch.nn.functional.silu(model(x)) * 2

    x = torch.randn(8, 128, device="cuda", dtype=BF16)
    with torch.no_grad():
        out, code, _ = compile_and_get_code(block, x)
        expected = torch.nn.functional.silu(model(x)) * 2
    # the activation permuted by plane, then the template, whose store holds the silu and the multiply
    assert code.count(".run(") == 2, code
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("rows", [3, 40])
@pytest.mark.parametrize("form", ["act_order_zeros_minus_one", "autogptq_act_order"])
def test_act_order_and_autogptq_forms(form, rows):
    if form == "autogptq_act_order":
        model = autogptq_int4(FP16, group_size=64, act_order=True).cuda()
    else:
        model = gptq_packed_int4(FP16, group_size=64, act_order=True, symmetric=False, zeros_minus_one=True).cuda()
    x = torch.randn(rows, 256, device="cuda", dtype=FP16)
    with torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    (record,) = report.fused
    assert EXTERN_CALL not in code
    assert not decode_template_in(code) and DEQUANTIZE_MARK not in code, record.lowered  # act order: Inductor's code
    assert "a g_idx" in record.lowered, record.lowered


def _act_order_model(form: str, group_size: int):
    if form == "autogptq_act_order":
        return autogptq_int4(BF16, group_size=group_size, act_order=True, in_features=512).cuda()
    return gptq_packed_int4(BF16, group_size=group_size, act_order=True, symmetric=False, zeros_minus_one=True,
                            in_features=512).cuda()


@pytest.mark.parametrize("lead", [(1,), (3,), (2, 20), (300,)], ids=["M1", "M3", "3D_M40", "M300"])
@pytest.mark.parametrize("group_size", [64, 128], ids=["words", "planes"])
@pytest.mark.parametrize("form", ["act_order_zeros_minus_one", "autogptq_act_order"])
def test_act_order_under_freezing_runs_the_template_on_the_weight_sorted_at_compile_time(form, group_size, lead):
    """Under freezing the act-order weight is a constant: sorted by group at compile time, it is the plain
    form, which the templates take at their rows (planes up to 256, words up to 16) with the activation
    gathered in Inductor's code; above, Inductor's dequantize + mm of the sorted weight (no per-column gathers)."""
    model = _act_order_model(form, group_size)
    x = torch.randn(*lead, 512, device="cuda", dtype=BF16)
    rows = x.numel() // 512
    with torch._inductor.config.patch(freezing=True), torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    (record,) = report.fused
    on_template = rows <= (PLANE_MAX_ROWS if group_size == 128 else 16)
    assert EXTERN_CALL not in code
    assert ("sorted by group at compile time" in record.lowered) == on_template, record.lowered
    assert decode_template_in(code) == on_template, record.lowered
    assert (PLANES_MARK in code) == (on_template and group_size == 128), record.lowered
    if not on_template:  # above the template's rows the sorted weight was slower than the gathers
        assert record.lowered.startswith("Inductor's own dequantize + mm (a g_idx"), record.lowered


@pytest.mark.parametrize("rows", [1, 16, 40, 300])
@pytest.mark.parametrize("group_size", [64, 128], ids=["words", "planes"])
def test_act_order_under_cuda_graphs_is_the_ops_call_on_a_weight_sorted_once(group_size, rows):
    """Under CUDA graphs at decode (M <= 16) act order is the op's extern call on the `cuda` kernel: its Python
    sorts the weight once and runs at capture only. Above, Inductor's dequantize + mm with the gathers."""

    model = _act_order_model("act_order_zeros_minus_one", group_size)
    x = torch.randn(rows, 512, device="cuda", dtype=BF16)
    record = record_under_cuda_graphs(model, x)
    if rows <= 16:  # the cuda kernel's extern call (its weight sorted once)
        assert record.kernel == "cuda" and record.lowered.startswith("extern call"), record
    else:
        assert record.kernel == "triton", record
        assert record.lowered.startswith("Inductor's own dequantize + mm (a g_idx"), record.lowered


def test_autogptq_without_act_order_reads_the_transposed_words_in_the_template():
    """Only the lowering's g_idx gate keeps AutoGPTQ off the template: the op without it, on the
    transposed stored tensors, runs the template at decode."""
    model = autogptq_int4(FP16, group_size=64).cuda()

    def linear(x):
        return torch.ops.qfuse.int4_weight_only_mm(x, model.qweight.t(), model.wf.reshape(8), model.scales.t(),
                                                   model.qzeros.t(), model.bias, 64, x.dtype, "triton", None,
                                                   "plus_one_mod_16")

    x = torch.randn(4, 256, device="cuda", dtype=FP16)
    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(linear), x)
    assert decode_template_in("\n".join(code))
    assert_close_to_eager(out, model, x)


@pytest.mark.parametrize("rows", [3, 40, 128, 129])
@pytest.mark.parametrize("unpack_order, n, k", [("index", 128, 256), ("shifts", 128, 256), ("index", 2048, 1024)])
def test_awq_runs_as_the_template_at_batched_decode(unpack_order, n, k, rows):
    """AutoAWQ's order gather: its shifts become a constant on the GPU (a CPU one read nan at 14336 columns).
    At decode the cuda kernel launched from Inductor's code or the words template, as the record says (which of
    the two has differed between runs of this file on an H200: issue #41's note, session 32); the words template up
    to 128 rows (batched decode: `int4_mm.BATCHED_TILES`); above, the weight dequantized by a template and Inductor's
    mm."""
    model = awq_int4(FP16, group_size=64, unpack_order=unpack_order, in_features=k, out_features=n).cuda()
    x = torch.randn(rows, k, device="cuda", dtype=FP16)
    with torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    (record,) = report.fused
    assert EXTERN_CALL not in code
    on_cuda_kernel = record.kernel == "cuda"
    assert (CUDA_CALL in code) == on_cuda_kernel and (not on_cuda_kernel or rows <= 16), record.lowered
    assert decode_template_in(code) == (rows <= 128 and not on_cuda_kernel), record.lowered
    assert (DEQUANTIZE_MARK in code) == (rows > 128), record.lowered


@pytest.mark.parametrize("act_order", [False, True])
def test_m_1_under_cuda_graphs_runs_atens_tinygemm_where_the_cuda_kernel_cannot(act_order):
    """At M = 1 under CUDA graphs, groups of 32 (the cuda kernel takes multiples of 64), kernel choice takes
    ATen's tinygemm (kernels/int4_tinygemm.py) for a symmetric bf16 weight: the op's extern call on the
    weight packed once, captured and replayed."""

    model = gptq_packed_int4(BF16, group_size=32, act_order=act_order).cuda()
    x = torch.randn(1, 256, device="cuda", dtype=BF16)
    record = record_under_cuda_graphs(model, x)
    assert record.kernel == "torch" and "tinygemm" in record.rejected_kernels["triton"], record
    assert record.lowered.startswith("extern call"), record.lowered


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("zero_points, values", [("zero", "int4"), ("int4", "int4"), ("wide", "int8")])
@pytest.mark.parametrize("rows", [5, 40, 200], ids=["decode", "batched", "prefill"])
def test_torchao_intx_runs_as_the_template_at_decode(dtype, zero_points, values, rows):
    """torchao's intx weights (int4 values one per int8) fuse, then compile to the template reading the
    int8 values at decode and batched decode (up to 128 rows) and to Inductor's dequantize + mm above;
    out-of-range values included."""
    model = torchao_intx_int4(dtype, group_size=32, zero_points=zero_points, values=values, in_features=512,
                              out_features=136).cuda()
    x = torch.randn(rows, 512, device="cuda", dtype=dtype)
    with torch.no_grad():
        out, code, report = compile_and_get_code(model, x)
        assert_close_to_eager(out, model, x)
    (record,) = report.fused
    assert record.family == "intx_weight_only" and record.kernel == "triton", record
    assert EXTERN_CALL not in code and decode_template_in(code) == (rows <= 128)
    assert (DEQUANTIZE_MARK in code) == (rows > 128), record.lowered


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("form", ["g128", "g128_zeros", "per_channel", "act_order", "zeros_minus_one"])
@pytest.mark.parametrize("lead", [(1,), (5,), (9,), (16,), (2, 3), (40,)], ids=["M1", "M5", "M9", "M16", "3D", "M40"])
def test_decode_under_cuda_graphs_runs_the_cuda_kernel(dtype, form, lead):
    """Under CUDA graphs, at M <= 16, the `cuda` kernel (qfuse.kernels.cuda: tensor cores, the weight repacked
    once) runs, called from Inductor's code (act order: the op's extern call), captured and replayed, with
    eager's numerics; above, the templates."""

    group = None if form == "per_channel" else 128
    model = gptq_packed_int4(dtype, group_size=group, symmetric=form not in ("g128", "per_channel", "act_order"),
                             act_order=form == "act_order", zeros_minus_one=form == "zeros_minus_one",
                             in_features=512, out_features=144).cuda()
    x = torch.randn(*lead, 512, device="cuda", dtype=dtype)
    record = record_under_cuda_graphs(model, x)
    decode = x.numel() // 512 <= 16
    assert (record.kernel == "cuda") == decode, record
    if decode:
        assert record.lowered.startswith("extern call" if form == "act_order" else CUDA_CALL), record.lowered


def test_a_dynamic_m_under_cuda_graphs_runs_the_cuda_kernel_in_the_decode_bucket():
    """The pass sees no M; the lowering asks kernel choice again for M's bucket: M <= 16 the cuda kernel,
    above it the Triton templates (the bucket guarded: one compile each)."""
    import qfuse

    model = gptq_packed_int4(BF16, group_size=128, in_features=512, out_features=144).cuda()
    compiled = torch.compile(model, backend="qfuse", mode="reduce-overhead", dynamic=True)
    marker = qfuse.graphs_compiled()
    torch._dynamo.reset()
    with torch.no_grad():
        for rows in (5, 9, 100, 120):
            x = torch.randn(rows, 512, device="cuda", dtype=BF16)
            for _ in range(3):
                out = compiled(x)
            assert_close_to_eager(out.clone(), model, x)
    records = [report.fused[0] for report in qfuse.reports_since(marker)]
    assert len(records) == 2, [record.lowered for record in records]  # one compile a bucket
    decode, batched = records
    assert decode.lowered.startswith(CUDA_CALL), decode.lowered
    assert "M above 16 (a dynamic M, guarded) runs triton, not cuda" in batched.lowered, batched.lowered
