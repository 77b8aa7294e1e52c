"""Building on the meta device for both front ends (``configure_model``, ``init_module(empty_init=True)``),
without losing a load into the model before ``setup``.

A state dict loaded into a module on the meta device is lost (torch only warns: "copying from a non-meta
parameter ... is a no-op"), and ``setup`` would then initialize the weights at random. Loading before setup
is what a user of Lightning's default strategies does (``with fabric.init_module(empty_init=True): model =
...``, then ``model.load_state_dict(...)``; ``LightningModule.load_from_checkpoint`` inside
``trainer.init_module(empty_init=True)``), so every module given a parameter or a buffer while the model is
built gets a ``load_state_dict`` pre-hook: a load that reaches a module still on the meta device first
materializes it whole on the host (initialized, then overwritten by the load), as an eager build would hold
it. Setup then takes a real model as it is.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from lightning_zero_offload.engine.offload_params.materialize import materialize, on_meta


@contextmanager
def built_on_meta() -> Iterator[None]:
    """``torch.device("meta")``, and a load into a module built inside it before setup materializes it first."""
    hooked: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def record(module: nn.Module, name: str, tensor: Any) -> None:
        if module not in hooked:  # at once: load_from_checkpoint loads inside the context
            hooked.add(module)
            module.register_load_state_dict_pre_hook(_materialize_before_load)

    handles = [register_module_parameter_registration_hook(record), register_module_buffer_registration_hook(record)]
    try:
        with torch.device("meta"):
            yield
    finally:
        for handle in handles:
            handle.remove()


def _materialize_before_load(module: nn.Module, *args: Any) -> None:
    if on_meta(module):
        with torch.device("cpu"):  # a load inside the context (configure_model's) must not build on meta
            materialize(module, "cpu")
