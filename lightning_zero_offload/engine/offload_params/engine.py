"""The parameter-offload engine: this project's CPU step over a model whose parameters FSDP2 keeps on the host.

```
forward/backward (device)  FSDP2 gathers each block's shards to the device just before it runs, and
                           reduce-scatters its gradients back to the host shard's p.grad after
[speculative]              FSDP2's post-accumulate-grad hook: the shard's step starts (speculation.py)
step()                     global norm + inf/nan check (one all-reduce) -> skip, or clip x unscale factor
                           -> fused CPU Adam (kernels) on each local shard in place: the shard is the master
next forward               FSDP2's all-gather brings the updated shards to the device
```

The parameters are ``fully_shard``-ed before the engine sees them (placement.py); the optimizer's param groups hold
those sharded parameters and are read live at every step (schedulers, callbacks), as the ZeRO-2 engine reads them.
Gradients stay where torch and FSDP2 put them, in ``p.grad`` (DTensors on the host), so user code reads and clips them
as under FSDP2; ``zero_grad`` drops them. Plain torch.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.failures import NonFinitePolicy
from lightning_zero_offload.engine.infra.collectives import all_reduce_sum
from lightning_zero_offload.engine.infra.streams import worker_pool
from lightning_zero_offload.engine.offload_params.shards import (
    ShardSlot,
    check_clip,
    check_shard,
    exceeds_limit,
    memory_report,
    step_shard,
    step_shards,
    sum_of_squares,
)
from lightning_zero_offload.engine.offload_params.speculation import Speculation
from lightning_zero_offload.engine.optimizer_hooks import step_hooks
from lightning_zero_offload.engine.optimizer_support import check_optimizer, optimizer_params, read_hyperparams
from lightning_zero_offload.engine.options import OffloadOptions, resolve
from lightning_zero_offload.engine.scaler import DynamicLossScaler
from lightning_zero_offload.engine.stats import StepStats, StepTimer
from lightning_zero_offload.engine.step.cpu_state import rounding_numbers, rounding_seed
from lightning_zero_offload.warning import ZeroOffloadRuntimeWarning

__all__ = ["ParamOffloadEngine"]

Group = tuple[kernels.AdamArgs, list[ShardSlot]]


class ParamOffloadEngine:
    """Owns the Adam moments of the sharded trainable parameters of ``optimizer`` and steps them on the CPU.

    Args:
        optimizer: the user's Adam/AdamW/CPUAdam over the ``fully_shard``-ed module's parameters; only its
            ``param_groups`` are used (read live).
        device: where forward/backward run (FSDP2's mesh device).
        param_dtype: the compute dtype (FSDP2's ``MixedPrecisionPolicy.param_dtype``).
        options: engine settings; ``offload_params`` is implied.
        world_size: ranks sharing the parameters (torch.distributed's default group).
        local_world_size: ranks on this node, for the default CPU thread count.
        on_device: the parameters of the device share (placement.py's ``device_resident``): their shards,
            moments and step stay on the device.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        param_dtype: torch.dtype,
        options: OffloadOptions,
        world_size: int = 1,
        local_world_size: int = 1,
        on_device: Collection[nn.Parameter] = (),
    ) -> None:
        check_optimizer(optimizer)
        self.optimizer, self.device, self.param_dtype, self.world_size = optimizer, device, param_dtype, world_size
        self.options = options
        self.resolved = resolve(options, device, param_dtype, world_size, local_world_size)
        if self.resolved.cpu_step == "speculative" and self.resolved.speculation_rollback != "snapshot":
            raise ValueError(
                "speculation_rollback='undo' is not available with offload_params=True: use 'snapshot' (or 'auto')"
            )
        self.resolved.warn()
        self.state_dtype = self.resolved.state_dtype
        self.scaler = DynamicLossScaler(options.loss_scaler) if param_dtype == torch.float16 else None
        self.nonfinite = NonFinitePolicy(options.max_consecutive_skipped_steps, self.scaler)
        self._seed = rounding_seed(None, device, world_size) if self.state_dtype == torch.bfloat16 else 0
        self._threads, self._numbers = self.resolved.cpu_threads, {}
        self._slots: dict[int, ShardSlot] = {}
        self._on_device = {id(p) for p in on_device}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        speculative = self.resolved.cpu_step == "speculative"
        self._worker = worker_pool("lzo-shard-step", device) if speculative and self.resolved.overlap else None
        self.speculation = Speculation(self._step_shard, self._worker, self._threads) if speculative else None
        self._groups()  # every trainable parameter gets its state now, so the memory is known up front
        self.step_calls = self.skipped_steps = 0
        self.last = StepStats()
        self._carried = 1.0  # what the last step did to p.grad (clip x unscale), applied when it is next read
        self._summary: tuple[float, bool] | None = None
        self._user_code = False  # between before_user_code and after_user_code
        self.timer = StepTimer()
        self._closed = False

    # -- the parameters ----------------------------------------------------------------------------

    def slot_of(self, param: nn.Parameter) -> ShardSlot:
        """``param``'s shard, moments and step count (made for a trainable one, or a frozen one a checkpoint has)."""
        slot = self._slots.get(id(param))
        if slot is None:
            if id(param) not in self._numbers:  # the bf16 state's rounding numbers: from all of the optimizer's
                params = optimizer_params(self.optimizer)  # parameters, frozen ones too
                self._numbers = dict(zip(map(id, params), rounding_numbers([p.numel() for p in params])))
            slot = ShardSlot.for_param(param, self.state_dtype, self._numbers[id(param)], id(param) in self._on_device)
            check_shard(param, slot, self.state_dtype, self.device)
            self._slots[id(param)] = slot
            # A device-resident shard steps after backward: on the device its step is short, and nothing waits.
            if self.speculation is not None and not slot.on_device:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_gradient))
        return slot

    def _on_gradient(self, param: torch.Tensor) -> None:
        assert self.speculation is not None
        self.speculation.on_gradient(self._slots[id(param)])

    def _groups(self) -> list[Group]:
        """Each param group's hyperparameters now, with the slots of its trainable parameters (and of one frozen in
        the middle of a window, whose ``.grad`` torch's AdamW still steps)."""
        groups = []
        for index, group in enumerate(self.optimizer.param_groups):
            trained = [p for p in group["params"] if p.requires_grad or (p.grad is not None and id(p) in self._slots)]
            groups.append((read_hyperparams(self.optimizer, group, index), [self.slot_of(p) for p in trained]))
        return groups

    @property
    def slots(self) -> list[ShardSlot]:
        return list(self._slots.values())

    def _with_grads(self) -> Iterator[ShardSlot]:
        return (slot for slot in self._slots.values() if slot.param.grad is not None)

    # -- training ----------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def expect_step(self, publish_early: bool = False) -> None:
        """The next backward ends an accumulation window. ``publish_early``: nothing reads or writes the
        parameters between it and the step, so (speculative) each shard may be stepped during it."""
        if self.speculation is not None and publish_early:
            hparams = {slot: args for args, slots in self._groups() for slot in slots}
            self.speculation.arm(hparams, 1.0 / self.loss_scale)

    def begin_backward(self) -> None:
        """Before a backward, which adds to ``p.grad``: the last step's clip applies to what it adds to."""
        self._settle_carried()
        if self.speculation is not None:
            self.speculation.take_back()  # an earlier backward's speculated steps: more gradient is coming
        self._summary = None
        self.timer.backward_started()

    def finish_backward(self) -> None:
        ended = self.timer.backward_ended()
        if self.speculation is not None:
            self.speculation.finish_backward()
        if ended:
            self.timer.gradients_landed()

    def before_user_code(self) -> None:
        """User code may read or change ``p.grad`` now (the front end's gradient hooks)."""
        self._settle_carried()
        self._user_code = True
        if self.speculation is not None:
            self.speculation.before_user_code()

    def after_user_code(self) -> None:
        """User code that may have read or changed ``p.grad`` is done (no-op where none ran)."""
        if not self._user_code:
            return
        self._user_code = False
        self._summary = None  # the gradients may have changed: their norm too
        if self.speculation is not None:
            self.speculation.after_user_code()

    def grad_norm(self) -> float:
        """The global 2-norm of the unscaled gradients (one all-reduce, reused by the coming step)."""
        self.finish_backward()
        self._settle_carried()
        sumsq, _ = self._global_summary({})
        return math.sqrt(sumsq) / self.loss_scale if math.isfinite(sumsq) else math.inf

    def _global_summary(self, known: dict[ShardSlot, float]) -> tuple[float, bool]:
        """(sum of squares of every rank's gradient shards, any inf/nan), summed in slot order on every rank."""
        if self._summary is None:
            self._groups()  # a parameter made trainable since the last step (a layer unfrozen) counts too
            sumsq, nonfinite = 0.0, False
            for slot in self._with_grads():
                if slot in known:
                    sumsq += known[slot]
                    continue
                grad = slot.grad
                assert grad is not None
                part, bad = sum_of_squares(slot, grad, self._threads)
                sumsq, nonfinite = sumsq + part, nonfinite or bad
            if self.world_size > 1:
                summary = all_reduce_sum(
                    torch.tensor([sumsq, float(nonfinite)], dtype=torch.float64), None, self.device
                )
                sumsq, nonfinite = float(summary[0]), bool(summary[1] > 0)
            self._summary = (sumsq, nonfinite or not math.isfinite(sumsq))
        return self._summary

    def step(self, clip_norm: float | None = None, clip_value: float | None = None) -> StepStats:
        """Clip, unscale and Adam-step every shard that has a gradient; skip on inf/nan. ``p.grad`` is kept
        as torch's step leaves it (clipped, unscaled) until :meth:`zero_grad`."""
        check_clip("clip_norm", clip_norm)
        check_clip("clip_value", clip_value)
        start = time.perf_counter()
        self.finish_backward()
        self._settle_carried()
        speculated, speculated_with = self.speculation.take() if self.speculation is not None else ({}, {})
        stats = self.timer.step_stats(self.loss_scale)
        self.step_calls += 1
        scale = self.loss_scale
        sumsq, overflow = self._global_summary(speculated)
        stats.grad_norm = math.sqrt(sumsq) / scale if not overflow else math.inf
        if overflow:
            self._take_back(list(speculated), stats)
            self._skip(stats)
        else:
            clip_coef = min(1.0, clip_norm / (stats.grad_norm + 1e-6)) if clip_norm is not None else 1.0
            multiplier = clip_coef / scale
            self.optimizer._opt_called = True  # type: ignore[attr-defined]  # LR schedulers check it
            with step_hooks(self.optimizer):  # pre-hooks may change the hyperparameters of this step
                groups = self._groups()
                stats.cpu_step_s = self._apply(groups, speculated, speculated_with, clip_coef, clip_value, stats)
                stats.cpu_step_after_backward_s = stats.cpu_step_s
            if self.scaler is not None:
                self.scaler.update(overflow=False)
            self._carried = multiplier
        if self.speculation is not None:
            stats.cpu_step_s += self.speculation.take_seconds()
        self._summary = None
        self.timer.step_ended(stats, start)
        self.last = stats
        self.nonfinite.after_step(stats.skipped, scale)
        return stats

    def skip_step(self) -> None:
        """No step for this window (fp16's rule for a training step that returned None): a speculated step is
        taken back; the gradients stay until :meth:`zero_grad`."""
        self.finish_backward()
        if self.speculation is not None:
            self.speculation.take_back()

    def _apply(
        self,
        groups: list[Group],
        speculated: dict[ShardSlot, float],
        speculated_with: dict[ShardSlot, kernels.AdamArgs],
        clip_coef: float,
        clip_value: float | None,
        stats: StepStats,
    ) -> float:
        """Settle the speculated steps, then step the rest synchronously; returns the CPU step's seconds."""
        scale = self.loss_scale
        limit = None if clip_value is None else clip_value * scale
        hparams_of = {slot: args for args, slots in groups for slot in slots}
        redo = [
            slot
            for slot in speculated
            if clip_coef != 1.0
            or hparams_of.get(slot) != speculated_with[slot]
            or (limit is not None and exceeds_limit(slot, limit))
        ]
        self._take_back(redo, stats)
        kept = {slot for slot in speculated if slot not in redo}
        start = time.perf_counter()
        multiplier = clip_coef / scale
        stepped = 0
        for hparams, slots in groups:
            due = [slot for slot in slots if slot.param.grad is not None and slot not in kept]
            if limit is not None:
                for slot in due:
                    slot.grad.clamp_(-limit, limit)  # type: ignore[union-attr]  # clip_grad_value_, in place
            self._step_shards(due, hparams, multiplier)
            stepped += sum(slot.master.numel() for slot in due)
        for slot in kept:
            slot.step += 1
        total = stepped + sum(slot.master.numel() for slot in kept)
        stats.speculated_fraction = (total - stepped) / total if total else 0.0
        return time.perf_counter() - start

    def _step_shards(self, slots: list[ShardSlot], hparams: kernels.AdamArgs, grad_scale: float) -> None:
        step_shards(slots, hparams, grad_scale, self._seed, self._threads)

    def _step_shard(self, slot: ShardSlot, grad: torch.Tensor, hparams: kernels.AdamArgs, grad_scale: float) -> None:
        step_shard(slot, grad, hparams, grad_scale, self._seed, self._threads)

    def _take_back(self, slots: list[ShardSlot], stats: StepStats) -> None:
        if slots and self.speculation is not None:
            for slot in slots:
                slot.restore()
            self.speculation.rollbacks += 1
            stats.rolled_back = True

    def _skip(self, stats: StepStats) -> None:
        stats.skipped = True
        self.skipped_steps += 1
        if self.scaler is not None:
            self.scaler.update(overflow=True)
            return
        warnings.warn(
            "Non-finite gradients (inf/nan): the optimizer step was skipped and the parameters are "
            "unchanged. Check the loss for nan/inf or lower the learning rate.",
            ZeroOffloadRuntimeWarning,
            stacklevel=3,
        )

    def _settle_carried(self) -> None:
        """Apply the last step's clip x unscale factor to ``p.grad``, as torch's clipping left it in place."""
        if self._carried != 1.0:
            for slot in self._with_grads():
                slot.grad.mul_(self._carried)  # type: ignore[union-attr]
            self._carried = 1.0
            self._summary = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: drop the gradients (or make them zero: still stepped next time)."""
        if self.speculation is not None:
            self.speculation.take_back()
        self._carried, self._summary = 1.0, None
        for slot in self._slots.values():
            if set_to_none:
                slot.param.grad = None
            elif slot.param.grad is not None:
                slot.param.grad.zero_()

    @property
    def rollbacks(self) -> int:
        return self.speculation.rollbacks if self.speculation is not None else 0

    # -- state beyond the weights and moments -------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs besides weights and moments, in the ZeRO-2 engine's keys (plain numbers)."""
        state: dict[str, Any] = {
            "step_calls": self.step_calls,
            "skipped_steps": self.skipped_steps,
            "nonfinite": self.nonfinite.state_dict(),
            "schedule": {"name": self.resolved.cpu_step},
            "cpu_state": {"dtype": "bf16" if self.state_dtype == torch.bfloat16 else "fp32", "seed": self._seed},
        }
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """:meth:`state_dict` back (or the ZeRO-2 engine's: its schedule's pending state does not apply here)."""
        self.step_calls = int(state.get("step_calls", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.nonfinite.load_state_dict(state.get("nonfinite", {}))
        if state.get("loss_scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        seed = state.get("cpu_state", {}).get("seed")
        if seed is not None and self.state_dtype == torch.bfloat16:
            self._seed = int(seed)

    # -- the end -----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds by kind and side (shards.py's ``memory_report``)."""
        return memory_report(list(self._slots.values()))

    def close(self) -> None:
        """Stop the worker and the hooks; the module keeps its (trained) shards and the state stays."""
        if self._closed:
            return
        if self.speculation is not None:
            self.speculation.finish_backward()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        for hook in self._hooks:
            hook.remove()
        self._closed = True
