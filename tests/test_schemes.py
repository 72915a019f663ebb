"""Tests for `qfuse.schemes`: QuantScheme validation, describe(), and the quant-range helpers."""

import dataclasses

import pytest
import torch

from qfuse.schemes import (
    FP8_DTYPE,
    INT4_DTYPE,
    Granularity,
    QuantScheme,
    dtype_name,
    quant_range,
    symmetric_quant_max,
)

G = Granularity


@pytest.mark.parametrize(
    "scheme, label",
    [
        (QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True), "int8 dyn-token x per-channel"),
        (QuantScheme(torch.int8, torch.int8, G.PER_TENSOR, G.PER_TENSOR, dynamic=False),
         "int8 static-tensor x per-tensor"),
        (QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_GROUP, G.BLOCK, dynamic=True), "fp8 dyn-group x block"),
        (QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TENSOR, G.PER_CHANNEL, dynamic=False),
         "fp8 static-tensor x per-channel"),
        (QuantScheme(torch.uint8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True, symmetric=False),
         "uint8 dyn-token asym x per-channel"),
        (QuantScheme(torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, dynamic=True, weight_group_size=128),
         "int8 dyn-token x int4 per-group-128"),
        (QuantScheme(torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True),
         "int8 dyn-token x int4 per-channel"),
        (QuantScheme(torch.int8, torch.int8, G.PER_TENSOR, G.PER_TENSOR, dynamic=False, symmetric=False),
         "int8 static-tensor asym x per-tensor"),
        (QuantScheme.weight_only(FP8_DTYPE, G.BLOCK), "bf16 x fp8 block (weight-only)"),
        (QuantScheme.weight_only(torch.int8, G.PER_CHANNEL, torch.float32), "fp32 x int8 per-channel (weight-only)"),
    ],
)
def test_describe(scheme, label):
    assert scheme.describe() == label


@pytest.mark.parametrize(
    "fields, message",
    [
        ((torch.int32, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, True), "activation dtype torch.int32 is not supported"),
        ((torch.float64, FP8_DTYPE, G.PER_TENSOR, G.BLOCK, False), "activation dtype torch.float64 is not supported"),
        ((torch.bfloat16, FP8_DTYPE, G.PER_TOKEN, G.BLOCK, False), "weight-only scheme .* has no activation scale"),
        ((torch.bfloat16, FP8_DTYPE, G.PER_TENSOR, G.BLOCK, True), "weight-only scheme .* has no activation scale"),
        ((torch.bfloat16, FP8_DTYPE, G.PER_TENSOR, G.BLOCK, False, False), "weight-only scheme .* no activation scale"),
        ((torch.bfloat16, torch.uint8, G.PER_TENSOR, G.PER_CHANNEL, False), "uint8 weights are not supported"),
        ((torch.float32, torch.uint8, G.PER_TENSOR, G.PER_CHANNEL, False), "uint8 weights are not supported"),
        ((torch.int8, torch.int32, G.PER_TOKEN, G.PER_CHANNEL, True), "weight dtype torch.int32 is not supported"),
        ((torch.int8, torch.int8, G.PER_CHANNEL, G.PER_CHANNEL, True), "activation granularity"),
        ((torch.int8, torch.int8, G.BLOCK, G.PER_CHANNEL, True), "activation granularity"),
        ((torch.int8, torch.int8, G.PER_TOKEN, G.PER_TOKEN, True), "weight granularity"),
        ((torch.int8, torch.int8, G.PER_TOKEN, G.PER_GROUP, True), "per-group weight scales are supported for int4"),
        ((torch.int8, torch.int8, G.PER_TOKEN, G.PER_GROUP, True, True, 128), "for int4 weights only"),
        ((torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, True), "weight_group_size is required by"),
        ((torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, True, True, 128), "only allowed with, per-group"),
        ((torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, True, True, 0), "must be a positive int, got 0"),
        ((torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, True, True, 64.0), "must be a positive int, got 64.0"),
        ((INT4_DTYPE, INT4_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, True), "activation dtype torch.int4 is not supported"),
        ((FP8_DTYPE, INT4_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, True), "both be fp8 or both be integer"),
        ((torch.int8, torch.uint8, G.PER_TOKEN, G.PER_CHANNEL, True, False), "uint8 weights are not supported"),
        ((torch.int8, FP8_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, True), "both be fp8 or both be integer"),
        ((FP8_DTYPE, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, True), "both be fp8 or both be integer"),
        ((FP8_DTYPE, FP8_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, True, False), "fp8 activations are symmetric only"),
        ((torch.uint8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, True), r"uint8 activations need a zero point"),
    ],
)
def test_invalid_schemes_raise_value_error(fields, message):
    with pytest.raises(ValueError, match=message):
        QuantScheme(*fields)


def test_granularity_errors_name_the_valid_choices():
    with pytest.raises(ValueError) as raised:
        QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_TOKEN, True)
    assert "['per_tensor', 'per_channel', 'block', 'per_group']" in str(raised.value)


def test_scheme_is_a_frozen_hashable_key():
    first = QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True)
    second = QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, dynamic=True)
    assert first == second and hash(first) == hash(second)
    assert first != dataclasses.replace(first, dynamic=False)
    assert {first: "x"}[second] == "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.dynamic = False
    assert first.symmetric is True


def test_is_fp8():
    assert QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_TOKEN, G.PER_CHANNEL, True).is_fp8
    assert not QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, True).is_fp8
    assert QuantScheme.weight_only(FP8_DTYPE, G.BLOCK).is_fp8  # the weight decides
    assert not QuantScheme.weight_only(torch.int8, G.PER_CHANNEL).is_fp8


@pytest.mark.parametrize("activation_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_weight_only_scheme(activation_dtype):
    scheme = QuantScheme.weight_only(FP8_DTYPE, G.BLOCK, activation_dtype)
    assert scheme.is_weight_only
    assert scheme == QuantScheme(activation_dtype, FP8_DTYPE, G.PER_TENSOR, G.BLOCK, dynamic=False)
    assert (scheme.activation_granularity, scheme.dynamic, scheme.symmetric) == (G.PER_TENSOR, False, True)
    assert scheme != QuantScheme.weight_only(FP8_DTYPE, G.PER_CHANNEL, activation_dtype)


def test_weight_only_default_activation_is_bf16_and_quantized_schemes_are_not_weight_only():
    assert QuantScheme.weight_only(torch.int8, G.PER_CHANNEL).activation_dtype == torch.bfloat16
    assert not QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, True).is_weight_only
    assert not QuantScheme(FP8_DTYPE, FP8_DTYPE, G.PER_GROUP, G.BLOCK, True).is_weight_only


def test_string_granularity_is_normalised_or_rejected():
    try:
        scheme = QuantScheme(torch.int8, torch.int8, "per_token", "per_channel", dynamic=True)
    except ValueError:
        return
    assert scheme.activation_granularity is G.PER_TOKEN
    assert scheme.describe() == "int8 dyn-token x per-channel"


@pytest.mark.parametrize(
    "dtype, expected",
    [(torch.int8, (-128.0, 127.0)), (torch.uint8, (0.0, 255.0)), (FP8_DTYPE, (-448.0, 448.0)), (INT4_DTYPE, (-8.0, 7.0))],
)
def test_quant_range(dtype, expected):
    assert quant_range(dtype) == expected


def test_symmetric_quant_max():
    assert symmetric_quant_max(torch.int8) == 127.0
    assert symmetric_quant_max(FP8_DTYPE) == 448.0
    with pytest.raises(ValueError, match="uint8 has no symmetric range"):
        symmetric_quant_max(torch.uint8)
    with pytest.raises(ValueError, match="torch.float16 is not a quantized dtype"):
        quant_range(torch.float16)


def test_dtype_name():
    assert [dtype_name(d) for d in (torch.int8, torch.uint8, FP8_DTYPE, INT4_DTYPE)] == ["int8", "uint8", "fp8", "int4"]
    assert [dtype_name(d) for d in (torch.bfloat16, torch.float16, torch.float32)] == ["bf16", "fp16", "fp32"]
    assert dtype_name(torch.float64) == "torch.float64"


def test_int4_group_scheme_is_a_distinct_key_per_group_size():
    w4a8 = QuantScheme(torch.int8, INT4_DTYPE, G.PER_TOKEN, G.PER_GROUP, dynamic=True, weight_group_size=128)
    assert w4a8 == QuantScheme(torch.int8, INT4_DTYPE, "per_token", "per_group", True, True, 128)
    assert w4a8 != dataclasses.replace(w4a8, weight_group_size=64)
    assert symmetric_quant_max(INT4_DTYPE) == 7.0
    assert QuantScheme(torch.int8, torch.int8, G.PER_TOKEN, G.PER_CHANNEL, True).weight_group_size is None
