"""When the root and the holders gather their parameters beyond FSDP2's own hooks, and when those copies are freed.

FSDP2 keeps the root's gathered parameters from forward to backward (it would gather them again at once), and
``placement.shard_model`` wraps the holders (submodels) the same way. These hooks gather the holders with the root,
for a step that calls a holder's layers and never the holder, and free every gathered copy where no backward
will come to free it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves


def gather_children(module: nn.Module, _args: object, names: tuple[str, ...]) -> None:
    """The root's forward pre-hook, after FSDP2's: gather the holders, since a step may call a holder's layers and
    never the holder itself."""
    for name in names:
        child = getattr(module, name)
        if isinstance(child, FSDPModule):
            child.unshard()


def reshard_all(module: nn.Module) -> None:
    """Free every gathered copy of ``module``'s units. Backward reshards the units it ran through; a forward without
    backward (a training step that returned None, evaluation) leaves the root and the holders gathered, and a
    step writing the shards under them would leave the next forward the old weights."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class ReshardAfterInference:
    """Frees what the root and the holders gathered once a call into them (``forward``, ``generate``) that no
    backward can follow returns: FSDP2 keeps those copies until backward, so after a forward under ``no_grad``
    (evaluation, a callback's sample) the module's parameters would stay gathered copies, not the shards the
    optimizer holds (``BaseFinetuning`` maps one to the other), and the device would keep them. Only the
    outermost call reshards: a step may call a holder, then its layers."""

    def __init__(self) -> None:
        self.depth = 0

    def attach(self, unit: nn.Module) -> None:
        unit.register_forward_pre_hook(self._enter, prepend=True)  # before FSDP2's: counted even if that raises
        unit.register_forward_hook(self._leave_forward, always_call=True)
        generate = getattr(unit, "generate", None)
        if callable(generate):

            @functools.wraps(generate)
            def generate_then_reshard(*args: Any, **kwargs: Any) -> Any:
                return self._generate(generate, unit, *args, **kwargs)

            unit.generate = generate_then_reshard  # type: ignore[method-assign]

    def _enter(self, _module: nn.Module, _args: object) -> None:
        self.depth += 1

    def _leave_forward(self, module: nn.Module, _args: object, _output: object) -> None:
        self.depth -= 1
        if not self.depth and not torch.is_grad_enabled():
            reshard_all(module)

    def _generate(self, generate: Callable[..., Any], unit: nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.depth += 1
        try:
            output = generate(*args, **kwargs)
        finally:
            self.depth -= 1
        if not self.depth and not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output)):
            reshard_all(unit)
        return output
