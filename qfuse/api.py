"""`qfuse.install()` / `qfuse.uninstall()` / `with qfuse.installed():` for plain torch.compile.

`install` puts qfuse's pass into Inductor's `post_grad_custom_post_pass`, after a pass that is
already there (both run); `uninstall` puts back exactly what was there before. Installs nest.
"""

from __future__ import annotations

import contextlib
from typing import Any

from qfuse import debug
from qfuse.config import QfuseConfig
from qfuse.passes.manager import QfusePass, compose

_saved_passes: list[Any] = []


def install(config: QfuseConfig | None = None, **options: Any) -> QfusePass:
    """Run qfuse in every Inductor compile from now on; returns the installed pass."""
    import qfuse.ops  # noqa: F401
    from qfuse.lowerings import register_lowerings
    from torch._inductor import config as inductor_config

    register_lowerings()
    config = (config or QfuseConfig.from_env()).replace(**options)
    if config.debug:
        debug.enable_logging()
    qfuse_pass = QfusePass(config)
    _saved_passes.append(inductor_config.post_grad_custom_post_pass)
    inductor_config.post_grad_custom_post_pass = compose(inductor_config.post_grad_custom_post_pass, qfuse_pass)
    return qfuse_pass


def uninstall() -> None:
    """Undo the latest `install()`, restoring the pass that was configured before it."""
    from torch._inductor import config as inductor_config

    if not _saved_passes:
        raise RuntimeError("qfuse.uninstall() called without a matching qfuse.install()")
    inductor_config.post_grad_custom_post_pass = _saved_passes.pop()


@contextlib.contextmanager
def installed(config: QfuseConfig | None = None, **options: Any):
    qfuse_pass = install(config, **options)
    try:
        yield qfuse_pass
    finally:
        uninstall()
