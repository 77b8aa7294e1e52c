"""What the two sessions (:class:`~lightning_zero_offload.core.OffloadSession` for the ZeRO-2 mode and
:class:`~lightning_zero_offload.core.ParamOffloadSession` for ``offload_params=True``) answer alike: what the engine
is and did, the loss scale, the clip recorded for the coming step. Each engine has these under the same names."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_zero_offload.engine import OffloadOptions, StepStats
from lightning_zero_offload.engine.options import Resolved

if TYPE_CHECKING:
    from lightning_zero_offload.engine import OffloadEngine
    from lightning_zero_offload.engine.offload_params import ParamOffloadEngine


_CLIPS = {"clip_norm": "a clip by norm (max_norm)", "clip_value": "a clip by value (clip_val)"}


def the_optimizer(optimizers: list[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The one optimizer a session trains with; several are refused, saying what to do instead."""
    if len(optimizers) != 1:
        raise ValueError(
            f"zero_offload takes exactly one optimizer, got {len(optimizers)}. Put the parameters in param groups of "
            "one optimizer if they step together. Optimizers stepped apart (a GAN's generator and discriminator, "
            "with Lightning's toggle_optimizer) are not supported, and one optimizer with requires_grad switched "
            'at every step would re-plan the CPU state at every step: train such a model with strategy="auto" or "ddp"'
        )
    return optimizers[0]


class EngineSession:
    """An engine training ``module`` through one optimizer: the front ends' questions both modes answer alike."""

    def __init__(self, module: nn.Module, engine: OffloadEngine | ParamOffloadEngine) -> None:
        self.module = module
        self.engine = engine
        self._clip: dict[str, float] = {}  # recorded between backward and the step, applied by step()

    @property
    def training(self) -> bool:
        """The engine is set up and not closed yet (:func:`training_session` asks this for the front ends)."""
        return not self.engine.closed

    # -- what the engine is and did --------------------------------------------------------------

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's optimizer, whose ``param_groups`` the engine reads live."""
        return self.engine.optimizer

    @property
    def options(self) -> OffloadOptions:
        """The offload options as given."""
        return self.engine.options

    @property
    def resolved(self) -> Resolved:
        """The options with every "auto" decided for this device and world size: the CPU step schedule
        (``cpu_step``), the CPU threads, in place or offloaded (``in_place``), the CPU state's dtype."""
        return self.engine.resolved

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the parameters and gradients on the device."""
        return self.engine.param_dtype

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def loss_scale(self) -> float | None:
        """fp16's dynamic loss scale now; None without loss scaling (bf16, fp32)."""
        return self.engine.loss_scale if self.engine.scaler is not None else None

    def grad_scaler_state_dict(self) -> dict[str, float | int] | None:
        """fp16's loss scaler in the format of torch's ``GradScaler.state_dict()``; None without loss scaling."""
        return self.engine.scaler.grad_scaler_state_dict() if self.engine.scaler is not None else None

    @property
    def last_step(self) -> StepStats:
        """What the last optimizer step did and where its time went."""
        return self.engine.last

    @property
    def step_calls(self) -> int:
        """Optimizer steps called so far (skipped ones included), across resumes."""
        return self.engine.step_calls

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/nan gradients so far, across resumes."""
        return self.engine.skipped_steps

    def memory_report(self) -> dict[str, int]:
        """Bytes the engine holds, by kind (device parameters and buckets, host state, staging, pinned),
        and ``params``, the trainable parameter count; after :meth:`close` too."""
        return self.engine.memory_report()

    # -- training --------------------------------------------------------------------------------

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on: fp16 multiplies it by the loss scale (unscaled in the CPU kernel)."""
        return self.engine.scale_loss(loss)

    def clip_norm(self, max_norm: float) -> None:
        """Clip the global gradient norm in the coming step (on the CPU, fused into it)."""
        self._record_clip("clip_norm", float(max_norm))

    def clip_value(self, limit: float) -> None:
        """Clip each gradient element to ``[-limit, limit]`` in the coming step."""
        self._record_clip("clip_value", float(limit))

    def _record_clip(self, kind: str, limit: float) -> None:
        """One clip per step: torch applies a second in turn to the gradients the first left (a norm after a clamp
        is the clamped gradients' norm), which the step's fused clip cannot do; refused rather than applied
        otherwise."""
        if self._clip:
            raise ValueError(
                f"zero_offload applies one gradient clip per optimizer step, fused into its CPU update, and this step "
                f"has one already: {self._recorded_clip()}, then {_CLIPS[kind]}={limit}. torch would apply "
                "the second to the gradients the first left, which the fused clip cannot. Clip once per step, after "
                "the window's last backward (two clips of one kind act as the smaller one), or train with "
                'strategy="auto"'
            )
        self._clip[kind] = limit

    def check_no_clip_before_backward(self) -> None:
        """A backward after a clip and before its step: torch clipped only the gradients accumulated so far, and
        the step's clip would apply to the whole window; refused."""
        if self._clip:
            raise ValueError(
                f"zero_offload clips the gradients at the optimizer step, fused into its CPU update, and "
                f"{self._recorded_clip()} was recorded before this backward: torch would clip only the gradients "
                "accumulated so far and add this backward's unclipped, where the step would clip the whole window. "
                "Clip after the window's last backward, just before optimizer.step()"
            )

    def _recorded_clip(self) -> str:
        """The clip recorded for the coming step, as the errors name it ("a clip by norm (max_norm)=0.5")."""
        ((kind, limit),) = self._clip.items()
        return f"{_CLIPS[kind]}={limit}"

    def _checked_norm(self, norm: float, error_if_nonfinite: bool) -> float:
        """``norm``, or with ``error_if_nonfinite`` an error on inf/nan as ``torch.nn.utils.clip_grad_norm_``
        raises, except under fp16 loss scaling, where an overflow is routine (the step is skipped and the scale
        lowered)."""
        if error_if_nonfinite and math.isinf(norm) and self.loss_scale is None:
            raise RuntimeError(
                "The total norm of the gradients is non-finite, so it cannot be clipped. "
                "Pass error_if_nonfinite=False to clip_gradients to skip this step instead."
            )
        return norm
