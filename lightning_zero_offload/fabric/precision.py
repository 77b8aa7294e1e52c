"""Fabric glue for the precision: what the device holds, the forward's autocast, the loss scale.

The Fabric counterpart of :mod:`lightning_zero_offload.trainer.precision` (the Trainer's); both take their
precision names from :func:`lightning_zero_offload.core.resolve_precision`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.plugins import Precision
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_zero_offload.core import OffloadSession, resolve_precision
from lightning_zero_offload.mixed_precision import forward_context
from lightning_zero_offload.warning import ZeroOffloadWarning


class ZeroOffloadFabricPrecision(Precision):
    """``"bf16-mixed"``/``"16-mixed"``: low-precision weights on the device, the forward under autocast with
    the rule of :mod:`lightning_zero_offload.mixed_precision`; ``"32-true"``: fp32. Inputs and outputs are
    converted as by Fabric's ``MixedPrecision`` (floating point to fp32)."""

    def __init__(self, precision: str = "bf16-mixed") -> None:
        self.precision, self.param_dtype = resolve_precision(precision)  # type: ignore[assignment]
        self.device_type = "cpu"  # set by the strategy once the device is known
        self.session: OffloadSession | None = None

    @override
    def forward_context(self) -> AbstractContextManager:
        if torch.is_grad_enabled() and self.session is not None:
            self.session.before_training_forward()  # a training forward: unfrozen parameters / added groups
        elif self._evaluating_behind_a_delayed_update():
            if self.session.engine.layout.world_size == 1:
                self.session.sync()  # the weights of every step taken, as the Trainer's evaluation sees them
            else:  # a collective: an evaluation on one rank (if fabric.is_global_zero) would wait for the others
                rank_zero_warn(
                    'cpu_step="delayed" keeps the weights a step behind between steps: this evaluation computes with '
                    "them. Call fabric.strategy.sync() on every rank before evaluating (a collective) for the weights "
                    "of every step taken.",
                    category=ZeroOffloadWarning,
                )
        return forward_context(self.device_type, self.param_dtype)

    def _evaluating_behind_a_delayed_update(self) -> bool:
        """A forward without gradients in eval mode (``model.eval()``: a no-grad forward in train mode may sit inside
        a step, between its forward and backward) while ``cpu_step="delayed"`` keeps the weights a step behind."""
        session = self.session
        return (
            session is not None
            and session.training
            and session.resolved.cpu_step == "delayed"
            and not session.module.training
        )

    @override
    def convert_input(self, data: Any) -> Any:
        return _to_float32(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return _to_float32(data)

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        if self.session is not None:
            tensor = self.session.scale_loss(tensor)  # fp16: dynamic loss scale, unscaled in the CPU kernel
        tensor.backward(*args, **kwargs)


def _to_float32(data: Any) -> Any:
    def convert(t: Tensor) -> Tensor:
        return t.float() if torch.is_floating_point(t) else t

    return apply_to_collection(data, Tensor, convert)
