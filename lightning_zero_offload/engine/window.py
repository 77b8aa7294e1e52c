"""The engine's gradients between steps, as torch keeps ``.grad``: the accumulation window.

:class:`AccumulationWindow` is a base of :class:`~lightning_zero_offload.engine.engine.OffloadEngine`
(engine/engine.py keeps construction and the step): the window's norm and its one all-reduce, the
gradients read and written by user code (``p.grad`` shown and taken back), ``zero_grad``, and the
gradients a step keeps until ``zero_grad`` (a second ``step()``, or a backward that adds to them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_zero_offload.engine import state_dicts
from lightning_zero_offload.engine.scaler import DynamicLossScaler
from lightning_zero_offload.engine.schedules import Schedule
from lightning_zero_offload.engine.step.cpu_state import CpuState
from lightning_zero_offload.engine.step.gradient_source import GradientSource, global_summary
from lightning_zero_offload.engine.step.layout import Layout


@dataclass(frozen=True)
class CarriedGradients:
    """What a step did to the gradients it used, which torch would have done to ``.grad`` in place."""

    clip_coef: float  # clip_grad_norm_'s factor (1.0: not clipped)
    clamped: bool  # clip_grad_value_ clamped them (the engine did so in the buffer itself)


class AccumulationWindow:
    """The window's gradients: what the engine does with them besides the step."""

    # Built by OffloadEngine.__init__/_build.
    layout: Layout
    state: CpuState
    grads: GradientSource
    schedule: Schedule
    scaler: DynamicLossScaler | None
    process_group: dist.ProcessGroup | None
    device: torch.device
    _grad_summary: tuple[float, bool, list[bool]] | None
    _carried: CarriedGradients | None

    # OffloadEngine's, used here: finish_backward, loss_scale, full_tensors.

    def grad_norm(self) -> float:
        """The total 2-norm of this window's gradients, unscaled (``inf`` if any is inf/nan), as
        ``torch.nn.utils.clip_grad_norm_`` returns it. Ends the backward first. With several ranks it
        costs one all-reduce, which the coming ``step()`` reuses instead of issuing its own.
        """
        self._take_up_carried("a gradient norm taken after optimizer.step() without optimizer.zero_grad()")
        self.finish_backward()
        sumsq, overflow, _ = self._global_grad_summary()
        return math.inf if overflow else math.sqrt(sumsq) / self.loss_scale

    def gradients(self) -> list[torch.Tensor | None]:
        """Each trainable parameter's gradient of the window, unscaled and whole (None where no rank has
        one), on the CPU: at one rank views of the engine's buffer (in place the very tensors the step will
        read), valid until the next backward or step; at several, gathered copies (a collective, with the
        gradient summary the coming step reuses)."""
        self._take_up_carried("the gradients read after optimizer.step() without optimizer.zero_grad()")
        self.finish_backward()
        if self.layout.world_size == 1:  # every gradient is here whole: views, no summary needed
            has_grad = self.grads.has_grad
            held = self.grads.held()
            if held is not None:
                values = held
            else:
                with state_dicts.buffers_shared_for_save(self):
                    values = self.full_tensors(self.state.grad)  # type: ignore[arg-type]
        else:
            _, _, has_grad = self._global_grad_summary()  # which parameters any rank has a gradient for
            values = self.full_tensors(self.state.grad)  # type: ignore[arg-type]
        scale = self.loss_scale
        return [
            None if not has or value is None else (value if scale == 1.0 else value.float() / scale)
            for value, has in zip(values, has_grad)
        ]

    def set_gradients(self, values: dict[int, torch.Tensor | None]) -> None:
        """Replace the gradients of some trainable parameters (by index) with whole unscaled tensors, or
        drop them (None): as a user's assignment to ``p.grad`` does before torch's step. Every rank must pass
        the same values (each keeps its shard)."""
        if not values:
            return
        self._take_up_carried("the gradients written after optimizer.step() without optimizer.zero_grad()")
        self.finish_backward()
        self.schedule.take_back_speculation()
        scale = self.loss_scale
        scaled: dict[int, torch.Tensor | None] = {}
        for index, value in values.items():
            scaled[index] = None if value is None else value.detach().to("cpu", torch.float32)
            if value is not None and scale != 1.0:
                scaled[index] = scaled[index] * scale  # type: ignore[operator]
        self.grads.set_gradients(scaled)
        self._grad_summary = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: drop the gradients (or, ``set_to_none=False``, make every gradient
        that exists zero: as in torch, its parameter is then updated by the next step even if no backward
        reaches it)."""
        self.finish_backward()
        self.schedule.take_back_speculation()
        self._carried = None
        if set_to_none:
            self.grads.new_window()
        else:
            self.grads.zero_window()
        self._grad_summary = None

    def _end_window(self, keep_grads: bool, carried: CarriedGradients) -> None:
        if keep_grads:
            self._carried = carried
        else:
            self.grads.new_window()
            self._grad_summary = None

    def _take_up_carried(self, what: str) -> None:
        """The gradients the last step left are used again (``what`` does so), as torch keeps ``.grad``
        until ``zero_grad``: give them what that step did to them in place (clipping), or refuse where
        they are not kept."""
        carried, self._carried = self._carried, None
        if carried is None:
            return
        if not self.schedule.keeps_gradients_after_step:
            raise RuntimeError(
                f"zero_offload: {what}. With cpu_step='delayed' the step's update still reads those gradients "
                "behind the next forward, so they cannot be added to or stepped again. Call optimizer.zero_grad() "
                "after each step (Lightning's automatic optimization does), or use cpu_step='sync' or 'speculative'."
            )
        if self.scaler is not None:
            raise RuntimeError(
                f"zero_offload: {what}. Under precision='16-mixed' the kept gradients are scaled by the loss "
                "scale of their own step, so adding to them or stepping with them again mixes scales. Call "
                "optimizer.zero_grad() after each step (Lightning's automatic optimization does)."
            )
        if carried.clip_coef != 1.0:  # torch's clip_grad_norm_ scaled .grad in place
            self.grads.for_each_grad_range(lambda grad: grad.mul_(carried.clip_coef))
        if carried.clip_coef != 1.0 or carried.clamped:
            self.grads.refresh_sums()
        self._grad_summary = None

    def _global_grad_summary(self) -> tuple[float, bool, list[bool]]:
        """(sum of squares, overflow, has_grad per parameter) over all ranks, computed once per window."""
        if self._grad_summary is None:
            world = self.layout.world_size
            self._grad_summary = global_summary(self.grads, world, self.process_group, self.device)
        return self._grad_summary
