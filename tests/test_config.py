"""Tests for `qfuse.config`: QfuseConfig defaults, `from_env`, validation, `split_options`, `cache_key`.

`from_env` is given a plain dict (plus one test through `os.environ` via monkeypatch), so the
tests do not depend on the environment they run in.
"""

import dataclasses

import pytest

from qfuse.config import QfuseConfig, split_options

ALL_FAMILIES = ("reference_linear", "int4_weight_only", "intx_weight_only", "pt2e_linear", "fake_quant_linear",
                "activation_quant", "sibling_linears")


def test_defaults():
    config = QfuseConfig()
    assert config.patterns == ALL_FAMILIES
    assert config.kernel is None
    assert config.kernel_preference == ()
    assert config.disabled_kernels == ()
    assert config.debug is False
    assert config.debug_dir == "qfuse_debug"
    assert config.verify is False
    assert config.int4_in_place is False
    assert QfuseConfig.field_names() == ("patterns", "kernel", "kernel_preference", "disabled_kernels", "debug",
                                         "debug_dir", "verify", "int4_in_place")


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QfuseConfig().kernel = "torch"


def test_from_env_without_variables_is_the_default():
    assert QfuseConfig.from_env({}) == QfuseConfig()
    assert QfuseConfig.from_env({"PATH": "/bin", "QFUSE_UNRELATED": "x"}) == QfuseConfig()


def test_from_env_reads_every_field():
    config = QfuseConfig.from_env({
        "QFUSE_PATTERNS": "pt2e_linear, reference_linear",
        "QFUSE_KERNEL": "reference",
        "QFUSE_KERNEL_PREFERENCE": "reference,torch",
        "QFUSE_DISABLED_KERNELS": "torch",
        "QFUSE_DEBUG": "1",
        "QFUSE_DEBUG_DIR": "/tmp/qfuse-dumps",
        "QFUSE_INT4_IN_PLACE": "yes",
    })
    assert config == QfuseConfig(
        patterns=("pt2e_linear", "reference_linear"),
        kernel="reference",
        kernel_preference=("reference", "torch"),
        disabled_kernels=("torch",),
        debug=True,
        debug_dir="/tmp/qfuse-dumps",
        int4_in_place=True,
    )


def test_from_env_empty_values():
    config = QfuseConfig.from_env({"QFUSE_KERNEL": "", "QFUSE_PATTERNS": "", "QFUSE_DEBUG": ""})
    assert config.kernel is None
    assert config.patterns == ()
    assert config.debug is False


@pytest.mark.parametrize(
    "value, expected",
    [("1", True), ("true", True), ("YES", True), (" on ", True), ("0", False), ("False", False), ("off", False)],
)
def test_from_env_debug_booleans(value, expected):
    assert QfuseConfig.from_env({"QFUSE_DEBUG": value}).debug is expected


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("QFUSE_KERNEL", "torch")
    monkeypatch.setenv("QFUSE_DEBUG", "1")
    config = QfuseConfig.from_env()
    assert config.kernel == "torch" and config.debug is True


def test_lists_are_stored_as_tuples():
    config = QfuseConfig(patterns=["pt2e_linear"], kernel_preference=["torch"], disabled_kernels="reference")
    assert config.patterns == ("pt2e_linear",)
    assert config.kernel_preference == ("torch",)
    assert config.disabled_kernels == ("reference",)


@pytest.mark.parametrize(
    "changes, error, message",
    [
        ({"patterns": ("reference_linear", "bogus")}, ValueError, r"unknown qfuse pattern families \['bogus'\]"),
        ({"kernel": "cublaslt"}, ValueError, r"unknown qfuse kernels \['cublaslt'\]; known: \['aiter', 'cuda', 'cutlass', "
                                             r"'onednn', 'reference', 'torch', 'triton', 'xpu', 'zentorch'\]"),
        ({"kernel_preference": ("torch", "hipblaslt")}, ValueError, r"unknown qfuse kernels \['hipblaslt'\]"),
        ({"disabled_kernels": "nope"}, ValueError, r"unknown qfuse kernels \['nope'\]"),
        ({"kernel": "torch", "disabled_kernels": ("torch",)}, ValueError, "kernel 'torch' is both forced and disabled"),
        ({"debug_dir": ""}, ValueError, "debug_dir must be a non-empty path"),
        ({"debug": "maybe"}, TypeError, "'debug' must be a boolean"),
        ({"patterns": 3}, TypeError, "'patterns' must be a list of names"),
    ],
)
def test_validation_errors(changes, error, message):
    with pytest.raises(error, match=message):
        QfuseConfig(**changes)


def test_validation_errors_from_env_and_replace():
    with pytest.raises(ValueError, match="unknown qfuse pattern families"):
        QfuseConfig.from_env({"QFUSE_PATTERNS": "reference_linear,typo"})
    with pytest.raises(TypeError, match="'debug' must be a boolean"):
        QfuseConfig.from_env({"QFUSE_DEBUG": "2"})
    with pytest.raises(ValueError, match="both forced and disabled"):
        QfuseConfig(disabled_kernels=("torch",)).replace(kernel="torch")


def test_known_names_listed_in_the_family_error():
    with pytest.raises(ValueError) as raised:
        QfuseConfig(patterns=("bogus",))
    for family in ALL_FAMILIES:
        assert family in str(raised.value)


def test_split_options_separates_qfuse_and_inductor_keys():
    ours, inductor = split_options(
        {"kernel": "torch", "debug": True, "max_autotune": True, "epilogue_fusion": False}
    )
    assert ours == {"kernel": "torch", "debug": True}
    assert inductor == {"max_autotune": True, "epilogue_fusion": False}


@pytest.mark.parametrize("options", [None, {}])
def test_split_options_empty(options):
    assert split_options(options) == ({}, {})


def test_split_options_unknown_key_names_the_valid_keys():
    with pytest.raises(ValueError) as raised:
        split_options({"kernal": "torch"})
    message = str(raised.value)
    assert "unknown option 'kernal' for backend='qfuse'" in message
    for field in QfuseConfig.field_names():
        assert repr(field) in message
    assert "torch._inductor.list_options()" in message


def test_cache_key_changes_with_what_the_passes_emit():
    base = QfuseConfig()
    assert base.cache_key() == QfuseConfig().cache_key()
    changed = [
        base.replace(kernel="torch"),
        base.replace(kernel="reference"),
        base.replace(kernel_preference=("reference",)),
        base.replace(disabled_kernels=("torch",)),
        base.replace(patterns=("pt2e_linear",)),
        base.replace(int4_in_place=True),
    ]
    keys = {config.cache_key() for config in changed}
    assert base.cache_key() not in keys
    assert len(keys) == len(changed)


def test_cache_key_ignores_debug_switches():
    assert QfuseConfig(debug=True, debug_dir="elsewhere").cache_key() == QfuseConfig().cache_key()
    assert QfuseConfig(verify=True).cache_key() != QfuseConfig().cache_key()


def test_the_family_list_names_the_pass_modules_in_order():
    from qfuse.passes.families import PATTERN_FAMILIES, family_module
    from qfuse.passes.core.manager import PASS_MODULES, describe

    assert QfuseConfig().patterns == PATTERN_FAMILIES == tuple(PASS_MODULES)
    for family, module in PASS_MODULES.items():
        assert module.__name__ == family_module(family) and callable(module.run)
        assert describe(family).startswith(f"{family}:")
