"""A compiled model's prepared weights over its life (issue #41, items 4 and 5), for every kernel
that prepares a weight and runs on this machine, forced through `options={"kernel": ...}`:
- models of the same shapes compiled, run and dropped in turn free their prepared weights;
- a checkpoint loaded in place is used on the next call after `qfuse.refresh_weights(model)`, in
  default mode and under CUDA graphs (GPU), prepared again into the same memory on the GPU;
- two threads on one compiled model get eager's results, each weight prepared once.
On the CPU in CI; the CUDA cases run on the GPU machine (docs/testing.md)."""

import gc
import os
import threading
import time
import weakref

import pytest
import torch

import qfuse
from qfuse.kernels import get_kernel
from qfuse.kernels import prepared
from qfuse.kernels.prepared import prepared_weights
from qfuse.kernels.registry import KERNELS, priority_list
from qfuse.platform import current_platform
from tests.helpers import assert_close_to_eager, eager_on_cpu
from tests.peers.hf_llama import ReferenceW8A8Linear
from tests.peers.vllm_fallbacks import VllmFp8Linear
from tests.peers.weight_only_models import gptq_packed_int4, hand_written_int8

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
FP8_CAPABLE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def int4_gptq(seed, device):
    return gptq_packed_int4(torch.bfloat16, group_size=64, seed=seed)  # the cuda kernel's groups: multiples of 64


def int8_w8a8(seed, device):
    linear = torch.nn.Linear(256, 128)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        linear.weight.copy_(torch.randn(128, 256, generator=generator) / 16)
        linear.bias.copy_(torch.randn(128, generator=generator))
    return ReferenceW8A8Linear.from_linear(linear)


def fp8_w8a8(seed, device):
    if device != "cuda" or not FP8_CAPABLE:
        pytest.skip("fp8 runs on a GPU of capability 8.9 or more")
    return VllmFp8Linear(256, 128, "row_wise", seed=seed)


def int8_weight_only(seed, device):
    return hand_written_int8(torch.bfloat16, scale_after_matmul=True, in_features=256, seed=seed)


#: form -> (builder, the activation dtype on CPU, on CUDA)
FORMS = {
    "int4_gptq": (int4_gptq, torch.bfloat16, torch.bfloat16),
    "int8_w8a8": (int8_w8a8, torch.float32, torch.bfloat16),
    "fp8_w8a8": (fp8_w8a8, torch.float32, torch.bfloat16),
    "int8_weight_only": (int8_weight_only, torch.bfloat16, torch.bfloat16),
}
PREPARING = [name for name in KERNELS if name != "reference"]


def build(form, seed, device):
    builder, cpu_dtype, cuda_dtype = FORMS[form]
    model = builder(seed, device).to(device).eval()
    dtype = cuda_dtype if device == "cuda" else cpu_dtype
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(seed + 7)).to(device=device, dtype=dtype)
    return model, x


def eager(model):
    """The model run eagerly: on the CPU for int8 W8A8 on CUDA, where eager `_int_mm` refuses M <= 16."""
    def run(x):
        return eager_on_cpu(model, x) if x.is_cuda and isinstance(model, ReferenceW8A8Linear) else model(x)
    return run


def compiled_or_skip(model, x, kernel, mode=None):
    """`model` compiled with `kernel` forced (and `mode`) and run once: (compiled, its output, the weights
    it prepared), or a skip where the kernel cannot take this form here or prepares nothing for it."""
    if kernel not in priority_list(current_platform(x.device.type)):
        pytest.skip(f"{kernel} does not run on {x.device.type}")
    supported, reason = get_kernel(kernel).is_supported(current_platform(x.device.type))
    if not supported:
        pytest.skip(f"{kernel} does not run here: {reason}")
    if mode is None:
        compiled = torch.compile(model, backend="qfuse", options={"kernel": kernel})
    else:  # with a mode, qfuse's settings come from the environment
        os.environ["QFUSE_KERNEL"] = kernel
        compiled = torch.compile(model, backend="qfuse", mode=mode)
    before = {id(weight.data) for weight in prepared_weights()}
    try:
        with torch.no_grad():
            out = compiled(x)
    except Exception as error:  # noqa: BLE001 (Inductor wraps the documented refusal of a forced kernel)
        if "KernelUnavailableError" not in str(error):
            raise
        pytest.skip(f"{kernel} cannot take this form: {error}")
    finally:
        os.environ.pop("QFUSE_KERNEL", None)
    made = [weight for weight in prepared_weights() if id(weight.data) not in before]
    if not made:
        pytest.skip(f"{kernel} prepares no weight for this form")
    return compiled, out, made


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", PREPARING)
@pytest.mark.parametrize("form", FORMS)
def test_models_dropped_in_turn_free_their_prepared_weights(form, kernel, device):
    allocated = []
    for seed in range(3):
        model, x = build(form, seed, device)
        compiled, out, made = compiled_or_skip(model, x, kernel)
        assert_close_to_eager(out, eager(model), x)
        alive = [weakref.ref(weight.data) for weight in made]
        del model, compiled, out, made
        gc.collect()  # a full collection drops the entries of freed weights
        assert all(reference() is None for reference in alive), f"a dropped model's prepared weight lives on ({seed})"
        if device == "cuda":
            allocated.append(torch.cuda.memory_allocated())
    assert len(set(allocated)) <= 1, f"GPU memory grows from model to model: {allocated}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", PREPARING)
@pytest.mark.parametrize("form", FORMS)
def test_a_checkpoint_loaded_in_place_is_used_on_the_next_call(form, kernel, device):
    model, x = build(form, 0, device)
    compiled, first, made = compiled_or_skip(model, x, kernel)
    pointers, count = sorted(weight.data.data_ptr() for weight in made), len(prepared_weights())
    model.load_state_dict(build(form, 1, device)[0].state_dict())
    assert qfuse.refresh_weights(compiled) == len(made)
    with torch.no_grad():
        out = compiled(x)
    assert_close_to_eager(out, eager(model), x)
    assert not torch.allclose(out.float(), first.float())
    assert len(prepared_weights()) == count, "a reload kept the old prepared weight beside the new one"
    if device == "cuda":  # prepared again in the same memory: what a captured CUDA graph reads
        assert sorted(weight.data.data_ptr() for weight in prepared_weights()
                      if weight.data.data_ptr() in pointers) == pointers


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", PREPARING)
@pytest.mark.parametrize("form", FORMS)
def test_two_threads_on_one_compiled_model(form, kernel, device, monkeypatch):
    model, x = build(form, 0, device)
    compiled, _, _ = compiled_or_skip(model, x, kernel)
    monkeypatch.setattr(prepared, "_CACHE", {})  # nothing prepared: both threads' first call prepares
    monkeypatch.setattr(prepared, "_RECENT", {})  # (nor found by the tensors' identity)
    builds = []
    implementation = get_kernel(kernel)
    for method in ("prepare_weight", "prepare_int4_weight"):
        original = getattr(implementation, method)

        def slow(*args, _original=original):
            builds.append(1)
            time.sleep(0.2)  # long enough for the other thread to ask meanwhile
            return _original(*args)

        monkeypatch.setattr(implementation, method, slow)
    start, outputs, errors = threading.Barrier(2), [], []

    def decode():
        try:
            start.wait()
            with torch.no_grad():
                outputs.extend(compiled(x) for _ in range(3))
        except Exception as error:  # noqa: BLE001 (reported by the main thread)
            errors.append(error)

    threads = [threading.Thread(target=decode) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(builds) == 1, f"the weight was prepared {len(builds)} times"
    for out in outputs:
        assert_close_to_eager(out, eager(model), x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kernel", PREPARING)
@pytest.mark.parametrize("form", FORMS)
def test_refresh_weights_makes_a_cuda_graph_replay_use_a_reloaded_checkpoint(form, kernel):
    model, x = build(form, 0, "cuda")
    compiled, _, made = compiled_or_skip(model, x, kernel, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(2):  # capture, replay
            compiled(x)
        model.load_state_dict(build(form, 1, "cuda")[0].state_dict())
        assert qfuse.refresh_weights(compiled) == len(made)
        out = compiled(x).clone()
    assert_close_to_eager(out, eager(model), x)
