"""The capability-table check (`qfuse.kernels.capabilities`): every column, on a made-up kernel table.

Each kernel's own rows are tested in its test file through `why_not_implemented`; here each column of
`Capability` rejects what it should with its reason, and the choice among several rows is checked.
"""

import pytest
import torch

from qfuse.kernels import GemmKey
from qfuse.kernels.capabilities import DYNAMIC, SAME_AS_OUTPUT, Capability, table_verdict
from qfuse.platform import Platform
from qfuse.schemes import FP8_DTYPE, INT4_DTYPE, Granularity, QuantScheme

G = Granularity
INT8 = QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True)
H100 = Platform("cuda", cuda_capability=(9, 0), libraries=frozenset({"vllm"}))
A100 = Platform("cuda", cuda_capability=(8, 0))
MI300 = Platform("cuda", is_rocm=True, cuda_capability=(9, 4))
ROW = Capability("int8 row", ("cuda",), (torch.int8,), (torch.int8,), k_multiple=16, n_multiple=8,
                 out_dtypes=(torch.bfloat16,), bias_dtypes=SAME_AS_OUTPUT, min_capability=89, rocm=False,
                 requires=("vllm",))


def key(scheme=INT8, k=4096, n=4096, out_dtype=torch.bfloat16, bias_dtype=None, device="cuda", weight_zero_point=False):
    return GemmKey(scheme, n=n, k=k, out_dtype=out_dtype, bias_dtype=bias_dtype, device_type=device,
                   weight_zero_point=weight_zero_point)


@pytest.mark.parametrize(
    "gemm, platform, reason",
    [
        (key(), H100, ""),
        (key(device="cpu"), H100, "kernel takes cuda tensors, not cpu"),
        (key(QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, True)), H100,
         "kernel computes int8 x int8 on cuda, not fp8 x fp8"),
        (key(QuantScheme.weight_only(torch.int8, G.PER_CHANNEL)), H100,
         "kernel computes int8 x int8 on cuda, not bf16 x int8 (weight-only)"),
        (key(), Platform("cuda", cuda_capability=(9, 0)), "int8 row needs vllm (not importable)"),
        (key(), Platform("cuda", is_rocm=True, libraries=frozenset({"vllm"})), "int8 row does not run on ROCm GPUs"),
        (key(), Platform("cuda", cuda_capability=(8, 0), libraries=frozenset({"vllm"})),
         "int8 row needs compute capability >= 89 (this GPU: 80)"),
        (key(QuantScheme(torch.int8, torch.int8, G.PER_GROUP, G.PER_CHANNEL, True)), H100,
         "int8 row takes per-tensor / per-token activation scales, not per-group"),
        (key(QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, True, symmetric=False)), H100,
         "int8 row takes no activation zero point (asymmetric activations)"),
        (key(weight_zero_point=True), H100, "int8 row takes symmetric weights only (this weight has a zero point)"),
        (key(QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.BLOCK, True)), H100,
         "int8 row takes per-tensor / per-channel weight scales, not block"),
        (key(k=4104), H100, "int8 row needs static K a multiple of 16 and N a multiple of 8 (K=4104, N=4096)"),
        (key(n=None), H100, "int8 row needs static K a multiple of 16 and N a multiple of 8 (K=4096, N=None)"),
        (key(out_dtype=torch.float16), H100, "int8 row writes bf16, not fp16"),
        (key(bias_dtype=torch.float32), H100, "int8 row adds a bias of the output dtype only (bias fp32, output bf16)"),
        (key(bias_dtype=torch.bfloat16), H100, ""),
    ],
)
def test_each_column_rejects_with_its_reason(gemm, platform, reason):
    assert table_verdict("kernel", (ROW,), gemm, platform) == reason


def test_dynamic_only_rows_and_bias_dtype_lists():
    row = Capability("dynamic row", ("cpu",), (torch.int8,), (torch.int8,), activation_scale_kinds=(DYNAMIC,),
                     bias_dtypes=(torch.float32,))
    static = QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=False)
    assert table_verdict("k", (row,), key(static, device="cpu"), Platform("cpu")) == "dynamic row takes dynamic activation scales only"
    assert table_verdict("k", (row,), key(bias_dtype=torch.float16, device="cpu"), Platform("cpu")) == (
        "dynamic row adds a fp32 bias, not fp16")


@pytest.mark.parametrize(
    "group, k, reason",
    [
        (64, 4096, ""),
        (48, 4096, "int4 row needs a weight group size that is a multiple of 32, got 48"),
        (128, 4160, "int4 row needs a weight group size that divides K (group 128, K=4160)"),
    ],
)
def test_weight_groups(group, k, reason):
    row = Capability("int4 row", ("xpu",), (torch.int8,), (INT4_DTYPE,), weight_scales=(G.PER_GROUP,),
                     weight_group_multiple=32)
    scheme = QuantScheme(torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, dynamic=True, weight_group_size=group)
    assert table_verdict("k", (row,), key(scheme, k=k, device="xpu"), Platform("xpu")) == reason


def test_a_declined_row_gives_its_reason():
    declined = Capability("fp8 row", ("cpu",), (FP8_DTYPE,), (FP8_DTYPE,), declined="measured slower than the torch kernel")
    fp8 = QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TENSOR, G.PER_TENSOR, dynamic=False)
    assert table_verdict("k", (declined,), key(fp8, device="cpu"), Platform("cpu")) == "measured slower than the torch kernel"
    assert table_verdict("k", (declined, ROW), key(fp8), H100) == "k computes int8 x int8 on cuda, not fp8 x fp8"


def test_one_accepting_row_is_enough_and_the_furthest_rows_explain_a_rejection():
    bf16_only = Capability("bf16 row", ("cuda",), (torch.int8,), (torch.int8,), out_dtypes=(torch.bfloat16,))
    needs_vllm = Capability("vllm row", ("cuda",), (torch.int8,), (torch.int8,), requires=("vllm",))
    rows = (needs_vllm, bf16_only)
    assert table_verdict("k", rows, key(), A100) == ""
    assert table_verdict("k", rows, key(out_dtype=torch.float16), H100) == ""
    # vllm row fails first (its package), bf16 row later (its output): the later failure is the reason.
    assert table_verdict("k", rows, key(out_dtype=torch.float16), A100) == "bf16 row writes bf16, not fp16"
    both_late = (Capability("a", ("cuda",), (torch.int8,), (torch.int8,), out_dtypes=(torch.float32,)), bf16_only)
    assert table_verdict("k", both_late, key(out_dtype=torch.float16), A100) == "a writes fp32, not fp16; bf16 row writes bf16, not fp16"


def test_rocm_is_not_held_to_nvidia_capability():
    row = Capability("int8 dot", ("cuda",), (torch.int8,), (torch.int8,), min_capability=80)
    assert table_verdict("k", (row,), key(), MI300) == ""
    assert table_verdict("k", (row,), key(), Platform("cuda", cuda_capability=(7, 5))) == (
        "int8 dot needs compute capability >= 80 (this GPU: 75)")
