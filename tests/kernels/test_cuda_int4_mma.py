"""The CUDA W4A16 decode kernel's layout (`qfuse.kernels.cuda.int4_mma`), checked on the CPU: `repack`'s words
read the way the kernel's lanes read them into mma.m16n8k16's A and B fragments give eager's linear.

The emulation follows the PTX fragment layout of mma.m16n8k16 (lane l = 4 g + t: A rows g and g + 8, k slots
2t, 2t + 1, 2t + 8, 2t + 9; B column g, the same slots) and the .cu file's dequantize: nibble pairs
(bits 0 / 16, 4 / 20, 8 / 24, 12 / 28) to a0, a1, a2, a3, lane t's B for step s at k = 16 t + 4 s + 0..3.
The kernel itself runs on the GPU machine: below against eager's dequantize and matmul, every number of 8-column
tiles (M up to 64 a launch, and past it), and in tests/lowerings/test_int4_template.py's compiled cases."""

import pytest
import torch

from qfuse.kernels.cuda.int4_mma import repack, why_not_shape


def emulated_mma(x: torch.Tensor, words: torch.Tensor, pairs: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M <= 8, K] @ w^T in float64, reading `words` and `pairs` as the kernel's lanes do."""
    m, k = x.shape
    tiles, chunks = words.shape[:2]
    n = tiles * 16
    halves = pairs.view(torch.int16).view(torch.bfloat16).reshape(pairs.shape[0], n, 2).double()
    scale, minus_zero = halves[..., 0], halves[..., 1]
    out = torch.zeros(n, 8, dtype=torch.float64)
    columns = torch.zeros(k, 8, dtype=torch.float64)
    columns[:, :m] = x.double().t()
    for tile in range(tiles):
        for chunk in range(chunks):
            group = chunk * 64 // group_size
            for step in range(4):
                a, b = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    word = int(words[tile, chunk, lane, step]) & 0xFFFFFFFF
                    nibble = [(word >> (4 * j)) & 0xF for j in range(8)]
                    k0 = chunk * 64 + 16 * t + 4 * step
                    for (row, slot), j in {(g, 2 * t): 0, (g, 2 * t + 1): 4, (g + 8, 2 * t): 1, (g + 8, 2 * t + 1): 5,
                                           (g, 2 * t + 8): 2, (g, 2 * t + 9): 6, (g + 8, 2 * t + 8): 3,
                                           (g + 8, 2 * t + 9): 7}.items():
                        column = tile * 16 + 2 * (row & 7) + (row >> 3)  # rows g, g + 8 side by side
                        value = (128 + nibble[j] + minus_zero[group, column]) * scale[group, column]
                        a[row, slot] = float(value.to(torch.bfloat16))  # rounded once, as eager
                    for slot, e in ((2 * t, 0), (2 * t + 1, 1), (2 * t + 8, 2), (2 * t + 9, 3)):
                        b[slot, g] = columns[k0 + e, g]
                out[tile * 16: tile * 16 + 16] += a @ b
    return out[:, :m].t()


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("group_size", [64, 128])
def test_the_lanes_read_eagers_linear_from_the_repacked_weight(zero_points, group_size):
    generator = torch.Generator().manual_seed(0)
    n, k, m = 32, 128, 3
    values = torch.randint(-8, 8, (k, n), generator=generator, dtype=torch.int8)
    scale = (torch.rand(k // group_size, n, generator=generator) / 16).to(torch.bfloat16)
    zero = torch.randint(-8, 8, (k // group_size, n), generator=generator, dtype=torch.int8) if zero_points else None
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    words, pairs = repack(values, scale, zero)
    assert words.shape == (n // 16, k // 64, 32, 4) and words.dtype == torch.int32 and pairs.shape == (k // group_size, n)
    group = torch.arange(k) // group_size
    z = zero.to(torch.int32)[group] if zero_points else 0
    w = ((values.to(torch.int32) - z).to(torch.bfloat16) * scale[group]).double()  # [K, N], eager's rounding
    torch.testing.assert_close(emulated_mma(x, words, pairs, group_size), x.double() @ w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n, k, group_size, reason", [
    (4096, 4096, 128, ""), (4096, 4096, 4096, ""), (4104, 4096, 128, "N is not a multiple of 16"),
    (4096, 4128, 32, "K is not a multiple of 64"), (4096, 4096, 32, "groups of 32"), (4096, 4224, 4224, ""),
    (4096, 4608, 192, "groups of 192"),
])
def test_the_shapes_it_takes(n, k, group_size, reason):
    assert why_not_shape(n, k, group_size).startswith(reason) and bool(why_not_shape(n, k, group_size)) == bool(reason)


def test_bad_input_is_named_before_any_launch():
    from qfuse.kernels import get_kernel
    from qfuse.kernels.cuda.int4_mma import int4_mma

    values = torch.zeros(128, 32, dtype=torch.int8)
    scale = torch.ones(1, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="groups of 32"):
        repack(torch.zeros(128, 32, dtype=torch.int8), torch.ones(4, 32, dtype=torch.bfloat16), None)
    weight = get_kernel("cuda").prepare_int4_weight(values, scale, None)
    assert weight.packing == "int4_mma_bf16"
    with pytest.raises(ValueError, match="prepared for int4_mma_bf16, and x is torch.float16"):
        get_kernel("cuda").weight_only_apply(torch.zeros(1, 128, dtype=torch.float16), weight, None, torch.float16)
    with pytest.raises(ValueError, match="cannot launch 64 rows on 16 warps: 16 warps' partial sums of 8 tiles take "
                                         "65536 bytes of shared memory"):
        int4_mma(torch.zeros(129, 128, dtype=torch.bfloat16), weight.data, weight.scale, None, 128, torch.bfloat16, (16, 2))


@pytest.mark.parametrize("m, n, k, shape", [(1, 4096, 4096, (16, 4)), (1, 28672, 4096, (4, 8)), (16, 4096, 14336, (16, 8)),
                                            (16, 6144, 4096, (8, 8)), (1, 4096, 2048, (16, 4)),
                                            (32, 6144, 4096, (4, 4)), (32, 4096, 4096, (8, 4)), (32, 28672, 4096, (4, 2)),
                                            (64, 4096, 4096, (4, 8))])
def test_the_launch_rule(m, n, k, shape):
    """Up to 16 rows warps for about 4096 in the grid, 8 chunks ahead where a warp's share has 8, else 4; above (each warp's loads of x bound the launch)
    half the warps up to 32 rows (2 chunks ahead on more
    than 1024 tiles), 4 warps 8 chunks ahead above."""
    from qfuse.kernels.cuda.int4_mma import launch_shape

    assert launch_shape(m, n, k) == shape


def test_every_launch_rule_pick_fits_shared_memory():
    from qfuse.kernels.cuda import w8_mma
    from qfuse.kernels.cuda.int4_mma import launch_shape, why_not_launch

    for m in range(1, 65):
        for n in (16, 48, 4096, 6144, 8192, 8208, 14336, 28672):
            warps, _ = launch_shape(m, n, 4096)
            assert not why_not_launch(m, warps), (m, n)
            row_tiles, warps, _ = w8_mma.launch_shape(m, n)
            assert not why_not_launch(m, warps, row_tiles) and (n // 16) % row_tiles == 0, (m, n)


@pytest.mark.parametrize("m, tiles", [(1, 1), (8, 1), (9, 2), (16, 2), (17, 4), (32, 4), (33, 8), (64, 8)])
def test_a_launch_computes_the_tiles_of_its_rows(m, tiles):
    from qfuse.kernels.cuda.int4_mma import column_tiles

    assert column_tiles(m) == tiles


# --- on the GPU machine: the kernel against eager's math (skipped without CUDA) --------------------------------

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROUNDING = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}  # float32: the sums' order


@GPU
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 64, 70])
@pytest.mark.parametrize("dtype, zero_points, bias, out_f32", [
    (torch.bfloat16, False, False, False), (torch.bfloat16, True, True, False), (torch.float16, True, False, True),
    (torch.float16, False, True, False)], ids=["bf16", "bf16-zero-points-bias", "fp16-zero-points-f32", "fp16-bias"])
def test_on_the_gpu_it_is_eagers_linear(m, dtype, zero_points, bias, out_f32):
    """Every number of 8-column tiles of B (1, 2, 4, 8) and two launches past 64 rows: within two roundings of the
    output dtype of the float product of x and eager's dequantized weight ((q - z) * s rounded to x's dtype)."""
    from qfuse.kernels import get_kernel

    torch.manual_seed(m)
    n, k, group_size = 272, 1024, 128
    values = torch.randint(-8, 8, (k, n), device="cuda", dtype=torch.int8)
    scale = (torch.rand(k // group_size, n, device="cuda") / 16).to(dtype)
    zero = torch.randint(-8, 8, (k // group_size, n), device="cuda", dtype=torch.int8) if zero_points else None
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    out_dtype = torch.float32 if out_f32 else dtype
    cuda = get_kernel("cuda")
    out = cuda.weight_only_apply(x, cuda.prepare_int4_weight(values, scale, zero), b, out_dtype)
    group = torch.arange(k, device="cuda") // group_size
    z = zero.to(torch.int32)[group] if zero_points else 0
    w = (values.to(torch.int32) - z).to(dtype) * scale[group]  # [K, N], eager's rounding
    expected = x.double() @ w.double() + (0 if b is None else b.double())
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert (out.double() - expected).abs().max().item() <= 2 * ROUNDING[out_dtype] * expected.abs().max().item()


@GPU
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("group_size", [64, 256, 1024, 1088], ids=["g64", "g256", "g1024-of-2048", "per-channel"])
def test_on_the_gpu_every_group_size(m, group_size):
    """A chunk's group found by a shift (groups of 1, 4 and 16 chunks; a warp's share rounded to whole groups) or one
    group along K (1088 = 17 chunks): eager's linear, within two roundings of bf16."""
    from qfuse.kernels import get_kernel

    torch.manual_seed(group_size)
    n, k = 272, 1088 if group_size == 1088 else 1024 * (group_size // 512 or 1)
    values = torch.randint(-8, 8, (k, n), device="cuda", dtype=torch.int8)
    scale = (torch.rand(k // group_size, n, device="cuda") / 16).to(torch.bfloat16)
    zero = torch.randint(-8, 8, (k // group_size, n), device="cuda", dtype=torch.int8)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cuda = get_kernel("cuda")
    out = cuda.weight_only_apply(x, cuda.prepare_int4_weight(values, scale, zero), None, torch.bfloat16)
    group = torch.arange(k, device="cuda") // group_size
    w = (values.to(torch.int32) - zero.to(torch.int32)[group]).to(torch.bfloat16) * scale[group]
    expected = x.double() @ w.double()
    assert (out.double() - expected).abs().max().item() <= 2 * ROUNDING[torch.bfloat16] * expected.abs().max().item()


@GPU
def test_on_the_gpu_a_gptq_weight_is_prepared_in_a_few_bytes_a_value():
    """Unpacking a GPTQ weight and repacking it for the kernel holds at most 6 bytes a value at once on the GPU (the
    values, their copies and the repack's bytes; int64 nibbles took over 16: gigabytes for a large model's joined
    gate / up weight), and its words are `repack`'s of the words' values (whose layout the emulation above checks)."""
    from qfuse.ops.int4_weight_only import prepared_int4_weight

    n, k = 4096, 4096
    packed = torch.randint(-2**31, 2**31 - 1, (n, k // 8), device="cuda", dtype=torch.int32)
    # scales [K / G, N]-contiguous beside [N, K / 8] words: a layout the kernel does not read in place
    scales = (torch.rand(k // 128, n, device="cuda") / 16).to(torch.bfloat16).t()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    _, prepared = prepared_int4_weight("cuda", packed, None, scales, None, 128)
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= 6 * n * k, f"{peak / (n * k):.1f} bytes a value"
    values = (((packed.unsqueeze(-1) >> torch.arange(0, 32, 4, device="cuda")) & 0xF) - 8).reshape(n, k)
    words, _ = repack(values.t().to(torch.int8), scales.t().contiguous(), None)
    assert torch.equal(prepared.data, words)


# --- the checkpoint's own words, read in place -------------------------------------------------------------------

def checkpoint_tensors(n, k, group_size, layout, zero_points, generator, device="cpu"):
    """(packed, scales, packed_zeros): the op's canonical views [N, K / 8], [N, K / G], [N / 8, K / G] of tensors
    stored as compressed-tensors stores them (WORDS_ALONG_K: those shapes, contiguous) or as AutoGPTQ does
    (WORDS_ALONG_N: qweight [K / 8, N], scales [K / G, N], qzeros [K / G, N / 8], transposed)."""
    from qfuse.kernels.cuda.int4_mma import WORDS_ALONG_K

    words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=generator, dtype=torch.int32)
    scales = (torch.rand(n, k // group_size, generator=generator) / 16).to(torch.bfloat16)
    zeros = torch.randint(-2**31, 2**31 - 1, (n // 8, k // group_size), generator=generator, dtype=torch.int32)
    tensors = (words, scales, zeros if zero_points else None)
    if layout != WORDS_ALONG_K:
        tensors = tuple(None if t is None else t.t().contiguous().t() for t in tensors)
    return tuple(None if t is None else t.to(device) for t in tensors)


def eager_int4(packed, scales, zeros, group_size, zero_convention, dtype=torch.bfloat16):
    """w [N, K] of the op's formula (tests/ops have the op's own checks): (q - z) * s rounded to `dtype`."""
    n, k = packed.shape[0], packed.shape[1] * 8
    shifts = torch.arange(0, 32, 4, device=packed.device)
    q = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(n, k)
    z = torch.full((n, k // group_size), 8, dtype=torch.int32, device=packed.device)
    if zeros is not None:
        u = (zeros.unsqueeze(1) >> shifts[:, None]).reshape(n, -1)
        z = {"stored": u & 0xF, "plus_one": (u & 0xF) + 1, "plus_one_mod_16": (u + 1) & 0xF}[zero_convention]
    group = torch.arange(k, device=packed.device) // group_size
    return (q - z[:, group]).to(dtype) * scales[:, group].to(dtype)


def emulated_checkpoint_mma(x, members, group_size, zero_convention, layout):
    """x [M <= 8, K] @ w^T in float64, reading each member's storage as the .cu file's lanes do (`WeightLane`: the
    two 8-byte loads' addresses, the scale and zero point words, step s's pairs and x's B operands after `prmt`),
    members side by side along N."""
    from qfuse.kernels.cuda.int4_mma import WORDS_ALONG_K, ZERO_CONVENTION_CODES

    m, k = x.shape
    columns = torch.zeros(k, 8, dtype=torch.float64)
    columns[:, :m] = x.double().t()
    outs = []
    for packed, scales, zeros in members:
        n, groups = packed.shape[0], k // group_size
        flat = packed.t().reshape(-1) if layout != WORDS_ALONG_K else packed.reshape(-1)  # the storage, in order
        scale_flat = scales.t().reshape(-1) if layout != WORDS_ALONG_K else scales.reshape(-1)
        zero_flat = None if zeros is None else zeros.t().reshape(-1) if layout != WORDS_ALONG_K else zeros.reshape(-1)
        code = 0 if zeros is None else ZERO_CONVENTION_CODES[zero_convention]
        out = torch.zeros(n, 8, dtype=torch.float64)
        for tile in range(n // 16):
            for chunk in range(k // 64):
                group = chunk * 64 // group_size
                a, b = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
                for step in range(4):
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        if layout == WORDS_ALONG_K:  # rows g, g + 8; a load: one row's words 2t, 2t + 1
                            rows = (16 * tile + g, 16 * tile + g + 8)
                            first = rows[0] * (k // 8) + 8 * chunk + 2 * t
                            p, q = flat[first: first + 2], flat[first + k: first + k + 2]
                            word = {(0, 0): p[0], (1, 0): q[0], (0, 1): p[1], (1, 1): q[1]}  # (row h, word 2t + i)
                            scale_at = [rows[0] * groups + group, rows[0] * groups + group + 8 * groups]
                            zero_at = [(rows[0] >> 3) * groups + group, (rows[0] >> 3) * groups + group + groups]
                            shifts = [4 * (rows[0] & 7)] * 2
                        else:  # rows 2g, 2g + 1; a load: word row 2t (then 2t + 1) of both rows
                            rows = (16 * tile + 2 * g, 16 * tile + 2 * g + 1)
                            first = (8 * chunk + 2 * t) * n + rows[0]
                            p, q = flat[first: first + 2], flat[first + n: first + n + 2]
                            word = {(0, 0): p[0], (1, 0): p[1], (0, 1): q[0], (1, 1): q[1]}
                            scale_at = [group * n + rows[0], group * n + rows[0] + 1]
                            zero_at = [group * (n // 8) + (rows[0] >> 3)] * 2
                            shifts = [4 * (rows[0] & 7), 4 * (rows[0] & 7) + 4]
                        for h in range(2):  # A-row g + 8 h
                            u = 0 if zero_flat is None else (int(zero_flat[zero_at[h]]) & 0xFFFFFFFF) >> shifts[h]
                            z = {0: 8, 1: u & 0xF, 2: (u & 0xF) + 1, 3: (u + 1) & 0xF}[code]
                            s = scale_flat[scale_at[h]].double()
                            for i in range(2):  # word 2t + i: slots 2t + 8 i and + 1 hold its nibbles step, step + 4
                                w = int(word[h, i]) & 0xFFFFFFFF
                                for e, slot in ((step, 2 * t + 8 * i), (step + 4, 2 * t + 8 * i + 1)):
                                    value = ((w >> (4 * e)) & 0xF) - z
                                    a[g + 8 * h, slot] = float((value * s).to(torch.bfloat16))
                        for i in range(2):  # B: (x[16 t + 8 i + step], x[.. + 4]), after the prmt
                            for e, slot in ((step, 2 * t + 8 * i), (step + 4, 2 * t + 8 * i + 1)):
                                b[slot, g] = columns[64 * chunk + 16 * t + 8 * i + e, g]
                    product = a @ b
                    for h in range(2):
                        for g in range(8):
                            out[16 * tile + (g if layout == WORDS_ALONG_K else 2 * g) + (8 * h if layout == WORDS_ALONG_K else h)] += product[g + 8 * h]
                    a.zero_(), b.zero_()
        outs.append(out[:, :m].t())
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("layout", [1, 2], ids=["words-along-k", "words-along-n"])
@pytest.mark.parametrize("zero_convention", [None, "stored", "plus_one", "plus_one_mod_16"])
def test_the_lanes_read_eagers_linear_from_the_checkpoints_words(layout, zero_convention):
    generator = torch.Generator().manual_seed(layout)
    k, group_size, m = 128, 64, 3
    members = [checkpoint_tensors(n, k, group_size, layout, zero_convention is not None, generator) for n in (16, 32)]
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    expected = torch.cat([x.double() @ eager_int4(*member, group_size, zero_convention).double().t()
                          for member in members], dim=1)
    torch.testing.assert_close(emulated_checkpoint_mma(x, members, group_size, zero_convention, layout), expected,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change, reason", [
    ("", ""), ("shifts", "nibbles at shifts"), ("int8", "int8 storage"), ("float32", "scales of torch.float32"),
    ("n=24", "a member's N is not a multiple of 16"), ("mixed", "words, scales and zero points not all"),
    ("group=32", "groups of 32"),
])
def test_what_the_kernel_reads_in_place(change, reason, monkeypatch):
    """On a CUDA device (the check's first question, answered yes here), the layouts it reads and what it repacks."""
    from qfuse.kernels.cuda import int4_mma

    generator = torch.Generator().manual_seed(0)
    packed, scales, zeros = checkpoint_tensors(32, 256, 128, 1, True, generator)
    shifts, group_size = None, 128
    if change == "shifts":
        shifts = torch.arange(28, -4, -4, dtype=torch.int32)
    if change == "int8":
        packed = torch.zeros(32, 256, dtype=torch.int8)
    if change == "float32":
        scales = scales.float()
    if change == "n=24":
        packed, scales, zeros = packed[:24], scales[:24], zeros[:3]
    if change == "mixed":
        scales = scales.t().contiguous().t()
    if change == "group=32":
        group_size, scales = 32, torch.ones(32, 8, dtype=torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda tensor: torch.device("cuda")))
    assert int4_mma.why_not_checkpoint([(packed, shifts, scales, zeros)], group_size).startswith(reason)



@GPU
@pytest.mark.parametrize("layout", [1, 2], ids=["words-along-k", "words-along-n"])
@pytest.mark.parametrize("zero_convention, dtype, group_size, bias, out_f32", [
    (None, torch.bfloat16, 128, False, False), ("stored", torch.bfloat16, 64, True, False),
    ("plus_one", torch.float16, 256, False, True), ("plus_one_mod_16", torch.float16, 1024, True, False)],
    ids=["bf16-g128", "bf16-stored-g64-bias", "fp16-plus-one-g256-f32", "fp16-plus-one-mod-16-per-channel-bias"])
@pytest.mark.parametrize("widths", [(272,), (64, 16, 48)], ids=["one", "siblings"])
def test_on_the_gpu_the_checkpoints_words_give_eagers_linear(layout, zero_convention, dtype, group_size, bias,
                                                             out_f32, widths):
    """Read in place: every number of 8-column tiles of B and two launches past 64 rows, one weight or three siblings
    side by side; within two roundings of the output dtype of the float product with eager's weight."""
    from qfuse.kernels import get_kernel
    from qfuse.kernels.cuda.int4_mma import CHECKPOINT_PACKINGS

    generator = torch.Generator().manual_seed(layout)
    k = 1024
    members = [checkpoint_tensors(n, k, group_size, layout, zero_convention is not None, generator, "cuda")
               for n in widths]
    members = [(packed, scales.to(dtype), zeros) for packed, scales, zeros in members]
    cuda = get_kernel("cuda")
    weight = cuda.int4_checkpoint_weight([(p, None, s, z) for p, s, z in members], group_size,
                                         zero_convention or "stored")
    assert weight is not None and weight.packing == CHECKPOINT_PACKINGS[dtype]
    w = torch.cat([eager_int4(*member, group_size, zero_convention, dtype) for member in members])  # [N, K]
    n = w.shape[0]
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    out_dtype = torch.float32 if out_f32 else dtype
    for m in (1, 5, 16, 17, 33, 64, 70):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        out = cuda.weight_only_apply(x, weight, b, out_dtype)
        expected = x.double() @ w.double().t() + (0 if b is None else b.double())
        assert out.dtype == out_dtype and out.shape == (m, n)
        assert (out.double() - expected).abs().max().item() <= 2 * ROUNDING[out_dtype] * expected.abs().max().item(), m


@GPU
@pytest.mark.parametrize("layout", [1, 2], ids=["compressed-tensors", "autogptq"])
def test_on_the_gpu_a_checkpoint_weight_takes_no_memory_and_a_reload_in_place_is_read(layout):
    """Prepared in place, the weight is a table of addresses, not a copy: a few hundred bytes; a new checkpoint
    copied into the weight's tensors is what the next call multiplies."""
    from qfuse.ops.int4_weight_only import int4_product, prepared_int4_weight

    generator = torch.Generator().manual_seed(0)
    n, k = 4096, 4096
    packed, scales, _ = checkpoint_tensors(n, k, 128, layout, False, generator, "cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)

    def product():
        kernel, prepared = prepared_int4_weight("cuda", packed, None, scales, None, 128, in_place=True)
        return prepared, int4_product(kernel, x, prepared, None, torch.bfloat16)

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    prepared, out = product()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before <= 4096 + out.numel() * 2
    assert prepared.packing == "int4_checkpoint_bf16" and prepared.data.numel() == 4
    new_packed, new_scales, _ = checkpoint_tensors(n, k, 128, layout, False, generator, "cuda")
    packed.copy_(new_packed), scales.copy_(new_scales)
    _, out = product()
    expected = x.double() @ eager_int4(new_packed, new_scales, None, 128, None).double().t()
    assert (out.double() - expected).abs().max().item() <= 2 * ROUNDING[torch.bfloat16] * expected.abs().max().item()
