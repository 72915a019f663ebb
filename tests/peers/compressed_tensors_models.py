"""Peer models: small models quantized with compressed-tensors (0.20), the way an llm-compressor /
vLLM checkpoint describes them, on CPU.

compressed-tensors attaches a `QuantizationScheme` to each targeted `nn.Linear`, registers its
qparams (`weight_scale [N, 1]` or `[1]`, `weight_zero_point`, `input_scale`, ...) and replaces the
module's `forward` with a wrapper that fake-quantizes (quantize -> dequantize, all in float) the
input and, unless the weight is already compressed/decompressed, the weight; then it runs
`nn.Linear.forward` inside `patch_attr(weight, "data", fake_quantized_weight)`. Under
torch.compile that context manager is an unresumable graph break (`object()` in `patch_attr`), so
the matmul of every wrapped linear runs eagerly, outside any compiled graph.

Schemes (`SCHEMES`):
- "W8A8": preset W8A8 = int8 per-channel symmetric weights, int8 dynamic per-token activations.
  (compressed-tensors' "token" strategy reduces over every dim except 0 and 1: a 2-D `[M, K]`
  input gets ONE scale for the whole tensor; a 3-D `[B, S, K]` input gets a scale per token.)
- "W8A8_STATIC": int8 per-channel weights, int8 static per-tensor activations (calibrated here).
- "FP8_DYNAMIC": preset = fp8 e4m3 per-channel weights, fp8 dynamic per-token activations.
- "FP8": preset = fp8 per-tensor weights, fp8 static per-tensor activations (calibrated here).

States (`STATES`), what the model holds when it is compiled:
- "qdq": status FROZEN, float weights; every forward fake-quantizes the weight and the input
  (the state after calibration, before saving).
- "compressed": `ModelCompressor.compress_model`: the weight parameter holds int8 / fp8 values
  (the form a checkpoint stores) and the model has a forward pre-hook that decompresses the
  whole model on the first forward (0.20 has no compressed-weight forward: `CompressedLinear`
  raises).
- "decompressed": compressed then `decompress_model`: status DECOMPRESSED, the weight is the
  dequantized float weight (`w_q.to(float) * weight_scale`), only the input is fake-quantized.
  This is the state a transformers `from_pretrained` of a compressed-tensors checkpoint runs in.
  `decompress_model` also goes through `from_accelerate`, which puts every module under
  compressed-tensors' offloading (`module._parameters` becomes an offload cache whose
  `__getitem__` "onloads" the tensor through `send_tensors`): each parameter access is a further
  graph break ("Data pointer comparison", `offload/utils.py:46`).

`compile_friendly=True` is what a user can do today to get one graph: remove the offload
dispatch (`compressed_tensors.offload.remove_dispatch`) and replace each wrapper by a forward with
the same math and no `patch_attr` (see `compile_friendly_forward`). The graph then holds float
fake quant and a float `addmm`. `ct_llama_as_reference()` shows the other way out: replace the
compressed-tensors linears by plain-torch int8 linears (`to_reference_w8a8`).

Builders return `(model, example_input)`. `available()` says whether compressed-tensors imports.
This module does not import qfuse. Seeded: two calls build the same model.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F

SCHEMES = ("W8A8", "W8A8_STATIC", "FP8_DYNAMIC", "FP8")
STATES = ("qdq", "compressed", "decompressed")


def available() -> tuple[bool, str]:
    """(True, version) when compressed-tensors imports; otherwise (False, why not)."""
    try:
        import compressed_tensors
        from compressed_tensors.compressors import ModelCompressor  # noqa: F401
        from compressed_tensors.quantization import apply_quantization_config  # noqa: F401
    except Exception as error:  # any import failure means "not available", with its reason
        return False, f"compressed-tensors does not import: {type(error).__name__}: {error}"
    return True, f"compressed-tensors {compressed_tensors.__version__}"


def quantization_scheme(name: str, targets=("Linear",)):
    """The `QuantizationScheme` for one of `SCHEMES`."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    if name == "W8A8_STATIC":
        weights = preset_name_to_scheme("W8A8", list(targets)).weights
        activations = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False)
        return QuantizationScheme(targets=list(targets), weights=weights, input_activations=activations)
    if name not in SCHEMES:
        raise ValueError(f"unknown scheme {name!r}; choose one of {SCHEMES}")
    return preset_name_to_scheme(name, list(targets))


def _quant_max(args) -> float:
    return 127.0 if args.type == "int" else torch.finfo(torch.float8_e4m3fn).max


def _calibrate(model: nn.Module, calibration_inputs) -> None:
    """Fill the qparams compressed-tensors left empty: weight scales from the weight's absolute
    max (per channel or per tensor, following the registered scale's shape), static input scales
    from the absolute max seen on `calibration_inputs`. Zero points stay zero (symmetric)."""
    quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    for module in quantized:
        weight = module.weight.detach().float()
        qmax = _quant_max(module.quantization_scheme.weights)
        if module.weight_scale.shape[0] == weight.shape[0]:
            amax = weight.abs().amax(dim=1, keepdim=True)
        else:
            amax = weight.abs().amax().reshape(module.weight_scale.shape)
        module.weight_scale.data.copy_((amax / qmax).clamp(min=1e-8))

    static = [m for m in quantized if m.quantization_scheme.input_activations is not None
              and not m.quantization_scheme.input_activations.dynamic]
    if not static:
        return
    seen: dict[nn.Module, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(
        lambda m, args: seen.__setitem__(m, torch.maximum(seen.get(m, torch.zeros(())), args[0].detach().abs().amax().float())))
        for m in static]
    for m in quantized:
        m.quantization_enabled = False  # calibrate on float activations
    with torch.no_grad():
        for example in calibration_inputs:
            model(example)
    for hook in hooks:
        hook.remove()
    for m in quantized:
        m.quantization_enabled = True
    for module in static:
        qmax = _quant_max(module.quantization_scheme.input_activations)
        module.input_scale.data.copy_((seen[module] / qmax).clamp(min=1e-8).reshape(module.input_scale.shape))


def compile_friendly_forward(module: nn.Linear):
    """Replace compressed-tensors' forward wrapper of `module` by one with the same math and no
    `patch_attr` (so no graph break): fake-quantize the input, fake-quantize the weight unless it
    is already compressed/decompressed, then `F.linear`. Uses compressed-tensors' own
    `forward_quantize`, so the ops in the graph are exactly the library's."""
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        scheme = self.quantization_scheme
        weight = self.weight
        if scheme.input_activations is not None:
            input = forward_quantize(self, input, "input", scheme.input_activations)
        if scheme.weights is not None and self.quantization_status < QuantizationStatus.COMPRESSED:
            weight = forward_quantize(self, weight, "weight", scheme.weights)
        return F.linear(input, weight, self.bias)

    module.forward = types.MethodType(forward, module)


def quantize_model(model: nn.Module, scheme: str, state: str, calibration_inputs, ignore=(),
                   compile_friendly: bool = False) -> nn.Module:
    """Apply `scheme` to every `nn.Linear` of `model` (but `ignore`), calibrate, and bring the
    model into `state` (see the module docstring). In place; returns `model`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    if state not in STATES:
        raise ValueError(f"unknown state {state!r}; choose one of {STATES}")
    config = QuantizationConfig(config_groups={"group_0": quantization_scheme(scheme)},
                                ignore=list(ignore), quantization_status="frozen")
    apply_quantization_config(model, config, show_progress=False)
    _calibrate(model, calibration_inputs)
    if state in ("compressed", "decompressed"):
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        if state == "decompressed":
            compressor.decompress_model(model)
    if compile_friendly:
        from compressed_tensors.offload import remove_dispatch

        remove_dispatch(model)
        for module in model.modules():
            if getattr(module, "quantization_scheme", None) is not None and isinstance(module, nn.Linear):
                compile_friendly_forward(module)
    return model


def ct_mlp(scheme: str = "W8A8", state: str = "qdq", compile_friendly: bool = False, tokens: int = 16,
           in_features: int = 64, hidden: int = 128, out: int = 64, three_d: bool = False, seed: int = 0):
    """Linear-ReLU-Linear (bias) quantized with `scheme` in `state`. Input `[tokens, in]`, or
    `[2, tokens, in]` with `three_d` (there the "token" strategy is really per token)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out)).eval()
    shape = (2, tokens, in_features) if three_d else (tokens, in_features)
    calibration = [torch.randn(shape, generator=generator) for _ in range(4)]
    quantize_model(model, scheme, state, calibration, compile_friendly=compile_friendly)
    return model, torch.randn(shape, generator=generator)


def ct_llama(scheme: str = "W8A8", state: str = "qdq", compile_friendly: bool = False, seq: int = 8, seed: int = 0):
    """The tiny `LlamaForCausalLM` of `tests/peers/hf_llama.py` with every decoder linear
    (q/k/v/o/gate/up/down; not lm_head) quantized with `scheme` in `state`. Input: `[1, seq]` ids."""
    from tests.peers.hf_llama import tiny_llama

    model, input_ids = tiny_llama(seq=seq, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    calibration = [torch.randint(0, model.config.vocab_size, input_ids.shape, generator=generator) for _ in range(4)]
    quantize_model(model, scheme, state, calibration, ignore=("lm_head",), compile_friendly=compile_friendly)
    return model, input_ids


def to_reference_w8a8(model: nn.Module) -> int:
    """Replace every compressed-tensors int8 per-channel linear of `model` by
    `tests.peers.hf_llama.ReferenceW8A8Linear` (int8 weight, `torch._int_mm`, dynamic per-token
    activations): the other thing a user can do today, and the one that runs an int8 GEMM. The
    int8 weight is recovered exactly as `round(weight / weight_scale)` (the weight of a FROZEN or
    DECOMPRESSED module lies on that grid after fake quant). Note the activation scale differs
    slightly from compressed-tensors' (`amax / 127` per token instead of `amax / 127.5`, and per
    token also for 2-D inputs). Returns how many linears were replaced."""
    from compressed_tensors.offload import remove_dispatch
    from compressed_tensors.quantization import QuantizationStatus

    from tests.peers.hf_llama import ReferenceW8A8Linear

    remove_dispatch(model)
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            scheme = getattr(child, "quantization_scheme", None)
            if not isinstance(child, nn.Linear) or scheme is None or scheme.weights is None:
                continue
            if scheme.weights.type != "int" or scheme.weights.num_bits != 8 or scheme.weights.strategy != "channel":
                continue
            scale = child.weight_scale.detach().float().reshape(-1)
            weight = child.weight.detach().float()
            if child.quantization_status < QuantizationStatus.COMPRESSED or weight.dtype != torch.int8:
                weight = torch.round(weight / scale[:, None]).clamp(-128, 127)
            bias = None if child.bias is None else child.bias.detach().clone()
            setattr(parent, child_name, ReferenceW8A8Linear(weight.to(torch.int8), scale, bias))
            replaced += 1
    return replaced


def ct_llama_as_reference(seq: int = 8, seed: int = 0):
    """The W8A8 compressed-tensors tiny Llama in the DECOMPRESSED state (a loaded checkpoint),
    converted by `to_reference_w8a8`: 14 `ReferenceW8A8Linear`s."""
    model, input_ids = ct_llama("W8A8", "decompressed", seq=seq, seed=seed)
    count = to_reference_w8a8(model)
    assert count == 7 * model.config.num_hidden_layers, count
    return model, input_ids
