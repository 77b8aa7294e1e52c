"""``cpu_step="speculative"``: each bucket's CPU step runs during backward, validated after it.

On a backward that ends an accumulation window (the caller says so: ``engine.expect_step()``), the
gradient worker runs the fused Adam step of a bucket as soon as that bucket's gradient is final in
the CPU buffer (after its reduce-scatter when sharded), with no clip factor. The low-precision result
goes to a host buffer and, at one rank where the caller allows it, straight on to the device (see
"Publishing during backward").
After backward the engine validates:

- no overflow, clipping off or not triggered, hyperparameters unchanged: the kernel saw exactly the
  inputs the synchronous step would have given it, so the speculated buckets are published as they
  are (those not published during backward yet), bitwise equal to ``cpu_step="sync"``;
- clipping triggered (or hyperparameters changed): every speculated bucket is rolled back (or, for
  clip-by-value, each bucket that had an element over the limit) and updated again by the
  synchronous path with the right factor, which publishes it again;
- overflow / inf / nan: every speculated bucket is rolled back and the step is skipped as in sync;
  buckets published during backward get the master's rounding again.

Rolling back is ``"snapshot"`` (``"auto"``'s choice: the bucket's state copied before its step, restored
bitwise; 12 bytes of host memory per parameter, 6 with bf16 state) or ``"undo"`` (the step inverted
algebraically by :func:`kernels.adam_undo`: no memory, but after a clipped spike the moments cancel and
the redone step is far from sync: docs/benchmarks.md, "Rolling a speculated step back exactly"). The
snapshot is taken on the update worker from the first forward of a step on, while the device computes
(:meth:`SpeculativeSchedule.before_forward`), bucket by bucket in the order backward produces them; a
bucket whose state changes after it was copied (a write to its parameters merged, a checkpoint loaded,
users' views of the moments read) is copied again when it is speculated. Where copying the whole state
takes longer than forward and backward, speculating costs more than it hides: where a step had to wait
for the snapshot, :class:`SpeculationChooser` times a few steps as sync and keeps the faster (results do
not depend on it; docs/benchmarks.md, "The GPU regime on a CPU").

Only buckets whose parameters all got a gradient in this window and whose gradient is finite are
speculated: their step count and hyperparameters are then known before the all-reduce that
settles them globally. The rest is updated after backward, as in sync.

Adaptive: a speculated step that gets rolled back costs a rollback and the synchronous step. So
speculation pauses while clipping triggered in at least ``PAUSE_TRIGGERS`` of the last
``WINDOW`` steps (early training often clips every step), and resumes once fewer did. The trigger
is still observed while paused: the global norm says whether norm clipping triggers; for clipping by
value, a global norm above the limit counts as triggered (an element over it is then possible).

Publishing during backward (one rank): a speculated bucket's gradient is final, so no later part of
this backward adds to it, and autograd has already run every node that reads its weights: the
post-accumulate-grad hook fires only once all nodes with an edge into a parameter have run, and
every node that saved a parameter for backward has such an edge (tied weights: the one hook fires
after both uses; activation checkpointing without reentrancy recomputes a segment before that
segment's nodes produce their gradients; a parameter getting its gradient twice in one pass, as
reentrant checkpointing can do, is refused by engine/step/streamer.py). So the gradient worker copies the
bucket to the device as soon as its step is done (on a stream of its own, through
``UpdatePipeline.publish``, which records the bucket's checksum for engine/step/param_writes.py), and only the
last buckets' steps and copies stay after backward. What can still read the weights later is code
outside autograd's edges: a tensor saved for backward that aliases a parameter without tracking
its gradient (``w.detach()``), a custom Function reading a module's weight in its backward, a
backward hook. For the first, the parameter's version counter is bumped before the copy, so torch
raises its "modified by an inplace operation" error instead of computing with the new weights; the
others see the new weights (set ``publish_during_backward = False`` on this class for such models).
Between backward and ``step()`` the parameters of buckets published early already hold the step's
result, so this happens only where the caller says nothing reads them there
(``engine.expect_step(publish_early=True)``: the Trainer says so unless the LightningModule or a
callback has a hook that runs in between). Several ranks publish after validation, as the all-gathers
must be issued in the same order everywhere.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.infra.memory import host_zeros
from lightning_zero_offload.engine.infra.streams import on_stream, side_stream
from lightning_zero_offload.engine.schedules.base import Schedule, StepInputs, clamp_if_asked
from lightning_zero_offload.engine.schedules.chooser import SpeculationChooser
from lightning_zero_offload.engine.stats import StepStats
from lightning_zero_offload.engine.step.layout import Bucket
from lightning_zero_offload.engine.step.update import Run

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.parts import ScheduleParts
    from lightning_zero_offload.engine.step.update import UpdatePipeline


class SpeculativeSchedule(Schedule):
    name = "speculative"
    WINDOW = 8
    PAUSE_TRIGGERS = 4
    publish_during_backward = True  # see the module docstring; False publishes only after validation

    def __init__(self, parts: ScheduleParts[UpdatePipeline]) -> None:
        super().__init__(parts)
        self.parts: ScheduleParts[UpdatePipeline] = parts
        self.pipeline = parts.update
        self.mode = parts.resolved.speculation_rollback  # "undo" or "snapshot" (engine/options.resolve)
        # Speculated low-precision results wait here until validated (None where the master has the device
        # dtype: the master is published).
        self.out = host_zeros(parts.state.split, parts.param_dtype, False) if parts.publisher.pool is not None else None
        # Host buckets only: the device share is not speculated (its step is short, and after backward).
        self.snapshot = [parts.state.new_buffer(host_only=True) for _ in range(3)] if self.mode == "snapshot" else []
        # Per bucket: the snapshot holds the bucket's state as it is now. Taken behind the forward (the host
        # is free while the device computes it), so a speculated step only copies what changed since.
        self.snapshot_current = [False] * len(parts.layout.buckets)
        self.snapshotting: Future | None = None
        self.chooser = SpeculationChooser()  # whether speculating pays where the snapshot does not hide
        self.armed_this_step = False
        self.bucket_numel = [sum(seg.numel for seg in b.segments) for b in parts.layout.buckets]
        self.armed = False  # the backward running now ends an accumulation window
        self.hparams: list[kernels.AdamArgs] = []
        self.multiplier = 1.0
        self.speculated: dict[int, list[Run]] = {}  # bucket index -> the runs its step used (worker writes)
        self.speculate_s = 0.0
        self.recent: deque[bool] = deque(maxlen=self.WINDOW)  # clipping triggered, per recent step
        self.rollbacks = 0  # steps (or abandoned backward passes) whose speculation was rolled back
        self.publishing = False  # the backward running now publishes its speculated buckets
        self.publish_stream = side_stream(parts.device)  # those copies stay off the compute stream
        self.early: set[int] = set()  # speculated buckets already on the device (the worker adds)
        # Buckets whose device copy is a speculated step since rolled back, with what the device was given
        # (None: not kept; such a bucket is published again before anything compares with it).
        self.stale: dict[int, torch.Tensor | None] = {}
        self.early_published = 0  # buckets published during backward, over the schedule's life
        parts.arrivals.listen(self._on_bucket)

    @property
    def updates_during_backward(self) -> bool:  # type: ignore[override]
        """The next backward that ends a window speculates (not paused for clipping, or for its cost)."""
        return not self.paused

    @property
    def paused(self) -> bool:
        return sum(self.recent) >= self.PAUSE_TRIGGERS or not self.chooser.speculating

    # -- the snapshot, taken behind the forward -------------------------------------------------

    def before_forward(self) -> None:
        """Copy the state of every bucket whose snapshot is out of date, on the update worker, while the
        device runs the forward; buckets in the order backward produces their gradients."""
        self.chooser.forward_started()
        if self.mode != "snapshot" or self.paused or self.snapshotting is not None:
            return
        # A bucket speculated for a step that has not come keeps its snapshot: it is that step's rollback.
        due = [
            i
            for i, current in enumerate(self.snapshot_current)
            if not current and i not in self.speculated and i < self.parts.state.first_device_bucket
        ]
        if due:
            self.snapshotting = self.pipeline.worker.submit(self._take_snapshots, due)

    def _take_snapshots(self, indices: list[int]) -> None:
        buckets = self.parts.layout.buckets
        for index in indices:
            self.parts.state.snapshot(buckets[index].shard_range, self.snapshot)
            self.snapshot_current[index] = True

    def _snapshots_landed(self) -> None:
        """Wait for the snapshot behind the forward (before the state changes, or is read as the rollback)."""
        if self.snapshotting is not None:
            snapshotting, self.snapshotting = self.snapshotting, None
            snapshotting.result()

    def _state_changes(self, buckets: list[int] | None = None) -> None:
        """The state of these buckets (all: None) is about to change: their snapshot will be out of date."""
        self._snapshots_landed()
        for index in range(len(self.snapshot_current)) if buckets is None else buckets:
            self.snapshot_current[index] = False

    # -- during backward -----------------------------------------------------------------------

    def on_backward_start(self, step_follows: bool, publish_early: bool) -> None:
        self.take_back_speculation()  # speculated for a step that never came
        self.parts.publisher.wait()  # the last copies to the device read the buffers speculation writes
        self.armed = step_follows and not self.paused
        self.armed_this_step = self.armed_this_step or self.armed
        self.publishing = (
            self.armed and publish_early and self.publish_during_backward and self.parts.layout.world_size == 1
        )
        if self.armed:
            self.hparams = self.pipeline.hyperparams()
            self.multiplier = 1.0 / self.parts.control.loss_scale

    def on_backward_end(self) -> None:
        # Called once the gradient worker is idle: nothing is speculated or published after this.
        self.armed = self.publishing = False
        if self.early:  # the copies and checksums queued during backward: done before anything reads them
            self.parts.publisher.wait()

    def _on_bucket(self, bucket: Bucket, final: bool, nonfinite: bool) -> None:
        """Gradient worker: ``bucket``'s gradient was just accumulated. Speculate its step if it is final
        (every parameter's gradient of this pass is in, and the bucket will not be sent again) and finite."""
        parts, index = self.parts, bucket.index
        if index in self.speculated:
            raise RuntimeError(
                "A backward pass added gradient to a bucket whose optimizer step was already speculated. "
                "Call engine.begin_backward() before every backward pass (it takes unvalidated speculation back)."
            )
        if not self.armed or not final or nonfinite or parts.state.on_device(bucket):
            return
        runs = self.pipeline.plan_bucket(bucket, parts.grads.has_grad, self.multiplier, self.hparams)
        if self.mode == "undo" and not all(kernels.can_undo(run.hparams) for run in runs if run.hparams is not None):
            return
        start = time.perf_counter()
        window = bucket.shard_range
        if self.mode == "snapshot":
            waited = time.perf_counter()
            self._snapshots_landed()
            self.chooser.waited_for_snapshot(time.perf_counter() - waited)
            if not self.snapshot_current[index]:  # changed since the forward began (or none was taken)
                parts.state.snapshot(window, self.snapshot)
            self.snapshot_current[index] = False  # the step below changes the state
        out = None if self.out is None else self.out[window]
        self.pipeline.update_bucket(bucket, runs, parts.state.grad, out)
        self.speculated[index] = runs
        if self.publishing:
            self._publish_early(bucket, out)
        self.speculate_s += time.perf_counter() - start

    def _publish_early(self, bucket: Bucket, out: torch.Tensor | None) -> None:
        """Gradient worker: put the speculated bucket on the device while backward goes on."""
        for index in bucket.param_indices:
            # Before the copy, so a saved alias of the weights read after it raises torch's in-place error.
            torch.autograd.graph.increment_version(self.parts.params[index])
        with on_stream(self.publish_stream):
            self.pipeline.publish(bucket, out, pooled=False)  # waited for in on_backward_end
        self.early.add(bucket.index)
        self.early_published += 1

    # -- after backward ------------------------------------------------------------------------

    def apply(self, inputs: StepInputs, stats: StepStats) -> None:
        redo: list[int] = []
        if self.speculated:
            if inputs.multiplier != self.multiplier or self.pipeline.hyperparams() != self.hparams:
                redo = list(self.speculated)
            elif inputs.clamp_limit is not None:
                buckets = self.parts.layout.buckets
                grad = self.parts.state.grad
                redo = [i for i in self.speculated if _exceeds(grad[buckets[i].shard_range], inputs.clamp_limit)]
        triggered = inputs.clip_coef < 1.0 or bool(redo)
        if inputs.clamp_limit is not None and not self.speculated:
            triggered = triggered or inputs.scaled_grad_norm > inputs.clamp_limit
        self.recent.append(triggered)
        if redo:
            self._roll_back(redo)
            stats.rolled_back = True
        done = set(self.speculated)
        published = self.early  # all speculated still: a rolled-back bucket left it
        stats.speculated_fraction = sum(self.bucket_numel[i] for i in done) / max(1, sum(self.bucket_numel))
        stats.cpu_step_s = self.speculate_s
        self.speculate_s = 0.0
        self.speculated, self.early = {}, set()
        # The synchronous step for the rest; stale buckets are not in done, so they are updated again and
        # published.
        self._state_changes()
        clamp_if_asked(self.parts.grads, inputs)
        plan = self.pipeline.plan(inputs.has_grad, inputs.multiplier)
        update_s, stats.copy_back_s = self.pipeline.run(plan, done, self.out, published)
        stats.cpu_step_s += update_s
        stats.cpu_step_after_backward_s = update_s
        self.stale = {}
        self.chooser.step_done(self.armed_this_step)
        self.armed_this_step = False

    def on_skip(self, stats: StepStats) -> None:
        self.chooser.step_done(self.armed_this_step)
        self.armed_this_step = False
        if self.speculated or self.stale:
            stats.rolled_back = bool(self.speculated)
            self.settle()

    def on_weights_loaded(self) -> None:
        self._state_changes()

    def close(self) -> None:
        super().close()
        self._snapshots_landed()

    def published_chunk(self, bucket: Bucket) -> torch.Tensor | None:
        # A bucket published during backward and rolled back since: the device holds the speculated result.
        return self.stale.get(bucket.index)

    def before_param_writes_merge(self, buckets: list[int]) -> None:
        # A bucket written after its step was speculated is updated again from the written values.
        parts = self.parts
        parts.grads.wait()
        self._state_changes(buckets)  # the merge writes into these buckets' master
        written = [index for index in buckets if index in self.speculated]
        kept = {}
        if self.out is None:  # the device was given the master itself, which the rollback changes
            master, buckets = parts.state.master, parts.layout.buckets
            # in the device dtype, as the device holds it (fp32 parameters over a bf16 master)
            kept = {
                i: master[buckets[i].shard_range].to(parts.param_dtype, copy=True) for i in written if i in self.early
            }
        if written:
            self._roll_back(written, kept)

    def take_back_speculation(self) -> None:
        # Not settle() where nothing was speculated: it marks every snapshot out of date, and Lightning calls
        # zero_grad before each backward, after the snapshot behind the forward was taken; backward then took
        # it again, exposed (docs/benchmarks.md, "The ZeRO-2 share after Lightning's zero_grad stopped undoing
        # the snapshot").
        if self.speculated or self.stale:
            self.settle()

    def settle(self) -> None:
        """Take back speculation that was not validated (no step, or a skipped one). The state may be read or
        replaced after this (checkpoints, users' views of the moments): every snapshot is retaken."""
        self.parts.grads.wait()
        self._state_changes()
        if self.speculated:
            self._roll_back(list(self.speculated))
        self._republish_stale()
        self.speculate_s = 0.0

    def _republish_stale(self) -> None:
        """Give the device the master's rounding of every bucket rolled back after it was published."""
        parts, pool = self.parts, self.parts.publisher.pool
        for index in sorted(self.stale):
            bucket = parts.layout.buckets[index]
            out = pool.acquire() if pool is not None else None
            if out is not None:
                out[: bucket.shard_numel].copy_(parts.state.master[bucket.shard_range])
            self.pipeline.publish(bucket, out)
        self.stale = {}

    def _roll_back(self, buckets: list[int], kept: dict[int, torch.Tensor] | None = None) -> None:
        state = self.parts.state
        for index in buckets:
            window = self.parts.layout.buckets[index].shard_range
            if self.mode == "snapshot":
                state.restore(window, self.snapshot)
            else:
                for run in self.speculated[index]:
                    if run.hparams is None:
                        continue
                    run_window = slice(run.start, run.end)
                    kernels.adam_undo(
                        state.master[run_window],
                        state.grad[run_window],
                        state.exp_avg[run_window],
                        state.exp_avg_sq[run_window],
                        hparams=run.hparams,
                        step=run.step,
                        grad_scale=run.multiplier,
                        num_threads=self.parts.num_threads,
                    )
            del self.speculated[index]
            if index in self.early:
                self.early.discard(index)
                self.stale[index] = self.out[window] if self.out is not None else (kept or {}).get(index)
        self.rollbacks += 1

    # -- checkpoints and accounting --------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # The trigger history decides whether the next steps speculate; with "undo" a rolled-back step
        # differs from sync by rounding, so a bitwise resume needs it.
        return {"recent_triggers": [bool(t) for t in self.recent], "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent = deque((bool(t) for t in state.get("recent_triggers", ())), maxlen=self.WINDOW)
        self.rollbacks = int(state.get("rollbacks", 0))


def _exceeds(grad: torch.Tensor, limit: float) -> bool:
    return bool(grad.abs().amax() > limit) if grad.numel() else False
