"""qfuse's configuration: one frozen dataclass, settable from options or `QFUSE_*` variables.

    field               environment variable         meaning
    ------------------  ---------------------------  ------------------------------------------
    patterns            QFUSE_PATTERNS (a,b)         pattern families to run (default: all)
    kernel              QFUSE_KERNEL                 force one kernel for every fused linear
    kernel_preference   QFUSE_KERNEL_PREFERENCE      replaces the platform's kernel priority list
    disabled_kernels    QFUSE_DISABLED_KERNELS       kernels never to pick
    debug               QFUSE_DEBUG (1/0)            log matches, dump graphs to debug_dir
    debug_dir           QFUSE_DEBUG_DIR              where debug files go
    verify              QFUSE_VERIFY (1/0)           check every rewrite against the original
                                                     subgraph on its first call (slow; see
                                                     qfuse/ops/verify.py)

`torch.compile(..., backend="qfuse", options={...})` takes these fields plus any Inductor config
key (those go to Inductor); anything else is an error that names the valid keys.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from qfuse.kernels import KERNELS
from qfuse.passes.families import PATTERN_FAMILIES

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _as_names(value: Any, field: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(part, str) for part in value):
        return tuple(value)
    raise TypeError(f"qfuse option {field!r} must be a list of names or a comma-separated string, got {value!r}")


def _as_bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise TypeError(f"qfuse option {field!r} must be a boolean, got {value!r}")


@dataclass(frozen=True)
class QfuseConfig:
    patterns: tuple[str, ...] = PATTERN_FAMILIES
    kernel: str | None = None
    kernel_preference: tuple[str, ...] = ()
    disabled_kernels: tuple[str, ...] = ()
    debug: bool = False
    debug_dir: str = "qfuse_debug"
    verify: bool = False
    #: int4 checkpoints' words read where they lie by the cuda decode kernel's lowering, nothing repacked (other
    #: kernels and the op's own extern call keep their layouts): 1.14-1.73x the GPU time a linear on an H200
    #: (docs/kernels.md, "int4 words read in place")
    int4_in_place: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", _as_names(self.patterns, "patterns"))
        object.__setattr__(self, "kernel_preference", _as_names(self.kernel_preference, "kernel_preference"))
        object.__setattr__(self, "disabled_kernels", _as_names(self.disabled_kernels, "disabled_kernels"))
        object.__setattr__(self, "debug", _as_bool(self.debug, "debug"))
        object.__setattr__(self, "verify", _as_bool(self.verify, "verify"))
        object.__setattr__(self, "int4_in_place", _as_bool(self.int4_in_place, "int4_in_place"))
        unknown = [name for name in self.patterns if name not in PATTERN_FAMILIES]
        if unknown:
            raise ValueError(f"unknown qfuse pattern families {unknown}; known: {list(PATTERN_FAMILIES)}")
        named = ([self.kernel] if self.kernel else []) + list(self.kernel_preference) + list(self.disabled_kernels)
        unknown = [name for name in named if name not in KERNELS]
        if unknown:
            raise ValueError(f"unknown qfuse kernels {unknown}; known: {sorted(KERNELS)}")
        if self.kernel and self.kernel in self.disabled_kernels:
            raise ValueError(f"kernel {self.kernel!r} is both forced and disabled")
        if not isinstance(self.debug_dir, str) or not self.debug_dir:
            raise ValueError(f"debug_dir must be a non-empty path, got {self.debug_dir!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> QfuseConfig:
        """The defaults, overridden by whichever `QFUSE_<FIELD>` variables are set."""
        environ = os.environ if environ is None else environ
        values = {name: environ[f"QFUSE_{name.upper()}"] for name in cls.field_names() if f"QFUSE_{name.upper()}" in environ}
        if values.get("kernel") == "":
            values["kernel"] = None
        return cls(**values)

    def replace(self, **changes: Any) -> QfuseConfig:
        return dataclasses.replace(self, **changes)

    def cache_key(self) -> str:
        """Everything that changes what the passes emit (debug and debug_dir do not)."""
        return repr((self.patterns, self.kernel, self.kernel_preference, self.disabled_kernels, self.verify,
                     self.int4_in_place))


def split_options(options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `torch.compile(options=...)` into qfuse fields and Inductor config patches."""
    from torch._inductor import list_options

    qfuse_fields, inductor_keys = set(QfuseConfig.field_names()), set(list_options())
    ours, inductor = {}, {}
    for key, value in (options or {}).items():
        if key in qfuse_fields:
            ours[key] = value
        elif key in inductor_keys:
            inductor[key] = value
        else:
            raise ValueError(
                f"unknown option {key!r} for backend='qfuse'; qfuse options are {sorted(qfuse_fields)}, "
                "and any Inductor config key (torch._inductor.list_options()) is passed to Inductor"
            )
    return ours, inductor


#: Inductor settings that turn off the compile caches whose hit skips the post-grad passes (qfuse's
#: pass, its report and its dumps with them).
PASS_SKIPPING_CACHES_OFF = {"fx_graph_cache": False, "fx_graph_remote_cache": False}


@contextlib.contextmanager
def pass_skipping_caches_off():
    """Compiles in this block run qfuse's pass (debug mode, `explain()`, tests that read reports).
    Unlike Inductor's `force_disable_caches` it leaves the other caches on and warns about nothing."""
    with torch._inductor.config.patch(PASS_SKIPPING_CACHES_OFF), \
            torch._functorch.config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
        yield
