"""``cpu_step="delayed"``: Delayed Parameter Update (ZeRO-Offload's DPU), the CPU step behind the next forward.

After ``dpu_warmup_steps`` synchronous steps, step t only plans its update (clip factor, skip, step
numbers and hyperparameters are step t's); the update runs on the worker from the start of step t+1's
training forward, while step t+1 computes forward/backward on the weights of step t-1, and is swapped
in at step t+1. The step is hidden, but every gradient is computed on one-step-stale weights, which
changes convergence (docs/dpu.md). With weight prediction the device gets ``W_t + (W_t - W_{t-1})``
instead: the update still running guessed as a repeat of the last one (free: the kernel has both values
in registers).

Writes to the parameters between steps (callbacks after the optimizer step, ``load_state_dict``, weight
averaging at the end of fit) are seen because the update of step t has not started yet: the device still
holds what it was given, so a written element is one whose device value differs from it. A written
element takes the written value as its master value *after* the pending update of step t (which still
updates its moments): the write replaces the weights as they stand after the last step, as it would
with a synchronous optimizer. Writes during forward/backward, while the update runs, are refused.

Evaluation inside training (:meth:`DelayedSchedule.sync`) shows the device the latest weights ``W_t`` and
keeps what training computes with next (the stale weights, and the swap-in of ``W_t`` at the next step);
the next training forward gets the stale weights back. So evaluation, wherever and however often it runs,
changes nothing in training: a run resumed from a checkpoint written before an evaluation that the
resumed run does not repeat (or after one) trains as the uninterrupted run does.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from lightning_zero_offload.engine.infra.memory import host_zeros
from lightning_zero_offload.engine.schedules.base import Schedule, StepInputs, apply_now, clamp_if_asked
from lightning_zero_offload.engine.state_dicts import load_shard
from lightning_zero_offload.engine.stats import StepStats
from lightning_zero_offload.engine.step.layout import Bucket
from lightning_zero_offload.engine.step.update import Plan, Run

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.parts import ScheduleParts
    from lightning_zero_offload.engine.step.update import UpdatePipeline

# What the device was last given (DelayedSchedule.device_holds).
MASTER, NEXT, SAVED, EVALUATION = "master", "next", "saved", "evaluation"


class DelayedSchedule(Schedule):
    name = "delayed"

    def __init__(self, parts: ScheduleParts[UpdatePipeline]) -> None:
        super().__init__(parts)
        self.parts: ScheduleParts[UpdatePipeline] = parts
        self.pipeline = parts.update
        settings = parts.resolved.delayed  # checked by engine/options.resolve (prediction needs bf16/fp16)
        assert settings is not None
        self.warmup_steps = settings.warmup_steps
        self.extrapolate = 1.0 if settings.weight_prediction else 0.0
        # Two gradient buffers: backward t+1 fills one while the update of step t reads the other.
        shard = parts.layout.shard_numel
        self.grad_buffers = [parts.state.grad, parts.state.new_buffer()]
        # The low-precision result waiting to be swapped in (None where the master has the device dtype:
        # the master is published).
        low_precision = parts.publisher.pool is not None
        self.next_params = host_zeros(shard, parts.param_dtype, False) if low_precision else None
        self.next_from_checkpoint = False  # next_params holds a loaded prediction (kept if saved again)
        self.deferred: tuple[Plan, torch.Tensor] | None = None  # planned at the step, started before the forward
        self.pending: Future | None = None  # the update running on the worker
        self.publish_due = False  # a finished update waits to be swapped in
        self.last_update_s = 0.0
        self.active_this_step = False
        self.closed_state: dict[str, Any] | None = None
        # What the device was last given, to tell user writes apart: the master rounded to the device dtype,
        # next_params (a prediction), the gradient buffer not in use (SAVED: kept there when the update ran
        # before the next forward, for a checkpoint or an evaluation), the master for an evaluation while the
        # weights training continues with wait in the spare buffer (EVALUATION), or unknown while an update
        # runs (writes refused).
        self.device_holds: str | None = MASTER

    @property
    def active(self) -> bool:
        """Whether steps now run one step behind (after the warm-up)."""
        return self.parts.control.step_calls >= self.warmup_steps

    @property
    def keeps_gradients_after_step(self) -> bool:  # type: ignore[override]
        """Only after a synchronous (warm-up) step: a delayed one hands its gradient buffer to the update."""
        return not self.active_this_step

    @property
    def spare_grad(self) -> torch.Tensor:
        """The gradient buffer backward is not filling now (it held the last step's gradient)."""
        return self.grad_buffers[1] if self.parts.state.grad is self.grad_buffers[0] else self.grad_buffers[0]

    # -- the step ------------------------------------------------------------------------------

    def before_forward(self) -> None:
        """Start the planned update on the worker, with the writes made since the step it belongs to."""
        if self.device_holds == EVALUATION:
            self._end_evaluation()
        if self.deferred is None:
            return
        plan, grad = self.deferred
        self.deferred = None
        parts = self.parts
        overrides: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index in parts.publisher.writes.written_buckets():
            bucket = parts.layout.buckets[index]
            written, values = self._find_writes(bucket, self._published(bucket))
            if written is not None:
                overrides[index] = (written, values)  # held until the worker has updated the bucket
        self.device_holds = None  # the worker overwrites what the device was given
        self.pending = self.pipeline.worker.submit(self._update_all, plan, grad, overrides)

    def before_step(self, stats: StepStats) -> None:
        self.active_this_step = self.active
        t = time.perf_counter()
        stats.update_wait_s = self.finish_pending_update()
        stats.copy_back_s = time.perf_counter() - t - stats.update_wait_s

    def apply(self, inputs: StepInputs, stats: StepStats) -> None:
        if not self.active_this_step:
            apply_now(self.parts, inputs, stats)
            self.device_holds = MASTER
            return
        state = self.parts.state
        clamp_if_asked(self.parts.grads, inputs)
        plan = self.pipeline.plan(inputs.has_grad, inputs.multiplier)
        grad = state.grad
        self.next_from_checkpoint = False
        self.deferred = (plan, grad)  # runs from the next training forward on (before_forward)
        state.swap_grad(self.spare_grad)  # the next backward fills the other buffer
        stats.cpu_step_s = self.last_update_s  # the update that finished in the background (previous step)

    def on_skip(self, stats: StepStats) -> None:
        if self.active_this_step and self.extrapolate:
            # The device holds a prediction of this very update, which is not happening: go back to
            # the true weights (as plain DPU has them), so later steps and checkpoints agree.
            self.parts.publisher.refresh(self.parts.state.master)
            self.device_holds = MASTER

    @property
    def update_in_flight(self) -> bool:
        return self.deferred is not None or self.pending is not None

    # -- the update ----------------------------------------------------------------------------

    def _published(self, bucket: Bucket) -> torch.Tensor:
        """This rank's chunk of what the device was given for ``bucket``, in the device dtype (may be a view)."""
        if self.device_holds is None:
            raise RuntimeError(
                "The parameters were written during a training step's forward or backward (in training_step, "
                "on_after_backward or on_before_optimizer_step) while cpu_step='delayed' updated the master "
                "weights behind it: such a write cannot be told apart from the update and would be lost. Write "
                "parameters between steps (on_train_batch_end, on_train_batch_start, or before the forward), or "
                "use cpu_step='sync' or 'speculative' (the same results as sync, the CPU step hidden in backward)."
            )
        window = bucket.shard_range
        if self.device_holds == NEXT:
            return self.next_params[window]  # type: ignore[index]
        if self.device_holds == SAVED:
            return self.spare_grad[window].to(self.parts.param_dtype)
        return self.parts.state.master[window].to(self.parts.param_dtype)

    def _find_writes(self, bucket: Bucket, published: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(mask, written values) of this rank's chunk of ``bucket``; mask None if nothing was written."""
        written, device_chunk = self.parts.publisher.writes.find_writes(bucket, published)
        return (written, device_chunk[written]) if bool(written.any()) else (None, device_chunk[:0])

    def _update_bucket(
        self,
        bucket: Bucket,
        runs: list[Run],
        grad: torch.Tensor,
        override: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Update one bucket into the master (and next_params), then give written elements their written value."""
        state = self.parts.state
        out = None if self.next_params is None else self.next_params[bucket.shard_range]
        self.pipeline.update_bucket(bucket, runs, grad, out, self.extrapolate)
        if override is not None:
            written, values = override
            state.master[bucket.shard_range][written] = values.to(state.dtype)
            if out is not None:
                out[written] = values  # the device keeps showing the written value, not a prediction

    def _update_all(
        self, plan: Plan, grad: torch.Tensor, overrides: dict[int, tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Worker thread: update every bucket (the master, and next_params for a low-precision device copy)."""
        t = time.perf_counter()
        for bucket, runs in zip(self.parts.layout.buckets, plan):
            self._update_bucket(bucket, runs, grad, overrides.pop(bucket.index, None))
        self.last_update_s = time.perf_counter() - t

    def _run_deferred_here(self, keep_published: bool) -> float:
        """Run the planned update now, on this thread, bucket by bucket (no write held longer than its bucket).

        ``keep_published``: the device is not given the result now (a checkpoint before the next forward):
        what it holds is kept in the spare gradient buffer, whose gradient the update has just used, so
        writes made before the next step can still be told apart.
        """
        plan, grad = self.deferred  # type: ignore[misc]
        self.deferred = None
        parts = self.parts
        t = time.perf_counter()
        written = set(parts.publisher.writes.written_buckets())
        for bucket, runs in zip(parts.layout.buckets, plan):
            override = None
            published = None
            if bucket.index in written or keep_published:
                published = self._published(bucket).clone()  # the update overwrites its source
            if bucket.index in written:
                mask, values = self._find_writes(bucket, published)  # type: ignore[arg-type]
                if mask is not None:
                    override = (mask, values)
                    published[mask] = values  # type: ignore[index]
            self._update_bucket(bucket, runs, grad, override)
            if keep_published:
                grad[bucket.shard_range].copy_(published)  # type: ignore[arg-type]
        self.device_holds = SAVED if keep_published else None
        self.last_update_s = time.perf_counter() - t
        self.publish_due = True
        return self.last_update_s

    def settle(self) -> None:
        self.wait_update(keep_published=True)

    def wait_update(self, keep_published: bool = True) -> float:
        """Complete the update of the last step (the CPU state is then whole); returns seconds waited.

        A planned update not started yet runs here (``keep_published``: see :meth:`_run_deferred_here`).
        """
        if self.deferred is not None:
            return self._run_deferred_here(keep_published)
        if self.pending is None:
            return 0.0
        t = time.perf_counter()
        self.pending.result()
        self.pending = None
        self.publish_due = True
        return time.perf_counter() - t

    def finish_pending_update(self) -> float:
        """Wait for the update and swap its parameters in on the device."""
        waited = self.wait_update(keep_published=False)
        if self.publish_due:
            self._merge_param_writes()  # before the swap-in overwrites them (refused while an update ran)
            for bucket in self.parts.layout.buckets:
                source = None if self.next_params is None else self.next_params[bucket.shard_range]
                self.pipeline.publish(bucket, source, pooled=False)
            self.parts.publisher.wait()
            self.publish_due = False
            self.device_holds = NEXT if self.extrapolate else MASTER
        return waited

    def _merge_param_writes(self) -> None:
        """Make every write to the parameters since the device was last given weights the master's (and the
        kept weights'), bucket by bucket, as the engine does before it uses the master."""
        buckets = self.parts.layout.buckets
        for index in self.parts.publisher.written_buckets():
            self.merge_param_writes(buckets[index])

    def merge_param_writes(self, bucket: Bucket) -> int:
        """A write after the update has landed (a checkpoint ran it before the next forward): the written
        elements take the written value, over the update, as when the write comes before it runs."""
        published = self._published(bucket)
        written, values = self._find_writes(bucket, published)
        if written is None:
            return 0
        window, state = bucket.shard_range, self.parts.state
        state.master[window][written] = values.to(state.dtype)
        if self.next_params is not None:  # what the next swap-in gives the device
            self.next_params[window][written] = values
        if self.device_holds in (SAVED, EVALUATION):  # the weights the next training forward computes with
            self.spare_grad[window][written] = values.to(state.dtype)
        return int(written.sum())

    def on_weights_loaded(self) -> None:
        self.publish_due = False  # the device now holds the loaded master weights
        self.device_holds = MASTER

    def sync(self) -> None:
        """Evaluation: the device gets the latest weights, the true ``W_t`` (not a prediction), and training
        keeps its own course: the weights it computes with until the next step (kept in the spare gradient
        buffer) go back to the device at the next training forward (:meth:`_end_evaluation`), and ``W_t``
        is swapped in at the next step, as without the evaluation."""
        if self.device_holds == EVALUATION:
            return
        if self.pending is not None:  # started by a training forward whose step has not come yet
            self.wait_update()
            self._merge_param_writes()  # refused as at the step: written during forward/backward
            load_shard(self.parts.layout, self.spare_grad, [p.detach() for p in self.parts.params])
            self.device_holds = SAVED
        else:
            self.wait_update(keep_published=True)
        if self.publish_due:
            self._begin_evaluation()

    def _begin_evaluation(self) -> None:
        """SAVED -> EVALUATION: the device shows the master; what it held stays in the spare gradient buffer."""
        self._merge_param_writes()  # into the kept weights too, before the device changes
        self.parts.publisher.refresh(self.parts.state.master)
        self.device_holds = EVALUATION

    def _end_evaluation(self) -> None:
        """EVALUATION -> SAVED: writes made since the evaluation began are merged (the master and the kept
        weights take them, as writes between steps), then the device gets the kept weights back."""
        self._merge_param_writes()
        self.parts.publisher.refresh(self.spare_grad)
        self.device_holds = SAVED

    def state_dict(self) -> dict[str, Any]:
        """With an update pending: the stale device params in use (and, with weight prediction, the
        predicted params waiting to be swapped in, which the master alone cannot rebuild)."""
        if self.closed_state is not None:
            return self.closed_state
        self.settle()
        if not self.publish_due:
            return {}
        evaluating = self.device_holds == EVALUATION
        if evaluating:  # save what training computes with next, not the weights shown to the evaluation
            self._end_evaluation()
        pending: dict[str, Any] = {"device_params": [p.detach().cpu().clone() for p in self.parts.params]}
        if evaluating:
            self._begin_evaluation()
        if self.extrapolate or self.next_from_checkpoint:
            pending["next_params"] = self.parts.control.full_tensors(self.next_params)
        return {"pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the stale device params; the saved update is swapped in at the next step."""
        pending = state.get("pending")
        if pending is None:
            return
        with torch.no_grad():
            for p, saved in zip(self.parts.params, pending["device_params"]):
                p.copy_(saved)
        if self.next_params is not None:
            self.next_from_checkpoint = "next_params" in pending
            if self.next_from_checkpoint:
                load_shard(self.parts.layout, self.next_params, pending["next_params"])
            else:
                self.next_params.copy_(self.parts.state.master.host)  # the whole shard: no device share with delayed
        # What the device holds, kept as a run that saved here keeps it (writes before the next step merge).
        load_shard(self.parts.layout, self.spare_grad, pending["device_params"])
        self.parts.publisher.writes.record_all()  # the engine's own write: the device holds the stale weights again
        self.device_holds = SAVED
        self.publish_due = True

    def abandon(self) -> None:
        self.deferred = None  # after a failure: drop the planned update rather than run it
        super().abandon()
        self.pending = None
        self.publish_due = False
        self.closed_state = {}

    def close(self) -> None:
        # A delayed update not yet swapped in: keep the weights in use, so a checkpoint saved after
        # training can still resume bitwise.
        self.closed_state = self.state_dict()
