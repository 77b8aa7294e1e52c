"""The offload engine: the orchestrator of one training step, built from parts that own their state.

```
backward (device)  -> gradient source (engine/step/streamer.py): hooks, buckets, [reduce-scatter],
                      accumulate into the CPU state's gradient buffer, with sums and inf/nan flags
step()             -> global norm + overflow (one all-reduce) -> skip, or clip x unscale factor
                   -> the schedule runs the plan: fused CPU Adam per bucket on the CPU state
                      (engine/step/cpu_state.py), writing the low-precision copy in the same pass
                      (bf16 state: the master is that copy)
                   -> the publisher (engine/step/publisher.py) copies each bucket back [all-gather]
```

The parts: the CPU state (master, moments, gradient buffer, step counts), the gradient source
(engine/step/gradient_source.py: the streamer, or the in-place source), the publisher (or a null one in
place) and the schedule (engine/schedules/: *when* each bucket's update runs), which gets the parts
through engine/step/parts.py's ``ScheduleParts``, with this class only behind its three-member
``StepControl``. This module builds them and makes the decisions they share (norm, overflow, clip,
skip); engine/lifecycle.py holds the rest of the engine's life (re-planning, state in and out,
teardown, the failure path).

Device parameters are views into one flat low-precision buffer, so a bucket's update lands with a single copy (or
one all-gather). The CPU holds only this rank's shard: master, two moments and a gradient buffer, fp32 (16 bytes
per owned parameter) or bf16 with ``cpu_state="bf16"`` (8), plus a few bucket-sized staging buffers.
Where nothing would be offloaded (a CPU device, fp32, one process, the sync step) the engine runs in
place (engine/step/in_place.py): the parameters views of the fp32 master, gradients where backward left
them. Plain torch: no Lightning imports, so it can be driven and tested without a Trainer.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist

from lightning_zero_offload.engine import state_dicts
from lightning_zero_offload.engine.failures import NonFinitePolicy
from lightning_zero_offload.engine.infra.ledger import records_allocations
from lightning_zero_offload.engine.infra.memory import can_pin
from lightning_zero_offload.engine.infra.streams import worker_pool
from lightning_zero_offload.engine.lifecycle import LIVE_ENGINES, EngineLifecycle
from lightning_zero_offload.engine.optimizer_hooks import has_step_hooks, step_hooks
from lightning_zero_offload.engine.optimizer_support import check_optimizer, optimizer_params
from lightning_zero_offload.engine.options import OffloadOptions, resolve
from lightning_zero_offload.engine.save_sharing import SaveSharing
from lightning_zero_offload.engine.scaler import DynamicLossScaler
from lightning_zero_offload.engine.schedules import StepInputs, SyncSchedule, make_schedule
from lightning_zero_offload.engine.stats import StepStats, StepTimer
from lightning_zero_offload.engine.step.cpu_state import CpuState, ParkedState, rounding_numbers, rounding_seed
from lightning_zero_offload.engine.step.device_share import ShareChoice
from lightning_zero_offload.engine.step.gradient_source import BucketArrivals
from lightning_zero_offload.engine.step.in_place import InPlaceGradients, InPlaceUpdate
from lightning_zero_offload.engine.step.layout import Layout, build_layout
from lightning_zero_offload.engine.step.parts import ScheduleParts, U
from lightning_zero_offload.engine.step.publisher import LOW_PRECISION, NullPublisher, Publisher
from lightning_zero_offload.engine.step.streamer import GradientStreamer
from lightning_zero_offload.engine.step.update import UpdatePipeline
from lightning_zero_offload.engine.window import AccumulationWindow, CarriedGradients
from lightning_zero_offload.warning import ZeroOffloadRuntimeWarning

__all__ = ["OffloadEngine", "StepStats"]


class OffloadEngine(AccumulationWindow, EngineLifecycle):
    """Owns the CPU optimizer state of the trainable parameters of ``optimizer`` and updates them.

    Args:
        optimizer: the user's Adam/AdamW/CPUAdam; only its ``param_groups`` are used (read live).
        device: where forward/backward run; parameters are moved there in ``param_dtype``.
        param_dtype: dtype of the device parameters and gradients (bf16, fp16 or fp32).
        options: engine settings ("auto" ones are resolved here for ``device``: ``resolved``).
        process_group: ranks sharing the optimizer state (ZeRO-2); None for a single process.
        local_world_size: ranks on this node, for the default CPU thread count.
        share_floor: with ``device_share="auto"``, the share to start with and keep at least (the pre-flight's:
            the host holds the rest only without it; planner/preflight.py); None: none.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        param_dtype: torch.dtype,
        options: OffloadOptions,
        process_group: dist.ProcessGroup | None = None,
        local_world_size: int = 1,
        share_floor: ShareChoice | None = None,
    ) -> None:
        check_optimizer(optimizer)
        if param_dtype not in (*LOW_PRECISION, torch.float32):
            raise ValueError(f"param_dtype must be bfloat16, float16 or float32, got {param_dtype}")
        self.optimizer, self.device, self.param_dtype, self.options = optimizer, device, param_dtype, options
        self.process_group = process_group
        distributed = process_group is not None or (dist.is_available() and dist.is_initialized())
        world = dist.get_world_size(process_group) if distributed else 1
        rank = dist.get_rank(process_group) if distributed else 0
        # Every "auto" decided once, by the rule the pre-flight check and the planner use too.
        self.resolved = resolve(options, device, param_dtype, world, local_world_size)
        if share_floor is not None and (options.device_share != "auto" or options.offload_params):
            raise ValueError('share_floor: where device_share="auto" starts, in the ZeRO-2 mode only')
        if share_floor is not None:
            self.resolved = replace(self.resolved, device_share=share_floor.share)
        self.resolved.warn()
        resolved = self.resolved
        self.cpu_step = resolved.cpu_step
        self.overlap = resolved.overlap
        self.num_threads = resolved.cpu_threads
        self.scaler = DynamicLossScaler(options.loss_scaler) if param_dtype == torch.float16 else None
        self.update_worker = worker_pool("zero-offload-step", device)  # the thread CPU updates run on
        self._world, self._rank = world, rank
        self.timer = StepTimer()
        self._step_expected = self._publish_early = False
        self.step_calls = 0
        self.skipped_steps = 0
        self.steps_taken = 0  # by this engine, not skipped (step_calls comes back from a checkpoint)
        self.nonfinite = NonFinitePolicy(options.max_consecutive_skipped_steps, self.scaler)
        self.failed = False  # closed after an exception, without gathering (see _close_after_failure)
        self._closed = False
        self.parked = ParkedState()  # moments and step counts of parameters that left the trainable set
        self.weights_on_device = True  # the device copy holds the weights (not between a re-plan's two copies)
        self.share_choice = None  # device_share="auto" (ZeRO-2): chosen after a warm step
        self.share_floor = share_floor
        self.save_sharing = SaveSharing()  # how a full save takes the state (engine/state_dicts.py)
        # bf16 state: the seed of its stochastic rounding, rank 0's on every rank (checkpoints keep it).
        compact = resolved.state_dtype != torch.float32
        self._rounding_seed = rounding_seed(process_group if world > 1 else None, device, world) if compact else 0
        self._build()
        self.last = StepStats(loss_scale=self.loss_scale)
        LIVE_ENGINES.add(self)

    @records_allocations  # every buffer made here (schedules' too) lands in self.ledger, read by memory_report
    def _build(self, replaced: state_dicts.Replaced | None = None) -> None:
        """Lay out the optimizer's trainable parameters as they are now (and carry a ``replaced`` layout's state
        over), and make every part that depends on it."""
        optimizer, param_dtype, device, options = self.optimizer, self.param_dtype, self.device, self.options
        world, rank = self._world, self._rank
        self._signature = self.trainable_signature()
        self._grad_summary: tuple[float, bool, list[bool]] | None = None  # this window's, once computed
        self._carried: CarriedGradients | None = None  # what the last step left, until zero_grad (as torch's .grad)
        # Trainable params (and any frozen mid-window, for its gradient) in optimizer order; torch_index: their keys
        # in the optimizer's state dict.
        holding = replaced.with_gradient if replaced else set()
        self.params: list[torch.nn.Parameter] = []
        self.group_of: list[int] = []
        self.torch_index: list[int] = []
        counter = 0
        for group_index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad or id(p) in holding:
                    self.params.append(p)
                    self.group_of.append(group_index)
                    self.torch_index.append(counter)
                counter += 1
        if not self.params:
            raise ValueError("The optimizer has no parameter with requires_grad=True: nothing to train")
        self._param_index = {id(p): index for index, p in enumerate(self.params)}
        element = torch.empty(0, dtype=param_dtype).element_size()
        self.layout: Layout = build_layout([p.shape for p in self.params], options.bucket_numel(element), world, rank)
        self.in_place = self.resolved.in_place
        self.pin = self.resolved.pin_memory and can_pin(device)
        state_args = (self.resolved.state_dtype, self._rounding_seed, device, self.resolved.device_share, not replaced)
        numbers = rounding_numbers([p.numel() for p in optimizer_params(optimizer)])
        first_numbers = [numbers[index] for index in self.torch_index]  # frozen parameters keep their numbers
        self.state = CpuState(self.layout, self.group_of, not self.in_place, *state_args, first_numbers)
        self._original_dtypes = state_dicts.fill_state(self, replaced)
        if replaced is not None:  # the new device copy is filled from the master: the old one goes first
            self.publisher.release(self.params)
            self.weights_on_device = False  # until _replan publishes the master into the new one
        self._build_parts(from_master=replaced is not None)

    @records_allocations  # a fresh ledger: the state's buffers as moved, the parts built again but the publisher
    def _grow_share(self, share: float) -> None:
        """Move the buckets ``share`` adds to the device share there (the state in place) and build the parts again
        (the old ones closed first) but the publisher: its layout stays, and a second one would take device memory."""
        self.state.grow_share(share)
        self.publisher.record_in(self.ledger)
        self._build_parts(kept=self.publisher)

    def _build_parts(self, kept: Publisher | None = None, from_master: bool = False) -> None:
        """The device copy of the parameters (or the ``kept`` one; ``from_master``: zeros the caller fills from the
        master, else the parameters' values), the gradients' way to the CPU and the update: in place, neither moves
        and the update is one native call per param group (only the sync schedule runs there)."""
        optimizer, param_dtype, device = self.optimizer, self.param_dtype, self.device
        arrivals = BucketArrivals()  # the gradient source reports each landed bucket there, a schedule listens
        # In place the update can take the norm and the inf/nan check itself (engine.step).
        self._in_place_update: InPlaceUpdate | None = None
        if self.in_place:
            self.publisher = NullPublisher(self.layout, self.params, self.master.host)
            self.grads = in_place_grads = InPlaceGradients(self.params, self.num_threads)
            update = InPlaceUpdate(optimizer, self.group_of, self.state, in_place_grads, self.num_threads)
            self._in_place_update = update
            self.schedule = SyncSchedule(self._schedule_parts(arrivals, update))
            return
        where = (self.layout, self.params, device, param_dtype, self.pin)
        made = (self.process_group, self.ledger, self.state.dtype, not from_master)
        self.publisher = publisher = kept or Publisher(*where, *made)
        on_device = (self.layout, self.params, self.state, device, param_dtype, self.pin, self.num_threads)
        self.grads = GradientStreamer(*on_device, self.process_group, self.overlap, arrivals)
        workers = (self.update_worker, self.overlap, self.num_threads)
        pipeline = UpdatePipeline(optimizer, self.group_of, self.layout, self.state, publisher, *workers)
        if self.state.dtype != param_dtype and param_dtype == torch.float32 and kept is None:
            # bf16 state under fp32 parameters: the device computes with the master's (bf16) values from the start.
            publisher.refresh(self.state.master)
        self.schedule = make_schedule(self.cpu_step, self._schedule_parts(arrivals, pipeline))

    def _schedule_parts(self, arrivals: BucketArrivals, update: U) -> ScheduleParts[U]:
        parts = (self.layout, self.state, self.grads, arrivals, self.publisher, update, self.params, self.device)
        return ScheduleParts(*parts, self.param_dtype, self.num_threads, self.resolved, control=self)

    # -- training ------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.scaler is not None else loss

    def expect_step(self, follows: bool = True, publish_early: bool = False) -> None:
        """Announce that the next backward ends an accumulation window: ``step()`` follows it.

        Only then may the speculative schedule run the CPU step during that backward. Without the
        announcement (manual optimization, a caller that cannot know) the step runs after backward, as
        in sync. A backward that was announced but not followed by ``step()`` is rolled back when the
        next backward begins.

        ``publish_early``: nothing reads or writes the parameters between that backward and ``step()``,
        so they may show the step's result before it is called: the speculative schedule then copies each
        updated bucket to the device during backward. Otherwise they keep their values until ``step()``,
        as with any optimizer (the Trainer passes True unless a hook of the user's runs in between).
        """
        self._step_expected = follows
        self._publish_early = follows and publish_early

    def before_training_forward(self) -> None:
        """Call before each training forward (the front ends do; ``begin_backward`` too, as a fallback).

        Re-plans if the trainable set changed, then lets the schedule start what is meant to run behind
        forward and backward: the delayed update of the last step, on the master weights with the writes
        made to the parameters since that step (engine/schedules/delayed.py).
        """
        if self._closed or self.failed:
            return
        self.choose_device_share()
        self.replan_if_changed()
        if self.publisher.writes.rounds and not self.schedule.update_in_flight:
            self.absorb_param_writes()  # the forward then computes with a write as the (bf16) master keeps it
        self.schedule.before_forward()

    def begin_backward(self) -> None:
        """Call before every backward pass."""
        self.before_training_forward()
        self._take_up_carried("a backward after optimizer.step() without optimizer.zero_grad() in between")
        self.timer.backward_started()
        self._grad_summary = None  # more gradient is coming
        if self._step_expected and self.schedule.updates_during_backward:  # else step() first uses the master
            self.absorb_param_writes()
        # A step pre-hook reads the parameters as they were before the step, like the caller's own code.
        publish_early = self._publish_early and not has_step_hooks(self.optimizer, ("pre",))
        self.schedule.on_backward_start(self._step_expected, publish_early)
        self._step_expected = self._publish_early = False
        self.grads.begin()

    def finish_backward(self) -> None:
        """End the backward pass: every gradient it produced is in place for the step.

        Once per pass: where none is open (a front end ended it before ``step()``, or no backward ran) this
        only raises a failure of the gradient worker, so nothing trains on incomplete gradients.
        """
        self.timer.backward_ended()
        if self.grads.finish_backward():
            self.timer.gradients_landed()
            self.schedule.on_backward_end()

    def step(
        self, clip_norm: float | None = None, clip_value: float | None = None, keep_grads: bool = False
    ) -> StepStats:
        """Apply the accumulated gradients: clip, unscale, CPU Adam, copy back. Skips on overflow.

        ``clip_norm`` clips the global gradient norm (``torch.nn.utils.clip_grad_norm_``'s rule) and
        ``clip_value`` each gradient element (``clip_grad_value_``), both on the CPU, fused into the step.
        When the update runs relative to forward/backward is up to the schedule (``cpu_step``).

        ``keep_grads``: the gradients stay for the next backward to add to, or for another ``step()``, until
        :meth:`zero_grad` (torch's ``optimizer.step()``, which leaves ``.grad`` as the clipping left it).
        Otherwise the step consumes them, as if ``zero_grad()`` followed.
        """
        _check_clip("clip_norm", clip_norm)
        _check_clip("clip_value", clip_value)
        # No backward since the last step: torch steps again with the gradients that step left.
        self._take_up_carried("optimizer.step() twice without a backward in between")
        start = time.perf_counter()
        self.finish_backward()
        self._step_expected = self._publish_early = False
        stats = self.timer.step_stats(self.loss_scale)
        stats.transfer_wait_s, stats.transfer_s = self.grads.take_timings()
        if not self.schedule.update_in_flight:
            self.absorb_param_writes()  # written after backward (on_before_optimizer_step, ...)
        self.schedule.before_step(stats)
        self.wait_publish()
        self.step_calls += 1
        clips = clip_norm is not None or clip_value is not None
        # In place the update can take the norm and the inf/nan check itself (hooks need the skip known first).
        checking = self._in_place_update
        if checking is not None and not checking.can_check_in_update(clips):
            checking = None
        self.grads.expect_clipping(clips)  # the next window's step likely does as this one
        if checking is not None and not has_step_hooks(self.optimizer):
            self._step_checked(checking, stats, keep_grads)
            self.timer.step_ended(stats, start)
            return stats
        sumsq, overflow, has_grad = self._global_grad_summary()
        scale = self.loss_scale
        stats.grad_norm = math.sqrt(sumsq) / scale if math.isfinite(sumsq) else math.inf

        clip_coef, clamped = 1.0, False  # what the step does to the gradients in place (none when skipped)
        if overflow:
            self._skip(stats)
            self.schedule.on_skip(stats)
        else:
            if clip_norm is not None:  # torch.nn.utils.clip_grad_norm_'s rule, so results match a plain run
                clip_coef = min(1.0, clip_norm / (stats.grad_norm + 1e-6))
            clamped = clip_value is not None
            inputs = StepInputs(
                has_grad=has_grad,
                clip_coef=clip_coef,
                multiplier=clip_coef / scale,
                clamp_limit=None if clip_value is None else clip_value * scale,
                scaled_grad_norm=math.sqrt(sumsq),
            )
            if self.scaler is not None:
                self.scaler.update(overflow=False)
            # LR schedulers warn unless optimizer.step() ran; the engine's step stands in for it.
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
            with step_hooks(self.optimizer):  # torch's step hooks, as optimizer.step() fires them
                self.schedule.apply(inputs, stats)
        self._end_window(keep_grads, CarriedGradients(clip_coef, clamped))
        self.timer.step_ended(stats, start)
        self.last = stats
        self.steps_taken += not stats.skipped
        self.nonfinite.after_step(stats.skipped, scale)
        return stats

    def _step_checked(self, update: InPlaceUpdate, stats: StepStats, keep_grads: bool) -> None:
        """The in-place step without clipping: applied only if the gradients are finite, as the others."""
        applied, sumsq, stats.cpu_step_s = update.update_checked()
        stats.cpu_step_after_backward_s = stats.cpu_step_s
        stats.grad_norm = math.sqrt(sumsq) if applied else math.inf
        if applied:
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        else:
            self._skip(stats)
            self.schedule.on_skip(stats)
        self._end_window(keep_grads, CarriedGradients(1.0, False))
        self.last = stats
        self.nonfinite.after_step(stats.skipped, self.loss_scale)

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

    def sync(self) -> None:
        """Make the device parameters fully up to date (before evaluation, or at the end of training)."""
        self.schedule.sync()
        self.wait_publish()

    def absorb_param_writes(self) -> int:
        """Carry writes made to the device parameters since the engine last published into the master
        weights (engine/step/param_writes.py); returns how many elements were written.

        Called before the master is used: every backward and step, checkpoint reads and teardown. Not
        before evaluation, where weight averaging swaps its average in and back out again.
        """
        if self._closed or self.failed:
            return 0
        written = self.publisher.written_buckets()
        if not written:
            return 0
        self.schedule.before_param_writes_merge(written)
        return sum(self.schedule.merge_param_writes(self.layout.buckets[i]) for i in written)


def _check_clip(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
