"""Peer models: small MLPs quantized the way a torchao user would quantize them, on CPU.

Each builder returns `(model, example_input)`; the model is ready for `torch.compile`. They exist
so qfuse can be tested against what other tools really emit, not against hand-written imitations:

- `pt2e_x86_mlp(dynamic)`: Linear-ReLU-Linear exported with `torch.export`, prepared and converted
  with torchao's PT2E flow and `X86InductorQuantizer` (static: per-tensor uint8 activations with
  a calibrated zero point; dynamic: per-tensor activation qparams chosen at run time), int8
  per-channel symmetric weights. The result is a GraphModule of `quantized_decomposed` Q/DQ ops.
- `torchao_int8_dynamic_mlp(dtype)`: `quantize_(model, Int8DynamicActivationInt8WeightConfig())`,
  int8 per-token symmetric activations and int8 per-channel weights (torchao's `Int8Tensor`).
- `torchao_int8_weight_only_mlp(dtype)`: `quantize_(model, Int8WeightOnlyConfig())`, W8A16/W8A32.
- `torchao_mlp("intx_int4_weight_only")` / `torchao_mlp("int8_dynamic_intx_int4")`: torchao's int4
  configs that run on a CPU (torchao 0.18's `Int4WeightOnlyConfig` packs for CUDA / XPU kernels
  only): `IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))` and
  `Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4)` ("8da4w": dynamic asymmetric
  per-token int8 activations). Both store the int4 values unpacked in int8 with a scale and a zero
  point per group of 32 input channels (`IntxUnpackedToInt8Tensor`), dequantized in the graph.

Every builder takes `batch`: `batch=B` makes the input `[B, tokens, in_features]` (the graph then
reshapes around each matmul). `available()` says whether torchao can be imported (a test can skip on its reason). This module
does not import qfuse: it only builds models. Inputs are seeded, so two calls build the same model.
Note: torchao's configs with `set_inductor_config=True` (the default) change global Inductor
settings when applied; the builders pass `set_inductor_config=False` unless asked otherwise, so
building a model has no side effect on other compiles.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def available() -> tuple[bool, str]:
    """(True, version) when torchao and its PT2E quantizer import; otherwise (False, why not)."""
    try:
        import torchao
        from torchao.quantization import quantize_  # noqa: F401
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e  # noqa: F401
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import X86InductorQuantizer  # noqa: F401
    except Exception as error:  # an import failure of any kind means "not available", with its reason
        return False, f"torchao does not import: {type(error).__name__}: {error}"
    return True, f"torchao {torchao.__version__}"


def _mlp(in_features: int, hidden: int, out: int, bias: bool, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(in_features, hidden, bias=bias),
        nn.ReLU(),
        nn.Linear(hidden, out, bias=bias),
    ).to(dtype).eval()


def pt2e_x86_mlp(
    dynamic: bool,
    in_features: int = 64,
    hidden: int = 128,
    out: int = 64,
    tokens: int = 16,
    bias: bool = True,
    seed: int = 0,
    calibration_batches: int = 4,
    batch: int | None = None,
):
    """A float MLP quantized through torchao's PT2E flow with `X86InductorQuantizer`.

    Export (`torch.export.export(...).module()`), `prepare_pt2e` with the default x86 config
    (`is_dynamic=dynamic`), a few seeded calibration batches, `convert_pt2e`. Returns the converted
    GraphModule and a `[tokens, in_features]` fp32 input (`[batch, tokens, in_features]` when
    `batch` is given: the graph then reshapes around each matmul).
    """
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _mlp(in_features, hidden, out, bias)
    shape = (tokens, in_features) if batch is None else (batch, tokens, in_features)
    example = torch.randn(*shape, generator=generator)
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config(is_dynamic=dynamic))
    with torch.no_grad():
        exported = torch.export.export(model, (example,)).module()
        prepared = prepare_pt2e(exported, quantizer)
        for _ in range(calibration_batches):
            prepared(torch.randn(*shape, generator=generator))
        converted = convert_pt2e(prepared)
    return converted, example


def _config(name: str, set_inductor_config: bool):
    """The `quantize_` config a builder applies, by short name."""
    import torchao.quantization as quantization

    if name.startswith("float8_dynamic_"):  # fp8 needs a GPU with fp8 tensor cores (capability >= 8.9)
        granularity = quantization.PerRow() if name.endswith("rowwise") else quantization.PerTensor()
        return quantization.Float8DynamicActivationFloat8WeightConfig(
            granularity=granularity, set_inductor_config=set_inductor_config)
    if name in INTX_INT4:
        config_class, granularity_argument = INTX_INT4[name]
        return getattr(quantization, config_class)(weight_dtype=torch.int4,
                                                   **{granularity_argument: quantization.PerGroup(INTX_GROUP)})
    return getattr(quantization, CONFIGS[name])(set_inductor_config=set_inductor_config)


CONFIGS = {"int8_dynamic": "Int8DynamicActivationInt8WeightConfig", "int8_weight_only": "Int8WeightOnlyConfig",
           "float8_dynamic_rowwise": "Float8DynamicActivationFloat8WeightConfig (PerRow)",
           "float8_dynamic_tensorwise": "Float8DynamicActivationFloat8WeightConfig (PerTensor)",
           "intx_int4_weight_only": "IntxWeightOnlyConfig (int4, groups of 32)",
           "int8_dynamic_intx_int4": "Int8DynamicActivationIntxWeightConfig (int4, groups of 32)"}
INTX_GROUP = 32
#: the int4 "intx" configs: (config class, the name of its weight granularity argument)
INTX_INT4 = {"intx_int4_weight_only": ("IntxWeightOnlyConfig", "granularity"),
             "int8_dynamic_intx_int4": ("Int8DynamicActivationIntxWeightConfig", "weight_granularity")}


def torchao_mlp(
    config: str,
    dtype: torch.dtype = torch.float32,
    in_features: int = 64,
    hidden: int = 128,
    out: int = 64,
    tokens: int = 16,
    bias: bool = True,
    seed: int = 0,
    set_inductor_config: bool = False,
    batch: int | None = None,
    device: str = "cpu",
):
    """An MLP (fp32 or bf16) after `quantize_(model, <CONFIGS[config]>)`, and its input."""
    from torchao.quantization import quantize_

    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _mlp(in_features, hidden, out, bias, dtype).to(device)
    quantize_(model, _config(config, set_inductor_config))
    shape = (tokens, in_features) if batch is None else (batch, tokens, in_features)
    example = torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)
    return model, example


torchao_int8_dynamic_mlp = functools.partial(torchao_mlp, "int8_dynamic")
torchao_int8_weight_only_mlp = functools.partial(torchao_mlp, "int8_weight_only")
