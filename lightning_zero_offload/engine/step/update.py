"""The CPU update of one bucket, and the synchronous update-and-publish pipeline every schedule builds on.

A step's work is fixed in a *plan* before any of it runs: for each bucket, the runs of this rank's
shard that one kernel call can update, each with its hyperparameters, step number and gradient factor.
Whichever schedule runs the plan (now, during backward, or in the background), the kernel sees the
same inputs, so the schedules differ in timing only.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.optimizer_support import read_hyperparams
from lightning_zero_offload.engine.step.layout import Bucket, Layout

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.cpu_state import CpuState
    from lightning_zero_offload.engine.step.publisher import Publisher


class Run(NamedTuple):
    """One kernel call's worth of work: a shard range and what to do with it."""

    start: int
    end: int
    hparams: kernels.AdamArgs | None  # None: the parameter got no gradient, leave it alone
    step: int
    multiplier: float


Plan = list[list[Run]]  # per bucket, in layout order


def read_all_hyperparams(optimizer: torch.optim.Optimizer) -> list[kernels.AdamArgs]:
    """The hyperparameters of every param group, read live (LR schedulers change them between steps).

    Validated at every step, with the group's index in every error: a callback that switches on a key the
    kernel does not implement (``amsgrad``) is refused at that step rather than ignored.
    """
    return [read_hyperparams(optimizer, group, index) for index, group in enumerate(optimizer.param_groups)]


class CpuUpdate:
    """What both update parts share (this one and engine/step/in_place.py's ``InPlaceUpdate``): the CPU state
    they update, each parameter's param group, and the optimizer whose groups hold the hyperparameters."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, group_of: list[int], state: CpuState, num_threads: int
    ) -> None:
        self.optimizer = optimizer  # hyperparameters are read live from its param groups
        self.group_of = group_of
        self.state = state
        self.num_threads = num_threads

    def hyperparams(self) -> list[kernels.AdamArgs]:
        return read_all_hyperparams(self.optimizer)


class UpdatePipeline(CpuUpdate):
    """The offload path's CPU update: plans, the update of one bucket, and update-and-publish.

    Built by the engine with the parts it acts on (the CPU state it updates, the publisher it hands
    each updated bucket to, the one worker thread updates run on); the schedules call it to run a
    plan now, during backward or in the background.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group_of: list[int],
        layout: Layout,
        state: CpuState,
        publisher: Publisher,
        worker: ThreadPoolExecutor,
        overlap: bool,
        num_threads: int,
    ) -> None:
        super().__init__(optimizer, group_of, state, num_threads)
        self.layout = layout
        self.publisher = publisher
        self.worker = worker
        self.overlap = overlap

    def bucket_runs(self, bucket: Bucket, has_grad: list[bool]) -> list[tuple[int, int, int]]:
        """Merge this rank's segments of ``bucket`` into maximal runs that one kernel call can update.

        Consecutive segments merge when they share param group, step count and gradient presence, which
        in the common case turns a bucket into one call per param group.
        """
        group_of, steps = self.group_of, self.state.steps
        runs: list[tuple[int, int, int]] = []
        for seg in bucket.segments:
            i = seg.param_index
            if runs:
                start, end, j = runs[-1]
                same = (
                    end == seg.shard_start
                    and group_of[i] == group_of[j]
                    and has_grad[i] == has_grad[j]
                    and steps[i] == steps[j]
                )
                if same:
                    runs[-1] = (start, seg.shard_end, j)
                    continue
            runs.append((seg.shard_start, seg.shard_end, i))
        return runs

    def plan_bucket(
        self, bucket: Bucket, has_grad: list[bool], multiplier: float, hparams: list[kernels.AdamArgs]
    ) -> list[Run]:
        """One bucket's runs with the step numbers they will get (the current counts + 1)."""
        group_of, steps = self.group_of, self.state.steps
        return [
            Run(start, end, hparams[group_of[i]] if has_grad[i] else None, steps[i] + 1, multiplier)
            for start, end, i in self.bucket_runs(bucket, has_grad)
        ]

    def plan(self, has_grad: list[bool], multiplier: float) -> Plan:
        """The whole step's plan; counts the step of every parameter that got a gradient.

        Taken on the training thread before any scheduler steps again, so an update that runs later (in
        the background) uses exactly the hyperparameters a synchronous one would have used.
        """
        hparams = self.hyperparams()
        plan = [self.plan_bucket(bucket, has_grad, multiplier, hparams) for bucket in self.layout.buckets]
        self.state.count_steps(index for index, got in enumerate(has_grad) if got)
        return plan

    def update_bucket(
        self,
        bucket: Bucket,
        runs: list[Run],
        grad: torch.Tensor,
        out: torch.Tensor | None,
        extrapolate: float = 0.0,
    ) -> None:
        """The CPU update of this rank's chunk of one bucket; writes the low-precision copy into ``out``."""
        state, base = self.state, bucket.shard_start
        for run in runs:
            window = slice(run.start, run.end)
            target = None if out is None else out[run.start - base : run.end - base]
            if run.hparams is None:  # no gradient this step: torch leaves the parameter alone
                if target is not None:
                    target.copy_(state.master[window])
                continue
            state.update(
                bucket, window, run.hparams, run.step, run.multiplier, grad, target, extrapolate, self.num_threads
            )

    def publish(self, bucket: Bucket, out: torch.Tensor | None, pooled: bool = True) -> None:
        """Copy this rank's updated chunk of ``bucket`` to the device and gather the other chunks.

        ``out`` holds the low-precision chunk (None: copy the master itself); ``pooled``: it came from
        the publisher's pool and goes back to it once copied.
        """
        source = self.state.master[bucket.shard_range] if out is None else out[: bucket.shard_numel]
        self.publisher.publish(bucket, source, out, pooled)

    def update_now(self, has_grad: list[bool], multiplier: float) -> tuple[float, float]:
        """Plan the step (counting it), then :meth:`run` all of it."""
        return self.run(self.plan(has_grad, multiplier))

    def run(
        self,
        plan: Plan,
        done: Collection[int] = (),
        done_out: torch.Tensor | None = None,
        published: Collection[int] = (),
    ) -> tuple[float, float]:
        """Update every bucket not in ``done`` and publish all of them but ``published``; returns (update,
        publish) seconds.

        Pipelined: the worker updates bucket k+1 while bucket k is published. Buckets in ``done`` were
        already updated (speculatively, during backward); their low-precision copy waits in ``done_out``
        (this rank's shard; None: publish the master itself). Their copies may still be running on
        return: ``publisher.wait()`` before writing ``done_out`` or the master again. Buckets in
        ``published`` (a subset of ``done``) are on the device already: published during backward.
        """
        pool = self.publisher.pool

        def update(bucket: Bucket, runs: list[Run]) -> tuple[torch.Tensor | None, float]:
            # The device share steps on the device and is published from its master.
            out = pool.acquire() if pool is not None and not self.state.on_device(bucket) else None
            t = time.perf_counter()
            try:
                self.update_bucket(bucket, runs, self.state.grad, out)
            except BaseException as error:
                if pool is not None:  # the later buckets' updates must not wait for buffers nobody returns
                    if out is not None:
                        pool.release(out)
                    pool.fail(error)
                raise
            return out, time.perf_counter() - t

        buckets = self.layout.buckets
        pairs = [(b, runs) for b, runs in zip(buckets, plan) if b.index not in done]
        # The worker blocks on the two-buffer pool, so it runs at most one bucket ahead of publishing.
        futures = {b.index: self.worker.submit(update, b, runs) for b, runs in pairs} if self.overlap else {}
        todo = {b.index: runs for b, runs in pairs}
        update_s = publish_s = 0.0
        for bucket in buckets:
            if bucket.index in published:
                continue
            if bucket.index in done:
                source = None if done_out is None else done_out[bucket.shard_range]
                t = time.perf_counter()
                self.publish(bucket, source, pooled=False)
                publish_s += time.perf_counter() - t
                continue
            # overlap=False is the measured baseline: update, then publish, one bucket at a time.
            future = futures.get(bucket.index)
            out, seconds = future.result() if future is not None else update(bucket, todo[bucket.index])
            update_s += seconds
            t = time.perf_counter()
            self.publish(bucket, out)
            publish_s += time.perf_counter() - t
        return update_s, publish_s
