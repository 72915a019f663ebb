"""`torch.compile(model, backend="qfuse", options={...})`: Inductor with qfuse's post-grad pass.

Registered through the `torch_dynamo_backends` entry point, so no `import qfuse` is needed.
`options` holds qfuse's fields (see `qfuse.config`) and any Inductor config keys; `mode` is any
mode Inductor takes ("reduce-overhead", "max-autotune", ...), turned into the same config patches
(explicit `options` win). qfuse's pass is composed with a `post_grad_custom_post_pass` (and, for
freezing, a `joint_custom_post_pass`) that is already configured, never replacing it.
"""

from __future__ import annotations

from typing import Any

import torch

from qfuse import debug
from qfuse.config import PASS_SKIPPING_CACHES_OFF, split_options
from qfuse.passes.core.manager import STAGE_SLOTS, prepare_pass


def qfuse_backend(gm: torch.fx.GraphModule, example_inputs: list, options: dict[str, Any] | None = None,
                  mode: str | None = None):
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    qfuse_options, inductor_patches = split_options(options)
    if mode is not None:  # as torch.compile(mode=...) does for Inductor
        inductor_patches = {**list_mode_options(mode), **inductor_patches}
    existing = {slot: inductor_patches.pop(slot, getattr(inductor_config, slot)) for slot in STAGE_SLOTS.values()}
    qfuse_pass, slots = prepare_pass(existing, **qfuse_options)
    inductor_patches.update(slots)
    if qfuse_pass.config.debug:
        debug.start_depyf_for_process(qfuse_pass.config)
        inductor_patches = {**PASS_SKIPPING_CACHES_OFF, **inductor_patches}  # a cache hit would skip the dumps
    return compile_fx(gm, example_inputs, config_patches=inductor_patches)
