"""``cpu_step="delayed"``: Delayed Parameter Update (ZeRO-Offload's DPU), the CPU step behind the next forward.

After ``dpu_warmup_steps`` synchronous steps, the update of step t runs on the worker while step t+1
computes forward/backward on the weights of step t-1, and is swapped in at step t+1. The step is
hidden, but every gradient is computed on one-step-stale weights, which changes convergence
(docs/dpu.md). With weight prediction the device gets ``W_t + (W_t - W_{t-1})`` instead: the update
still running guessed as a repeat of the last one (free: the kernel has both values in registers).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from lightning_zero_offload.engine.layout import Bucket
from lightning_zero_offload.engine.memory import host_zeros
from lightning_zero_offload.engine.schedules.base import Schedule, StepInputs, apply_now
from lightning_zero_offload.engine.state import full_tensors, load_shard
from lightning_zero_offload.engine.stats import StepStats
from lightning_zero_offload.engine.update import Plan, make_plan, update_bucket

if TYPE_CHECKING:
    from lightning_zero_offload.engine.engine import OffloadEngine


class DelayedSchedule(Schedule):
    name = "delayed"

    def __init__(self, engine: OffloadEngine) -> None:
        super().__init__(engine)
        settings = engine.resolved.delayed  # checked by engine/options.resolve (prediction needs bf16/fp16)
        assert settings is not None
        self.warmup_steps = settings.warmup_steps
        self.extrapolate = 1.0 if settings.weight_prediction else 0.0
        # Two gradient buffers: backward t+1 fills one while the update of step t reads the other.
        shard = engine.layout.shard_numel
        self.grad_buffers = [engine.grad, host_zeros(shard, torch.float32, False)]
        # The low-precision result waiting to be swapped in (None for fp32 params: the master is published).
        low_precision = engine.publish_pool is not None
        self.next_params = host_zeros(shard, engine.param_dtype, False) if low_precision else None
        self.next_from_checkpoint = False  # next_params holds a loaded prediction (kept if saved again)
        self.pending: Future | None = None  # the update running on the worker
        self.publish_due = False  # a finished update waits to be swapped in
        self.last_update_s = 0.0
        self.active_this_step = False
        self.closed_state: dict[str, Any] | None = None
        # Whether the device holds the master rounded to its dtype (not the weights of a step ago, nor a
        # prediction): only then can a write to the parameters be told apart from the update.
        self.device_matches_master = True

    @property
    def active(self) -> bool:
        """Whether steps now run one step behind (after the warm-up)."""
        return self.engine.step_calls >= self.warmup_steps

    def before_step(self, stats: StepStats) -> None:
        self.active_this_step = self.active
        t = time.perf_counter()
        stats.update_wait_s = self.finish_pending_update()
        stats.copy_back_s = time.perf_counter() - t - stats.update_wait_s

    def apply(self, inputs: StepInputs, stats: StepStats) -> None:
        if not self.active_this_step:
            apply_now(self.engine, inputs, stats)
            return
        engine = self.engine
        if inputs.clamp_limit is not None:
            engine.clamp_grads(inputs.clamp_limit)
        plan = make_plan(engine, inputs.has_grad, inputs.multiplier)
        grad = engine.grad
        self.next_from_checkpoint = False
        self.pending = engine.updater.submit(self._update_all, plan, grad)
        self.device_matches_master = False
        engine.grad = self.grad_buffers[1] if grad is self.grad_buffers[0] else self.grad_buffers[0]
        engine.grads.cpu_grad = engine.grad
        stats.cpu_step_s = self.last_update_s  # the update that finished in the background (previous step)

    def on_skip(self, stats: StepStats) -> None:
        if self.active_this_step and self.extrapolate:
            # The device holds a prediction of this very update, which is not happening: go back to
            # the true weights (as plain DPU has them), so later steps and checkpoints agree.
            self.engine.refresh_device_params()
            self.device_matches_master = True

    @property
    def update_in_flight(self) -> bool:
        return self.pending is not None

    def published_chunk(self, bucket: Bucket) -> torch.Tensor | None:
        if self.device_matches_master:
            return None
        raise RuntimeError(
            "The parameters were written during fit (by a callback, load_state_dict or p.data = ...) while "
            "cpu_step='delayed' had the device one step behind the master weights: such a write cannot be "
            "told apart from the update in flight, and would be lost. Use cpu_step='sync' or 'speculative' "
            "(the same results as sync, with the CPU step hidden during backward) with code that writes "
            "parameters, or write them only during the first dpu_warmup_steps steps."
        )

    def _update_all(self, plan: Plan, grad: torch.Tensor) -> None:
        """Worker thread: update every bucket into the next-parameters buffer."""
        t = time.perf_counter()
        for bucket, runs in zip(self.engine.layout.buckets, plan):
            out = None if self.next_params is None else self.next_params[bucket.shard_range]
            update_bucket(self.engine, bucket, runs, grad, out, self.extrapolate)
        self.last_update_s = time.perf_counter() - t

    def settle(self) -> None:
        self.wait_update()

    def wait_update(self) -> float:
        """Wait for a running update (the CPU state is then complete); returns seconds waited."""
        if self.pending is None:
            return 0.0
        t = time.perf_counter()
        self.pending.result()
        self.pending = None
        self.publish_due = True
        return time.perf_counter() - t

    def finish_pending_update(self) -> float:
        """Wait for the update and swap its parameters in on the device."""
        waited = self.wait_update()
        if self.publish_due:
            self.engine.absorb_param_writes()  # before the swap-in overwrites them (refused: see published_chunk)
            for bucket in self.engine.layout.buckets:
                source = None if self.next_params is None else self.next_params[bucket.shard_range]
                self.engine.publish(bucket, source, pooled=False)
            self.engine.wait_publish()
            self.publish_due = False
            self.device_matches_master = not self.extrapolate
        return waited

    def on_weights_loaded(self) -> None:
        self.publish_due = False  # the device now holds the loaded master weights
        self.device_matches_master = True

    def sync(self) -> None:
        if self.extrapolate:
            self.wait_update()
            if self.publish_due:  # the true weights, not the prediction waiting in next_params
                self.engine.absorb_param_writes()
                self.engine.refresh_device_params()
                self.publish_due = False
                self.device_matches_master = True
        self.finish_pending_update()

    def state_dict(self) -> dict[str, Any]:
        """With an update pending: the stale device params in use (and, with weight prediction, the
        predicted params waiting to be swapped in, which the master alone cannot rebuild)."""
        if self.closed_state is not None:
            return self.closed_state
        self.settle()
        if not self.publish_due:
            return {}
        pending: dict[str, Any] = {"device_params": [p.detach().cpu().clone() for p in self.engine.params]}
        if self.extrapolate or self.next_from_checkpoint:
            pending["next_params"] = full_tensors(self.engine, self.next_params)
        return {"pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the stale device params; the saved update is swapped in at the next step."""
        pending = state.get("pending")
        if pending is None:
            return
        with torch.no_grad():
            for p, saved in zip(self.engine.params, pending["device_params"]):
                p.copy_(saved)
        if self.next_params is not None:
            self.next_from_checkpoint = "next_params" in pending
            if self.next_from_checkpoint:
                load_shard(self.engine, self.next_params, pending["next_params"])
            else:
                self.next_params.copy_(self.engine.master)
        self.engine.writes.record_all()  # the engine's own write: the device holds the stale weights again
        self.device_matches_master = False
        self.publish_due = True

    def abandon(self) -> None:
        super().abandon()
        self.pending = None
        self.publish_due = False
        self.closed_state = {}

    def close(self) -> None:
        # A delayed update not yet swapped in: keep the weights in use, so a checkpoint saved after
        # training can still resume bitwise.
        self.closed_state = self.state_dict()
