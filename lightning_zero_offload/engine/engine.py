"""The offload engine: one training step's data path, from device gradients to updated device params.

```
backward (device)  -> GradientStreamer: hooks, buckets, [reduce-scatter], fp32 accumulate on CPU
step()             -> global norm + overflow (from the accumulate pass) -> clip x unscale factor
                   -> fused CPU Adam per bucket, writing the low-precision copy in the same pass
                   -> copy back bucket by bucket [all-gather] into the flat device parameter buffer
```

Device parameters are views into one flat low-precision buffer, so a bucket's update lands with a
single copy (or one all-gather). The CPU holds only this rank's shard: fp32 master, two moments and
an fp32 gradient buffer (16 bytes per owned parameter) plus a few bucket-sized staging buffers.
Plain torch: no Lightning imports, so it can be driven and tested without a Trainer.
"""

from __future__ import annotations

import math
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.adam import AdamHyperparams, check_optimizer, read_hyperparams
from lightning_zero_offload.engine.collectives import all_gather, all_reduce_sum, gather_host
from lightning_zero_offload.engine.failures import NonFinitePolicy, close_after_failure, refuse_after_failure
from lightning_zero_offload.engine.grads import GradientStreamer
from lightning_zero_offload.engine.layout import Bucket, Layout, build_layout
from lightning_zero_offload.engine.memory import (
    COLLECTIVE,
    BufferPool,
    HostToDevice,
    can_pin,
    device_empty,
    device_zeros,
    host_zeros,
    record_event,
    records_allocations,
    wait_event,
    worker_pool,
)
from lightning_zero_offload.engine.options import OffloadOptions, resolve_auto
from lightning_zero_offload.engine.scaler import DynamicLossScaler

LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass
class StepStats:
    """What the last optimizer step did and where its time went (seconds).

    ``transfer_s`` is the time spent moving buckets (on the device, timed with events) and accumulating
    them (CPU); ``transfer_wait_s`` the part of it that ran after backward ended (not hidden).
    In delayed mode ``cpu_step_s`` is the background update and ``update_wait_s`` the part of it the
    training thread waited for.
    """

    skipped: bool = False
    grad_norm: float = 0.0
    loss_scale: float = 1.0
    backward_s: float = 0.0
    transfer_s: float = 0.0
    transfer_wait_s: float = 0.0
    cpu_step_s: float = 0.0
    update_wait_s: float = 0.0
    copy_back_s: float = 0.0
    total_s: float = 0.0

    @property
    def hidden_transfer_fraction(self) -> float:
        if self.transfer_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.transfer_wait_s / self.transfer_s)


class _Run(NamedTuple):
    """One kernel call's worth of work: a shard range and what to do with it."""

    start: int
    end: int
    hparams: AdamHyperparams | None  # None: the parameter got no gradient, leave it alone
    step: int
    multiplier: float


class OffloadEngine:
    """Owns the CPU optimizer state of the trainable parameters of ``optimizer`` and updates them.

    Args:
        optimizer: the user's Adam/AdamW/CPUAdam; only its ``param_groups`` are used (read live).
        device: where forward/backward run; parameters are moved there in ``param_dtype``.
        param_dtype: dtype of the device parameters and gradients (bf16, fp16 or fp32).
        options: validated engine settings.
        process_group: ranks sharing the optimizer state (ZeRO-2); None for a single process.
        local_world_size: ranks on this node, for the default CPU thread count.
    """

    @records_allocations  # every buffer made here lands in self.ledger, read by memory_report
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
        resolved = resolve_auto(options, device, local_world_size)
        if resolved.cpu_step == "speculative":
            raise NotImplementedError("cpu_step='speculative' is being implemented; use 'sync' or 'delayed'")
        self.cpu_step = resolved.cpu_step
        self.overlap = resolved.overlap
        self.num_threads = resolved.cpu_threads
        self.scaler = DynamicLossScaler(options.loss_scaler) if param_dtype == torch.float16 else None

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
        pin = options.pin_memory and can_pin(device)
        shard = self.layout.shard_numel
        self.master = host_zeros(shard, torch.float32, False)
        self.exp_avg = host_zeros(shard, torch.float32, False)
        self.exp_avg_sq = host_zeros(shard, torch.float32, False)
        self.grad = host_zeros(shard, torch.float32, False)
        self.steps = [0] * len(self.params)
        self._original_dtypes = [p.dtype for p in self.params]
        self._load_shard(self.master, [p.detach() for p in self.params])

        self.flat_params = device_zeros(self.layout.flat_numel, param_dtype, device, "params")
        for slot, p in zip(self.layout.slots, self.params):
            view = self.flat_params[self.layout.slot_range(slot.index)]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view(slot.shape)

        max_shard = max(b.shard_numel for b in self.layout.buckets)
        low_precision = param_dtype in LOW_PRECISION
        self._publish_pool = BufferPool(2, max_shard, param_dtype, pin) if low_precision else None
        self._h2d = HostToDevice(device, max_shard, param_dtype, pin)  # pageable sources go through pinned staging
        self._pending_publish: list[torch.Event | None] = []
        # Delayed Parameter Update: a second gradient buffer (backward t+1 fills one while the update of
        # step t reads the other) and the low-precision result waiting to be swapped in.
        self._grad_buffers = [self.grad]
        self._next_params: torch.Tensor | None = None
        if options.dpu_weight_prediction and not low_precision:
            raise ValueError(
                "dpu_weight_prediction writes the predicted weights into the low-precision copy the device "
                f"uses, and these parameters are {param_dtype}: use precision='bf16-mixed' or '16-mixed', "
                "or set dpu_weight_prediction=False"
            )
        # With weight prediction the device gets W_t + (W_t - W_{t-1}): the update still running guessed
        # as a repeat of the last one (free: the kernel has both values in registers).
        self._extrapolate = 1.0 if options.dpu_weight_prediction else 0.0
        self._next_from_checkpoint = False  # _next_params holds a loaded prediction (kept if saved again)
        if self.cpu_step == "delayed":
            self._grad_buffers.append(host_zeros(shard, torch.float32, False))
            if low_precision:
                self._next_params = host_zeros(shard, param_dtype, False)
        self._updater = worker_pool("zero-offload-step", device)
        self._pending: Future | None = None
        self._publish_due = False
        self._last_update_s = 0.0
        self._backward_start: float | None = None
        self._backward_s = 0.0
        self.step_calls = 0
        self.grads = GradientStreamer(
            self.layout,
            self.params,
            self.grad,
            device,
            param_dtype,
            pin,
            self.num_threads,
            process_group,
            self.overlap,
        )
        self.last = StepStats(loss_scale=self.loss_scale)
        self.skipped_steps = 0
        self.nonfinite = NonFinitePolicy(options.max_consecutive_skipped_steps, self.scaler)
        self.failed = False  # closed after an exception, without gathering (see close_after_failure)
        self._closed = False

    # -- training ------------------------------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.loss_scale if self.scaler is not None else loss

    def begin_backward(self) -> None:
        self._backward_start = time.perf_counter()
        self.grads.begin()

    def finish_backward(self) -> None:
        if self._backward_start is not None:
            self._backward_s += time.perf_counter() - self._backward_start
            self._backward_start = None
        self.grads.finish_backward()

    @property
    def delayed(self) -> bool:
        """Whether steps now run one step behind (Delayed Parameter Update, after the warm-up)."""
        return self.cpu_step == "delayed" and self.step_calls >= self.options.dpu_warmup_steps

    def step(self, clip_norm: float | None = None, clip_value: float | None = None) -> StepStats:
        """Apply the accumulated gradients: clip, unscale, CPU Adam, copy back. Skips on overflow.

        Synchronous mode: bucket k is published (copied to the device, all-gathered) while the CPU
        updates bucket k+1. Delayed mode (DPU): the update of this step runs in the background and is
        published at the next call, so it overlaps the next forward/backward.

        ``clip_norm`` clips the global gradient norm (``torch.nn.utils.clip_grad_norm_``'s rule) and
        ``clip_value`` each gradient element (``clip_grad_value_``), both on the CPU, fused into the step.
        """
        _check_clip("clip_norm", clip_norm)
        _check_clip("clip_value", clip_value)
        start = time.perf_counter()
        self.grads.finish_backward()
        stats = StepStats(loss_scale=self.loss_scale, backward_s=self._backward_s)
        stats.transfer_wait_s, stats.transfer_s = self.grads.take_timings()
        self._backward_s = 0.0
        delayed = self.delayed
        t = time.perf_counter()
        stats.update_wait_s = self._finish_pending_update()  # a delayed update from the previous step
        stats.copy_back_s = time.perf_counter() - t - stats.update_wait_s
        self._wait_publish()
        sumsq, overflow, has_grad = self._global_grad_summary()
        scale = self.loss_scale
        stats.grad_norm = math.sqrt(sumsq) / scale if math.isfinite(sumsq) else math.inf
        self.step_calls += 1

        if overflow:
            self._skip(stats)
            if delayed and self._extrapolate:
                # The device holds a prediction of this very update, which is not happening: go back to
                # the true weights (as plain DPU has them), so later steps and checkpoints agree.
                self.refresh_device_params()
        else:
            plan = self._plan(has_grad, self._clip_and_unscale(stats.grad_norm, scale, clip_norm, clip_value))
            if self.scaler is not None:
                self.scaler.update(overflow=False)
            # LR schedulers warn unless optimizer.step() ran; the engine's step stands in for it.
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
            if delayed:
                grad = self.grad
                self._next_from_checkpoint = False
                self._pending = self._updater.submit(self._update_all, plan, grad)
                self.grad = self._grad_buffers[1] if grad is self._grad_buffers[0] else self._grad_buffers[0]
                self.grads.cpu_grad = self.grad
            else:
                stats.cpu_step_s, stats.copy_back_s = self._update_and_publish(plan)
        self.grads.new_window()
        if delayed and self._pending is not None:
            stats.cpu_step_s = self._last_update_s
        stats.total_s = time.perf_counter() - start
        self.last = stats
        self.nonfinite.after_step(stats.skipped, scale)
        return stats

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

    def _global_grad_summary(self) -> tuple[float, bool, list[bool]]:
        sumsq = sum(self.grads.bucket_sumsq)
        overflow = any(self.grads.bucket_nonfinite)
        has_grad = list(self.grads.has_grad)
        if self.layout.world_size > 1:
            summary = torch.tensor([sumsq, float(overflow), *map(float, has_grad)], dtype=torch.float64)
            summary = all_reduce_sum(summary, self.process_group, self.device)
            sumsq, overflow = float(summary[0]), bool(summary[1] > 0)
            has_grad = (summary[2:] > 0).tolist()
        overflow = overflow or not math.isfinite(sumsq)
        return sumsq, overflow, has_grad

    def _clip_and_unscale(
        self, grad_norm: float, scale: float, clip_norm: float | None, clip_value: float | None
    ) -> float:
        """The factor the kernel applies to the stored (loss-scaled) gradients."""
        if clip_value is not None:
            limit = clip_value * scale
            self.grads.for_each_grad_range(lambda g: g.clamp_(-limit, limit))
        clip_coef = 1.0
        if clip_norm is not None:
            # torch.nn.utils.clip_grad_norm_'s rule, so results match a plain run.
            clip_coef = min(1.0, clip_norm / (grad_norm + 1e-6))
        return clip_coef / scale

    def _plan(self, has_grad: list[bool], multiplier: float) -> list[list[_Run]]:
        """Everything the update needs, fixed now: runs, hyperparameters, step numbers, grad factor.

        Taken on the calling thread before any scheduler steps again, so a delayed update uses exactly
        the hyperparameters a synchronous one would have used.
        """
        hparams = [read_hyperparams(self.optimizer, g) for g in self.optimizer.param_groups]
        plan = []
        for bucket in self.layout.buckets:
            runs = []
            for start, end, index in self._runs(bucket, has_grad):
                hp = hparams[self.group_of[index]] if has_grad[index] else None
                runs.append(_Run(start, end, hp, self.steps[index] + 1, multiplier))
            plan.append(runs)
        for index, got in enumerate(has_grad):
            if got:
                self.steps[index] += 1
        return plan

    def _update_bucket(
        self, bucket: Bucket, runs: list[_Run], grad: torch.Tensor, out: torch.Tensor | None, extrapolate: float = 0.0
    ) -> None:
        """The CPU update of this rank's chunk of one bucket; writes the low-precision copy into ``out``."""
        base = bucket.shard_start
        for run in runs:
            window = slice(run.start, run.end)
            target = None if out is None else out[run.start - base : run.end - base]
            if run.hparams is None:  # no gradient this step: torch leaves the parameter alone
                if target is not None:
                    target.copy_(self.master[window])
                continue
            hp = run.hparams
            kernels.adam_step(
                self.master[window],
                grad[window],
                self.exp_avg[window],
                self.exp_avg_sq[window],
                step=run.step,
                lr=hp.lr,
                beta1=hp.beta1,
                beta2=hp.beta2,
                eps=hp.eps,
                weight_decay=hp.weight_decay,
                adamw_mode=hp.adamw_mode,
                maximize=hp.maximize,
                grad_scale=run.multiplier,
                param_out=target,
                extrapolate=extrapolate,
                num_threads=self.num_threads,
            )

    def _update_and_publish(self, plan: list[list[_Run]]) -> tuple[float, float]:
        """Synchronous step, pipelined: the worker updates bucket k+1 while bucket k is published."""
        low_precision = self._publish_pool is not None

        def update(bucket: Bucket, runs: list[_Run]) -> tuple[torch.Tensor | None, float]:
            out = self._publish_pool.acquire() if low_precision else None
            t = time.perf_counter()
            self._update_bucket(bucket, runs, self.grad, out)
            return out, time.perf_counter() - t

        pairs = list(zip(self.layout.buckets, plan))
        # The worker blocks on the two-buffer pool, so it runs at most one bucket ahead of publishing.
        futures = [self._updater.submit(update, b, runs) for b, runs in pairs] if self.overlap else None
        update_s = publish_s = 0.0
        for index, (bucket, runs) in enumerate(pairs):
            # overlap=False is the measured baseline: update, then publish, one bucket at a time.
            out, seconds = futures[index].result() if futures is not None else update(bucket, runs)
            update_s += seconds
            t = time.perf_counter()
            self._publish(bucket, out)
            publish_s += time.perf_counter() - t
        return update_s, publish_s

    def _update_all(self, plan: list[list[_Run]], grad: torch.Tensor) -> None:
        """Delayed step (worker thread): update every bucket into the next-parameters buffer."""
        t = time.perf_counter()
        for bucket, runs in zip(self.layout.buckets, plan):
            out = None if self._next_params is None else self._next_params[bucket.shard_range]
            self._update_bucket(bucket, runs, grad, out, self._extrapolate)
        self._last_update_s = time.perf_counter() - t

    def wait_update(self) -> float:
        """Wait for a delayed update still running (the CPU state is then complete); returns seconds waited."""
        if self._pending is None:
            return 0.0
        t = time.perf_counter()
        self._pending.result()
        self._pending = None
        self._publish_due = True
        return time.perf_counter() - t

    def _finish_pending_update(self) -> float:
        """Wait for the delayed update and swap its parameters in on the device."""
        waited = self.wait_update()
        if self._publish_due:
            for bucket in self.layout.buckets:
                source = None if self._next_params is None else self._next_params[bucket.shard_range]
                self._publish(bucket, source, pooled=False)
            self._wait_publish()
            self._publish_due = False
        return waited

    def sync(self) -> None:
        """Make the device parameters fully up to date (before evaluation, or at the end of training)."""
        if self._extrapolate:
            self.wait_update()
            if self._publish_due:  # the true weights, not the prediction waiting in _next_params
                self.refresh_device_params()
        self._finish_pending_update()
        self._wait_publish()

    def _runs(self, bucket: Bucket, has_grad: list[bool]) -> list[tuple[int, int, int]]:
        """Merge this rank's segments into maximal runs that one kernel call can update.

        Consecutive segments merge when they share param group, step count and gradient presence,
        which in the common case turns a bucket into one call per param group.
        """
        runs: list[tuple[int, int, int]] = []
        for seg in bucket.segments:
            i = seg.param_index
            if runs:
                start, end, j = runs[-1]
                same = (
                    end == seg.shard_start
                    and self.group_of[i] == self.group_of[j]
                    and has_grad[i] == has_grad[j]
                    and self.steps[i] == self.steps[j]
                )
                if same:
                    runs[-1] = (start, seg.shard_end, j)
                    continue
            runs.append((seg.shard_start, seg.shard_end, i))
        return runs

    def _publish(self, bucket: Bucket, out: torch.Tensor | None, pooled: bool = True) -> None:
        """Copy this rank's updated chunk of ``bucket`` to the device and gather the other chunks.

        ``out`` holds the low-precision chunk (None: copy the fp32 master itself).
        """
        source = self.master[bucket.shard_range] if out is None else out[: bucket.shard_numel]
        target = self.flat_params[bucket.flat_start : bucket.flat_start + bucket.padded_numel]
        if self.layout.world_size > 1:
            chunk = device_empty(bucket.shard_numel, self.param_dtype, self.device, COLLECTIVE, self.ledger)
            self._h2d.copy(chunk, source)
            all_gather(target, chunk, self.process_group)
        else:
            self._h2d.copy(target, source)
        event = record_event(self.device)
        if out is not None and pooled:
            self._publish_pool.release(out, event)
        else:
            self._pending_publish.append(event)  # the copy reads host memory that will change: wait before then

    def _wait_publish(self) -> None:
        events, self._pending_publish = self._pending_publish, []
        for event in events:
            wait_event(event)

    def refresh_device_params(self) -> None:
        """Write the master weights (rounded to the device dtype) into the device parameters."""
        for bucket in self.layout.buckets:
            out = self._publish_pool.acquire() if self._publish_pool is not None else None
            if out is not None:
                out[: bucket.shard_numel].copy_(self.master[bucket.shard_range])
            self._publish(bucket, out)
        self._wait_publish()
        self._publish_due = False

    def pending_state(self) -> dict[str, Any] | None:
        """What a checkpoint needs to resume a delayed run bitwise: the stale device params in use
        (and, with weight prediction, the predicted params waiting to be swapped in).

        None when nothing is pending. Waits for a running update first, so the CPU state is complete.
        """
        self.wait_update()
        if not self._publish_due:
            return None
        if self._closed:
            return self._pending_at_close
        state = {"device_params": [p.detach().cpu().clone() for p in self.params]}
        if self._extrapolate or self._next_from_checkpoint:
            # the predicted weights to swap in next (the master alone cannot rebuild them)
            state["next_params"] = self._full_tensors(self._next_params)
        return state

    def load_pending_state(self, state: dict[str, Any]) -> None:
        """Restore the stale device params; the saved update is swapped in at the next step."""
        with torch.no_grad():
            for p, saved in zip(self.params, state["device_params"]):
                p.copy_(saved)
        if self._next_params is not None:
            self._next_from_checkpoint = "next_params" in state
            if self._next_from_checkpoint:
                self._load_shard(self._next_params, state["next_params"])
            else:
                self._next_params.copy_(self.master)
        self._publish_due = True

    # -- state in and out ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides weights and moments to resume bitwise: the step count, the
        loss scaler and the schedule's pending state (plain tensors and numbers: ``weights_only`` loads)."""
        state: dict[str, Any] = {"step_calls": self.step_calls, "cpu_step": self.cpu_step}
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        pending = self.pending_state()
        if pending is not None:
            state["pending"] = pending
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after the weights and the optimizer state have been loaded).

        A pending delayed update is restored whatever this run's schedule: the device then computes on
        the stale weights for one step, as the saved run would have.
        """
        self.step_calls = int(state.get("step_calls", 0))
        if state.get("loss_scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        if state.get("pending") is not None:
            self.load_pending_state(state["pending"])

    def _load_shard(self, shard: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Copy this rank's part of full per-parameter tensors into a flat shard buffer."""
        for bucket in self.layout.buckets:
            for seg in bucket.segments:
                flat = tensors[seg.param_index].reshape(-1)
                shard[seg.shard_start : seg.shard_end].copy_(flat[seg.param_start : seg.param_start + seg.numel])

    def _full_tensors(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Assemble full per-parameter fp32 tensors from every rank's shard (a collective if sharded)."""
        refuse_after_failure(self, "full weights and optimizer state")
        full: list[torch.Tensor | None] = [None] * len(self.params)
        for bucket in self.layout.buckets:
            chunk = shard[bucket.shard_range]
            whole = gather_host(chunk, self.process_group, self.device) if self.layout.world_size > 1 else chunk
            for index in bucket.param_indices:
                slot = self.layout.slots[index]
                full[index] = whole[slot.bucket_offset : slot.bucket_offset + slot.numel].view(slot.shape).clone()
        return full  # type: ignore[return-value]

    def master_params(self) -> list[torch.Tensor]:
        """Full fp32 master weights, one tensor per trainable parameter (collective when sharded)."""
        self.wait_update()
        self._wait_publish()
        return self._full_tensors(self.master)

    def load_master_params(self, tensors: list[torch.Tensor]) -> None:
        for p, t in zip(self.params, tensors):
            if t.shape != p.shape:
                raise ValueError(f"master weight of shape {tuple(t.shape)} does not fit parameter {tuple(p.shape)}")
        self.wait_update()
        self._wait_publish()
        self._load_shard(self.master, [t.float() for t in tensors])
        self.refresh_device_params()

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer state in ``torch.optim.AdamW``'s format (full tensors, collective when sharded)."""
        self.wait_update()
        exp_avg = self._full_tensors(self.exp_avg)
        exp_avg_sq = self._full_tensors(self.exp_avg_sq)
        state: dict[int, dict[str, torch.Tensor]] = {}
        for index, torch_index in enumerate(self.torch_index):
            if self.steps[index] > 0:
                state[torch_index] = {
                    "step": torch.tensor(float(self.steps[index]), dtype=torch.float32),
                    "exp_avg": exp_avg[index],
                    "exp_avg_sq": exp_avg_sq[index],
                }
        return {"state": state, "param_groups": self.param_groups_state()}

    def param_groups_state(self) -> list[dict[str, Any]]:
        """The optimizer's hyperparameters, numbered as in ``torch.optim.Optimizer.state_dict``."""
        groups = []
        counter = 0
        for group in self.optimizer.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = list(range(counter, counter + len(group["params"])))
            counter += len(group["params"])
            groups.append(saved)
        return groups

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's flat fp32 master and moments, as stored in a sharded checkpoint."""
        refuse_after_failure(self, "sharded checkpoint")
        self.wait_update()
        self._wait_publish()
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state in torch Adam/AdamW format (from this engine, torch, or CPUAdam)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optimizer.param_groups) or any(
            len(saved["params"]) != len(group["params"]) for saved, group in zip(groups, self.optimizer.param_groups)
        ):
            raise ValueError(
                "The checkpoint's optimizer has a different number of param groups or parameters per group than "
                "the one returned by configure_optimizers; build the optimizer the same way as when it was saved"
            )
        state = {int(k): v for k, v in state_dict["state"].items()}
        exp_avg, exp_avg_sq = [], []
        for index, torch_index in enumerate(self.torch_index):
            entry = state.get(torch_index)
            shape = self.params[index].shape
            if entry is None:
                self.steps[index] = 0
                exp_avg.append(torch.zeros(shape))
                exp_avg_sq.append(torch.zeros(shape))
                continue
            if entry["exp_avg"].shape != shape:
                raise ValueError(
                    f"optimizer state for parameter {torch_index} has shape {tuple(entry['exp_avg'].shape)}, "
                    f"the parameter has {tuple(shape)}"
                )
            self.steps[index] = int(float(entry["step"]))
            exp_avg.append(entry["exp_avg"].float())
            exp_avg_sq.append(entry["exp_avg_sq"].float())
        self._load_shard(self.exp_avg, exp_avg)
        self._load_shard(self.exp_avg_sq, exp_avg_sq)
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k != "params"})

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
        ``after_failure``: issue no collective (the other ranks may be gone); see ``close_after_failure``.
        """
        if self._closed:
            return
        if after_failure:
            close_after_failure(self)
            return
        self.wait_update()
        self._updater.shutdown(wait=True)
        self.grads.close()
        # A delayed update not yet swapped in: keep the weights in use, so a checkpoint saved after
        # training can still resume bitwise.
        self._pending_at_close = self.pending_state()
        for p, weight, dtype in zip(self.params, self.master_params(), self._original_dtypes):
            p.data = weight.to(dtype)
        self.flat_params = self.flat_params.new_empty(0)
        self._closed = True


def _check_clip(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
