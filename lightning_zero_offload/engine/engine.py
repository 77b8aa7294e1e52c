"""The offload engine: one training step's data path, from device gradients to updated device params.

```
backward (device)  -> GradientStreamer: hooks, buckets, [reduce-scatter], fp32 accumulate on CPU
step()             -> global norm + overflow (from the accumulate pass) -> clip x unscale factor
                   -> fused CPU Adam per bucket, writing the low-precision copy in the same pass
                   -> copy back bucket by bucket [all-gather] into the flat device parameter buffer
```

*When* the CPU Adam of a bucket runs is the schedule's business (engine/schedules/): after backward
(sync), during it and validated after it (speculative), or behind the next forward (delayed). This
module is what they share: the layout and buffers, the decisions after backward (norm, overflow,
clip, skip), publishing to the device, and the state in and out.

Device parameters are views into one flat low-precision buffer, so a bucket's update lands with a
single copy (or one all-gather). The CPU holds only this rank's shard: fp32 master, two moments and
an fp32 gradient buffer (16 bytes per owned parameter) plus a few bucket-sized staging buffers.
Where nothing would be offloaded (a CPU device, fp32, one process, the sync step) the engine runs in
place instead (engine/in_place.py): the parameters are views of the fp32 master and gradients stay
where backward left them.
Plain torch: no Lightning imports, so it can be driven and tested without a Trainer.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from lightning_zero_offload import kernels
from lightning_zero_offload.engine import state as state_io
from lightning_zero_offload.engine.adam import check_optimizer
from lightning_zero_offload.engine.collectives import all_reduce_sum
from lightning_zero_offload.engine.failures import NonFinitePolicy
from lightning_zero_offload.engine.gradient_source import GradientSource
from lightning_zero_offload.engine.grads import GradientStreamer
from lightning_zero_offload.engine.in_place import InPlaceGradients
from lightning_zero_offload.engine.layout import Bucket, Layout, build_layout
from lightning_zero_offload.engine.memory import BufferPool, can_pin, host_zeros, records_allocations, worker_pool
from lightning_zero_offload.engine.optimizer_hooks import has_step_hooks, step_hooks
from lightning_zero_offload.engine.options import OffloadOptions, resolve
from lightning_zero_offload.engine.param_writes import ParamWriteWatch
from lightning_zero_offload.engine.publisher import LOW_PRECISION, NullPublisher, Publisher
from lightning_zero_offload.engine.scaler import DynamicLossScaler
from lightning_zero_offload.engine.schedules import StepInputs, make_schedule
from lightning_zero_offload.engine.stats import StepStats
from lightning_zero_offload.engine.update import read_all_hyperparams, update_in_place_checked

__all__ = ["OffloadEngine", "StepStats"]


class OffloadEngine:
    """Owns the CPU optimizer state of the trainable parameters of ``optimizer`` and updates them.

    Args:
        optimizer: the user's Adam/AdamW/CPUAdam; only its ``param_groups`` are used (read live).
        device: where forward/backward run; parameters are moved there in ``param_dtype``.
        param_dtype: dtype of the device parameters and gradients (bf16, fp16 or fp32).
        options: engine settings ("auto" ones are resolved here for ``device``: ``resolved``).
        process_group: ranks sharing the optimizer state (ZeRO-2); None for a single process.
        local_world_size: ranks on this node, for the default CPU thread count.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        param_dtype: torch.dtype,
        options: OffloadOptions,
        process_group: dist.ProcessGroup | None = None,
        local_world_size: int = 1,
    ) -> None:
        check_optimizer(optimizer)
        if param_dtype not in (*LOW_PRECISION, torch.float32):
            raise ValueError(f"param_dtype must be bfloat16, float16 or float32, got {param_dtype}")
        self.optimizer = optimizer
        self.device = device
        self.param_dtype = param_dtype
        self.options = options
        self.process_group = process_group
        distributed = process_group is not None or (dist.is_available() and dist.is_initialized())
        world = dist.get_world_size(process_group) if distributed else 1
        rank = dist.get_rank(process_group) if distributed else 0
        # Every "auto" decided once, by the rule the pre-flight check and the planner use too.
        self.resolved = resolve(options, device, param_dtype, world, local_world_size)
        self.resolved.warn()
        resolved = self.resolved
        self.cpu_step = resolved.cpu_step
        self.overlap = resolved.overlap
        self.num_threads = resolved.cpu_threads
        self.scaler = DynamicLossScaler(options.loss_scaler) if param_dtype == torch.float16 else None
        self.updater = worker_pool("zero-offload-step", device)
        self._world, self._rank = world, rank
        self._backward_start: float | None = None
        self._backward_s = 0.0
        self._step_expected = False
        self.step_calls = 0
        self.skipped_steps = 0
        self.nonfinite = NonFinitePolicy(options.max_consecutive_skipped_steps, self.scaler)
        self.failed = False  # closed after an exception, without gathering (see _close_after_failure)
        self._closed = False
        # Moments and step counts of parameters that left the trainable set, kept should they return.
        self._parked: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._build()
        self.last = StepStats(loss_scale=self.loss_scale)

    @records_allocations  # every buffer made here (schedules' too) lands in self.ledger, read by memory_report
    def _build(self) -> None:
        """Lay out the optimizer's trainable parameters as they are now, and make every part that depends on it."""
        optimizer, param_dtype, device, options = self.optimizer, self.param_dtype, self.device, self.options
        world, rank = self._world, self._rank
        self._signature = self.trainable_signature()
        self._grad_summary: tuple[float, bool, list[bool]] | None = None  # this window's, once computed
        # Trainable params in optimizer order; torch_index maps the optimizer's state-dict numbering.
        self.params: list[torch.nn.Parameter] = []
        self.group_of: list[int] = []
        self.torch_index: list[int] = []
        counter = 0
        for group_index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self.params.append(p)
                    self.group_of.append(group_index)
                    self.torch_index.append(counter)
                counter += 1
        if not self.params:
            raise ValueError("The optimizer has no parameter with requires_grad=True: nothing to train")

        element = torch.empty(0, dtype=param_dtype).element_size()
        self.layout: Layout = build_layout([p.shape for p in self.params], options.bucket_numel(element), world, rank)
        self.in_place = self.resolved.in_place
        self.pin = self.resolved.pin_memory and can_pin(device)
        shard = self.layout.shard_numel
        self.master = host_zeros(shard, torch.float32, False)  # model-sized: never pinned (see HostToDevice)
        self.exp_avg = host_zeros(shard, torch.float32, False)
        self.exp_avg_sq = host_zeros(shard, torch.float32, False)
        # The buffer backward accumulates into now (in place: gradients stay in the tensors autograd made).
        self.grad: torch.Tensor | None = None if self.in_place else host_zeros(shard, torch.float32, False)
        self.steps = [0] * len(self.params)
        self._original_dtypes = [p.dtype for p in self.params]
        state_io.load_shard(self, self.master, [p.detach() for p in self.params])

        # The device copy of the parameters and the gradients' way to the CPU: in place, neither moves.
        self.publisher: Publisher | NullPublisher
        self.grads: GradientSource
        if self.in_place:
            self.publisher = NullPublisher(self.layout, self.params, self.master)
            self.grads = InPlaceGradients(self.params, self.num_threads)
            ranges = [self.layout.slot_range(index) for index in range(len(self.params))]
            # Per-parameter views of master and moments, for the step (fixed: the buffers are never replaced).
            buffers = (self.master, self.exp_avg, self.exp_avg_sq)
            self.param_views = tuple([buffer[r] for r in ranges] for buffer in buffers)
        else:
            self.publisher = Publisher(
                self.layout, self.params, device, param_dtype, self.pin, self.process_group, self.ledger
            )
            self.grads = GradientStreamer(
                self.layout,
                self.params,
                self.grad,
                device,
                param_dtype,
                self.pin,
                self.num_threads,
                self.process_group,
                self.overlap,
            )
        self.schedule = make_schedule(self.cpu_step, self)

    # -- the trainable set ---------------------------------------------------------------------

    def trainable_signature(self) -> tuple[tuple[int, bool], ...]:
        """Which parameters each param group holds and which are trainable (cheap: ids and flags)."""
        return tuple(
            (id(p), p.requires_grad) if i else (-group_index - 1, True)  # a group boundary
            for group_index, group in enumerate(self.optimizer.param_groups)
            for i, p in enumerate([None, *group["params"]])
        )

    def replan_if_changed(self) -> bool:
        """Re-plan the layout if parameters became trainable or frozen, or param groups were added.

        Call before a forward (the front ends do, for every training step; ``begin_backward`` too). Every
        parameter that stays keeps its master weights, moments and step count bitwise; a new one starts
        from its current value with fresh moments, as torch's AdamW would. Slow (gathers the whole state),
        and rare. Every rank re-plans at the same step, as every rank changes its trainable set alike.
        """
        if self._closed or self.failed or self.trainable_signature() == self._signature:
            return False
        check_optimizer(self.optimizer)
        self.sync()  # an update in flight lands and is published
        masters = self.master_params()  # settled, writes to the parameters absorbed
        exp_avgs = state_io.full_tensors(self, self.exp_avg)
        exp_avg_sqs = state_io.full_tensors(self, self.exp_avg_sq)
        schedule_state = self.schedule.state_dict()
        self.schedule.close()
        self.grads.close()
        for p, weight, exp_avg, exp_avg_sq, step, dtype in zip(
            self.params, masters, exp_avgs, exp_avg_sqs, self.steps, self._original_dtypes
        ):
            p.data = weight.to(device=self.device, dtype=dtype, copy=True)  # a device tensor of its own again
            self._parked[id(p)] = (exp_avg.clone(), exp_avg_sq.clone(), step)
        kept_masters = {id(p): weight for p, weight in zip(self.params, masters)}
        self._build()
        state_io.load_shard(self, self.master, [kept_masters.get(id(p), p.detach()).float() for p in self.params])
        moments = [self._parked.pop(id(p), None) for p in self.params]
        zeros = [torch.zeros(p.shape) for p in self.params]
        state_io.load_shard(self, self.exp_avg, [m[0] if m else z for m, z in zip(moments, zeros)])
        state_io.load_shard(self, self.exp_avg_sq, [m[1] if m else z for m, z in zip(moments, zeros)])
        self.steps = [m[2] if m else 0 for m in moments]
        self.refresh_device_params()
        self.schedule.load_state_dict({"name": self.schedule.name, **schedule_state})
        return True

    # -- training ------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.scaler is not None else loss

    def expect_step(self, follows: bool = True) -> None:
        """Announce that the next backward ends an accumulation window: ``step()`` follows it.

        Only then may the speculative schedule run the CPU step during that backward. Without the
        announcement (manual optimization, a caller that cannot know) the step runs after backward, as
        in sync. A backward that was announced but not followed by ``step()`` is rolled back when the
        next backward begins.
        """
        self._step_expected = follows

    def before_training_forward(self) -> None:
        """Call before each training forward (the front ends do; ``begin_backward`` too, as a fallback).

        Re-plans if the trainable set changed, then lets the schedule start what is meant to run behind
        forward and backward: the delayed update of the last step, on the master weights with the writes
        made to the parameters since that step (engine/schedules/delayed.py).
        """
        if self._closed or self.failed:
            return
        self.replan_if_changed()
        self.schedule.before_forward()

    def begin_backward(self) -> None:
        """Call before every backward pass."""
        self.before_training_forward()
        self._backward_start = time.perf_counter()
        self._grad_summary = None  # more gradient is coming
        if self.schedule.updates_during_backward:  # otherwise step() is the first to use the master
            self.absorb_param_writes()
        self.schedule.on_backward_start(self._step_expected)
        self._step_expected = False
        self.grads.begin()

    def finish_backward(self) -> None:
        if self._backward_start is not None:
            self._backward_s += time.perf_counter() - self._backward_start
            self._backward_start = None
        self.grads.finish_backward()
        self.schedule.on_backward_end()

    def step(self, clip_norm: float | None = None, clip_value: float | None = None) -> StepStats:
        """Apply the accumulated gradients: clip, unscale, CPU Adam, copy back. Skips on overflow.

        ``clip_norm`` clips the global gradient norm (``torch.nn.utils.clip_grad_norm_``'s rule) and
        ``clip_value`` each gradient element (``clip_grad_value_``), both on the CPU, fused into the step.
        When the update runs relative to forward/backward is up to the schedule (``cpu_step``).
        """
        _check_clip("clip_norm", clip_norm)
        _check_clip("clip_value", clip_value)
        start = time.perf_counter()
        self.grads.finish_backward()
        self.schedule.on_backward_end()
        self._step_expected = False
        stats = StepStats(loss_scale=self.loss_scale, backward_s=self._backward_s)
        stats.transfer_wait_s, stats.transfer_s = self.grads.take_timings()
        self._backward_s = 0.0
        if not self.schedule.update_in_flight:
            self.absorb_param_writes()  # written after backward (on_before_optimizer_step, ...)
        self.schedule.before_step(stats)
        self.wait_publish()
        self.step_calls += 1
        clips = clip_norm is not None or clip_value is not None
        # The in-place source can take the norm and the inf/nan check from the update itself (hooks need
        # the skip known before the update).
        if self.grads.checks_in_update(clips, self._undoable) and not has_step_hooks(self.optimizer):
            self._step_checked(stats)
            stats.total_s = time.perf_counter() - start
            return stats
        sumsq, overflow, has_grad = self._global_grad_summary()
        scale = self.loss_scale
        stats.grad_norm = math.sqrt(sumsq) / scale if math.isfinite(sumsq) else math.inf

        if overflow:
            self._skip(stats)
            self.schedule.on_skip(stats)
        else:
            clip_coef = 1.0
            if clip_norm is not None:  # torch.nn.utils.clip_grad_norm_'s rule, so results match a plain run
                clip_coef = min(1.0, clip_norm / (stats.grad_norm + 1e-6))
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
        self._new_window()
        stats.total_s = time.perf_counter() - start
        self.last = stats
        self.nonfinite.after_step(stats.skipped, scale)
        return stats

    def _undoable(self) -> bool:
        return all(map(kernels.can_undo, read_all_hyperparams(self)))

    def _step_checked(self, stats: StepStats) -> None:
        """The in-place step without clipping: applied only if the gradients are finite, as the others."""
        applied, sumsq, stats.cpu_step_s = update_in_place_checked(self)
        stats.grad_norm = math.sqrt(sumsq) if applied else math.inf
        if applied:
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        else:
            self._skip(stats)
            self.schedule.on_skip(stats)
        self._new_window()
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
            RuntimeWarning,
            stacklevel=3,
        )

    def grad_norm(self) -> float:
        """The total 2-norm of this window's gradients, unscaled (``inf`` if any is inf/nan), as
        ``torch.nn.utils.clip_grad_norm_`` returns it. Ends the backward first. With several ranks it
        costs one all-reduce, which the coming ``step()`` reuses instead of issuing its own.
        """
        self.finish_backward()
        sumsq, overflow, _ = self._global_grad_summary()
        return math.inf if overflow else math.sqrt(sumsq) / self.loss_scale

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step (``optimizer.zero_grad()``)."""
        self.finish_backward()
        self._new_window()

    def _new_window(self) -> None:
        self.grads.new_window()
        self._grad_summary = None

    def _global_grad_summary(self) -> tuple[float, bool, list[bool]]:
        """(sum of squares, overflow, has_grad per parameter) over all ranks, computed once per window."""
        if self._grad_summary is None:
            self._grad_summary = self._reduce_grad_summary()
        return self._grad_summary

    def _reduce_grad_summary(self) -> tuple[float, bool, list[bool]]:
        sumsq, overflow = self.grads.local_summary()
        has_grad = list(self.grads.has_grad)
        if self.layout.world_size > 1:
            summary = torch.tensor([sumsq, float(overflow), *map(float, has_grad)], dtype=torch.float64)
            summary = all_reduce_sum(summary, self.process_group, self.device)
            sumsq, overflow = float(summary[0]), bool(summary[1] > 0)
            has_grad = (summary[2:] > 0).tolist()
        overflow = overflow or not math.isfinite(sumsq)
        return sumsq, overflow, has_grad

    def clamp_grads(self, limit: float) -> None:
        """Clip by value on the stored (loss-scaled) gradients of this window."""
        self.grads.for_each_grad_range(lambda g: g.clamp_(-limit, limit))

    def sync(self) -> None:
        """Make the device parameters fully up to date (before evaluation, or at the end of training)."""
        self.schedule.sync()
        self.wait_publish()

    def absorb_param_writes(self) -> int:
        """Carry writes made to the device parameters since the engine last published into the master
        weights (engine/param_writes.py); returns how many elements were written.

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

    # -- publishing to the device --------------------------------------------------------------

    @property
    def publish_pool(self) -> BufferPool | None:
        """The publisher's pool of low-precision host chunks (None for fp32 parameters)."""
        return self.publisher.pool

    @property
    def writes(self) -> ParamWriteWatch:
        """The publisher's record of what the device parameters were last given."""
        return self.publisher.writes

    def publish(self, bucket: Bucket, out: torch.Tensor | None, pooled: bool = True) -> None:
        """Copy this rank's updated chunk of ``bucket`` to the device and gather the other chunks.

        ``out`` holds the low-precision chunk (None: copy the fp32 master itself); ``pooled``: it came
        from ``publish_pool`` and goes back to it once copied.
        """
        source = self.master[bucket.shard_range] if out is None else out[: bucket.shard_numel]
        self.publisher.publish(bucket, source, out, pooled)

    def wait_publish(self) -> None:
        """Wait for the copies to the device that read host memory about to change."""
        self.publisher.wait()

    def refresh_device_params(self) -> None:
        """Write the master weights (rounded to the device dtype) into the device parameters."""
        self.publisher.refresh(self.master)

    # -- state in and out ----------------------------------------------------------------------

    def _settle(self) -> None:
        """Before reading or replacing the CPU state: nothing running, nothing unvalidated, copies done."""
        self.schedule.settle()
        self.wait_publish()
        self.absorb_param_writes()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides weights and moments to resume bitwise: the step count, the
        loss scaler and the schedule's state (plain tensors and numbers: ``weights_only`` loads)."""
        state: dict[str, Any] = {
            "step_calls": self.step_calls,
            "skipped_steps": self.skipped_steps,
            "nonfinite": self.nonfinite.state_dict(),  # a resumed run raises after the same skipped steps
            "schedule": {"name": self.schedule.name, **self.schedule.state_dict()},
        }
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after the weights and the optimizer state have been loaded).

        The schedule's state is restored if the checkpoint was written with the same schedule. From
        another one, a pending delayed update is simply applied: the device already holds the master.
        """
        self._settle()
        self.step_calls = int(state.get("step_calls", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.nonfinite.load_state_dict(state.get("nonfinite", {}))
        if state.get("loss_scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        schedule = state.get("schedule") or {}
        if schedule.get("name") == self.schedule.name:
            self.schedule.load_state_dict(schedule)

    def master_params(self) -> list[torch.Tensor]:
        """Full fp32 master weights, one tensor per trainable parameter (collective when sharded)."""
        self._settle()
        return state_io.full_tensors(self, self.master)

    def load_master_params(self, tensors: list[torch.Tensor]) -> None:
        for p, t in zip(self.params, tensors):
            if t.shape != p.shape:
                raise ValueError(f"master weight of shape {tuple(t.shape)} does not fit parameter {tuple(p.shape)}")
        self._settle()
        state_io.load_shard(self, self.master, [t.float() for t in tensors])
        self.refresh_device_params()
        self.schedule.on_weights_loaded()

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer state in ``torch.optim.AdamW``'s format (full tensors, collective when sharded)."""
        self._settle()
        return state_io.optimizer_state_dict(self)

    def param_groups_state(self) -> list[dict[str, Any]]:
        """The optimizer's hyperparameters, numbered as in ``torch.optim.Optimizer.state_dict``."""
        return state_io.param_groups_state(self)

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's flat fp32 master and moments, as stored in a sharded checkpoint."""
        self.refuse_after_failure("sharded checkpoint")
        self._settle()
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state in torch Adam/AdamW format (from this engine, torch, or CPUAdam)."""
        self._settle()
        state_io.load_optimizer_state_dict(self, state_dict)

    # -- accounting and teardown ---------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes held by the engine, as recorded where each buffer was allocated (see memory.MemoryLedger)."""
        return self.ledger.report(sum(p.numel() for p in self.params))

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, after_failure: bool = False) -> None:
        """Detach from the module and hand the parameters back as CPU tensors holding the master weights.

        Each parameter gets its original dtype back, so a module that came in fp32 leaves with the exact
        fp32 trained weights, not their low-precision device copy. The CPU optimizer state is kept, so
        the optimizer state can still be saved after training (as with a plain torch optimizer).
        ``after_failure``: issue no collective (the other ranks may be gone); see ``_close_after_failure``.
        """
        if self._closed:
            return
        if after_failure:
            self._close_after_failure()
            return
        self._settle()
        self.schedule.close()
        self.updater.shutdown(wait=True)
        self.grads.close()
        for p, weight, dtype in zip(self.params, self.master_params(), self._original_dtypes):
            p.data = weight.to(dtype)
        self.publisher.drop()
        self._closed = True

    def _close_after_failure(self) -> None:
        """Detach from the module after an exception, issuing no collective and never blocking on a peer.

        What the module's parameters hold afterwards (each in its original dtype, on the device):

        - one process: the fp32 master weights (as after a normal close; they are complete on this rank);
        - several ranks: this rank's device copy of the parameters (the low-precision values the last
          forward used, upcast), because the full master weights are spread over the ranks and gathering
          them needs peers that may be gone. The engine keeps only this rank's shard of the optimizer
          state; asking it for the full state raises instead of hanging (:meth:`refuse_after_failure`).

        A failure inside the optimizer step itself can leave some buckets updated and others not; resume
        from the last checkpoint rather than saving these weights as a training checkpoint.
        """
        # Stop the worker threads first: they are not daemons, so one left waiting for a buffer that the
        # failed main thread will never return would keep the process from exiting (and its peers waiting).
        self.updater.shutdown(wait=False, cancel_futures=True)
        self.publisher.release_waiters()  # unblock an update waiting for a free buffer
        self.updater.shutdown(wait=True)
        self.grads.close()
        self.schedule.abandon()  # host-side only: a running update finishes, unvalidated work is dropped
        single = self.layout.world_size == 1
        with torch.no_grad():
            if single:
                masters = state_io.full_tensors(self, self.master)  # one rank: no collective involved
            for index, (p, dtype) in enumerate(zip(self.params, self._original_dtypes)):
                p.data = masters[index].to(dtype) if single else p.detach().to(dtype, copy=True)
        self.publisher.drop()
        self.failed = True
        self._closed = True

    def refuse_after_failure(self, what: str) -> None:
        """Raise instead of gathering ``what`` from peers that a failure may have taken down."""
        if self.failed and self.layout.world_size > 1:
            raise RuntimeError(
                f"Cannot assemble the {what}: training failed and the engine was closed without gathering it "
                "from the other ranks (they may be gone). Resume from the last checkpoint instead."
            )


def _check_clip(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
