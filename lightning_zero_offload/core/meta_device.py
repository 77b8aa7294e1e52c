"""Building on the meta device for both front ends (``configure_model``, ``init_module(empty_init=True)``),
without losing a load into the model before ``setup``.

A state dict loaded into a module on the meta device is lost (torch only warns: "copying from a non-meta
parameter ... is a no-op"), and ``setup`` would then initialize the weights at random. Loading before setup
is what a user of Lightning's default strategies does (``with fabric.init_module(empty_init=True): model =
...``, then ``model.load_state_dict(...)``; ``LightningModule.load_from_checkpoint`` inside
``trainer.init_module(empty_init=True)``), so every module given a parameter or a buffer while the model is
built (on the thread that builds it) gets a ``load_state_dict`` pre-hook: the tensors the load is about to
fill get host memory first, in place (``torch.utils.swap_tensors``: a tied weight and an optimizer built
already see it). What the load does not fill stays on the meta device, for setup to initialize (a model
partly on the meta device is one the ZeRO-2 engine fills); a load with ``assign=True`` is left alone (it puts
the state dict's tensors in place itself).
"""

from __future__ import annotations

import threading
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

from lightning_zero_offload.engine.meta_init.initialization import allocate


@contextmanager
def built_on_meta() -> Iterator[None]:
    """``torch.device("meta")``, and a load into a module built inside it gives what it fills host memory first."""
    hooked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
    builder = threading.get_ident()  # torch.device("meta") is this thread's; the registration hooks are global

    def record(module: nn.Module, name: str, tensor: Any) -> None:
        # Hooked at once: load_from_checkpoint loads inside the context.
        if threading.get_ident() == builder and module not in hooked:
            hooked.add(module)
            module.register_load_state_dict_pre_hook(_allocate_what_the_load_fills)

    handles = [register_module_parameter_registration_hook(record), register_module_buffer_registration_hook(record)]
    try:
        with torch.device("meta"):
            yield
    finally:
        for handle in handles:
            handle.remove()


def _allocate_what_the_load_fills(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any], *args: Any
) -> None:
    """The module's own parameters and persistent buffers on the meta device that ``state_dict`` holds: host
    memory for the load to copy into."""
    if local_metadata.get("assign_to_params_buffers"):
        return
    for name, p in list(module._parameters.items()):
        if p is not None and p.is_meta and prefix + name in state_dict:
            module._parameters[name] = allocate(p, "cpu")  # in place, or (a weak reference to it) this slot
    for name, b in list(module._buffers.items()):
        persistent = name not in module._non_persistent_buffers_set
        if b is not None and b.is_meta and persistent and prefix + name in state_dict:
            module._buffers[name] = torch.empty_like(b, device="cpu")
