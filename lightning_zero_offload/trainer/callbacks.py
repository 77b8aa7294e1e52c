"""``OffloadMetrics``: where each step's time goes, logged to any Lightning logger, and an end-of-fit summary.

Gradients never stay on the device under ``zero_offload`` (they stream to CPU buckets during
backward), so callbacks that read ``p.grad`` (grad-norm loggers in ``on_before_optimizer_step``) see
nothing. The global gradient norm is computed on the CPU anyway and logged here as
``offload/grad_norm``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_zero_offload.core import OffloadSession, ParamOffloadSession, hidden_fraction, training_session

_TIMINGS = ("backward", "transfer_wait", "cpu_step", "update_wait", "copy_back")  # the engine's StepStats
# What plain mixed-precision Adam keeps on the device per parameter: fp32 weights (4), fp32 grads (4),
# two fp32 Adam moments (8); the paper's fp16-weights + fp32-master variant also totals 16.
PLAIN_MIXED_ADAM_DEVICE_BYTES = 16


class OffloadMetrics(L.Callback):
    """Logs ``offload/*`` metrics after every optimizer step and prints a summary when fit ends.

    Added automatically by ``ZeroOffloadStrategy`` (``metrics=True``); add it yourself to change its
    arguments. Metrics: ``forward_ms`` (from ``on_train_batch_start``, or the end of the previous backward,
    to the start of each backward, summed over the accumulation window: forward, loss and Lightning's
    bookkeeping around them), ``step_ms`` (wall time of the optimizer step from the window's first
    ``on_train_batch_start`` to ``on_train_batch_end``; data loading not included), ``backward_ms``,
    ``transfer_wait_ms`` (gradient transfer not hidden behind
    backward), ``hidden_transfer_pct``, ``cpu_step_ms``, ``update_wait_ms`` (DPU: background update not
    hidden), ``copy_back_ms``, ``grad_norm``, ``loss_scale`` (fp16), ``skipped_steps``,
    ``speculated_fraction`` (``cpu_step="speculative"``: share of the parameters updated during backward
    this step) and ``rollbacks`` (speculated steps taken back so far: clipping triggered, overflow).

    Args:
        prog_bar: also show the CPU step time, gradient norm and (fp16) loss scale in the progress bar.
        summary: print the memory and time summary at the end of fit (rank 0).
    """

    def __init__(self, prog_bar: bool = True, summary: bool = True) -> None:
        self.prog_bar = prog_bar
        self.summary = summary
        self._seen_steps = 0
        self._totals: dict[str, float] = defaultdict(float)
        self._count = 0
        self._window_start: float | None = None  # first on_train_batch_start since the last optimizer step
        self._forward_from: float | None = None  # batch start or end of the last backward: forward runs from here
        self._forward_s = 0.0

    @staticmethod
    def _session(trainer: L.Trainer) -> OffloadSession | None:
        session = getattr(trainer.strategy, "session", None)
        return training_session(session) if isinstance(session, (OffloadSession, ParamOffloadSession)) else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        session = self._session(trainer)
        self._seen_steps = session.step_calls if session is not None else 0
        self._totals.clear()
        self._count = 0
        self._window_start = None
        self._forward_s = 0.0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._window_start is None:
            self._window_start = now
        self._forward_from = now

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
        if self._forward_from is not None:
            self._forward_s += time.perf_counter() - self._forward_from
            self._forward_from = None

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Manual optimization may run another forward before its next backward: that counts as forward too.
        self._forward_from = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._forward_from = None  # after the last backward of the batch: the optimizer step, not forward
        session = self._session(trainer)
        if session is None or session.step_calls == self._seen_steps:
            return  # no optimizer step in this batch (gradient accumulation)
        self._seen_steps = session.step_calls
        stats = session.last_step
        now = time.perf_counter()
        step_s = now - self._window_start if self._window_start is not None else 0.0
        forward_s, self._forward_s, self._window_start = self._forward_s, 0.0, None
        metrics = {"offload/forward_ms": 1e3 * forward_s}
        metrics.update({f"offload/{name}_ms": 1e3 * getattr(stats, f"{name}_s") for name in _TIMINGS})
        metrics["offload/step_ms"] = 1e3 * step_s
        metrics["offload/hidden_transfer_pct"] = 100.0 * stats.hidden_transfer_fraction
        metrics["offload/grad_norm"] = stats.grad_norm
        metrics["offload/skipped_steps"] = float(session.skipped_steps)
        metrics["offload/speculated_fraction"] = stats.speculated_fraction
        metrics["offload/rollbacks"] = float(session.rollbacks)
        if session.loss_scale is not None:
            metrics["offload/loss_scale"] = stats.loss_scale
        on_bar = {"offload/cpu_step_ms", "offload/grad_norm", "offload/loss_scale"} if self.prog_bar else set()
        for name, value in metrics.items():
            pl_module.log(name, value, prog_bar=name in on_bar, on_step=True, on_epoch=False, rank_zero_only=True)
        for name in _TIMINGS:
            self._totals[name] += getattr(stats, f"{name}_s")
        self._totals["forward"] += forward_s
        self._totals["step"] += step_s
        self._totals["transfer"] += stats.transfer_s
        self._totals["speculated_fraction"] += stats.speculated_fraction
        self._count += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        session = self._session(trainer)
        if self.summary and session is not None:
            rank_zero_info(format_summary(session, self._totals, self._count))


def format_summary(session: OffloadSession | ParamOffloadSession, totals: dict[str, float], steps: int) -> str:
    report = session.memory_report()
    resolved = session.resolved
    n = max(1, report["params"])
    world = session.world_size
    lines = [
        f"zero_offload: {report['params']:,} trainable parameters, {session.param_dtype} on {session.device}, "
        f"world size {world}, {resolved.cpu_threads} CPU thread(s) per rank",
    ]
    if resolved.offload_params:
        shards, grads, state = (report[f"host_{kind}_bytes"] for kind in ("shard", "grad", "state"))
        lines.append(
            f"  parameters offloaded (FSDP2): the device holds the blocks in flight; this rank's host holds "
            f"{shards / 2**20:.1f} MiB of parameter shards (the master weights), {grads / 2**20:.1f} MiB of gradients "
            f"and {state / 2**20:.1f} MiB of optimizer state ({(shards + grads + state) * world / n:.1f} B/param "
            "over all ranks)"
        )
        if shared := report["device_share_params"]:
            kept = sum(report[f"device_{kind}_bytes"] for kind in ("shard", "grad", "state"))
            lines.append(
                f"  device share: {shared:,} parameters ({shared / n:.0%}) "
                f"keep shards, gradients and state on the device and step there ({kept / 2**20:.1f} MiB on this rank)"
            )
    elif resolved.in_place:
        lines.append(
            f"  in place on the CPU (nothing to offload): the parameters are the fp32 master weights, "
            f"{report['host_state_bytes'] / 2**20:.1f} MiB with the Adam moments ({report['host_state_bytes'] / n:.1f} "
            "B/param); gradients stay where backward puts them, as in plain training"
        )
    else:
        device_param = report["device_param_bytes"] / n
        # gradient buckets, collectives' temporaries (the device share's state has a line of its own)
        buckets = report["device_total_bytes"] - report["device_param_bytes"] - report["device_state_bytes"]
        lines += [
            f"  device, model states: {device_param:.1f} B/param (parameters) + {buckets / 2**20:.1f} MiB of gradient "
            f"buckets, vs {PLAIN_MIXED_ADAM_DEVICE_BYTES} B/param for plain mixed-precision Adam "
            f"({PLAIN_MIXED_ADAM_DEVICE_BYTES / device_param:.0f}x less)",
            f"  CPU, this rank: {report['host_state_bytes'] / 2**20:.1f} MiB optimizer state in "
            f"{str(resolved.state_dtype).removeprefix('torch.')} "
            f"({report['host_state_bytes'] * world / n:.1f} B/param over all ranks) + "
            f"{report['host_staging_bytes'] / 2**20:.1f} MiB staging "
            f"({report['host_pinned_bytes'] / 2**20:.1f} MiB of host memory pinned)",
        ]
        if shared := report["device_share_params"]:
            lines.append(
                f"  device share: {shared:,} parameters ({shared / n:.0%}, the last buckets) keep master weights, "
                f"moments and gradients on the device and step there "
                f"({report['device_state_bytes'] / 2**20:.1f} MiB on this rank)"
            )
    # device_share="auto": the parameter-offload session's choice at setup, the ZeRO-2 engine's after a step (before
    # it, the share a short host made it start with)
    engine = session.engine
    choice = getattr(session, "share_choice", None) or getattr(engine, "share_choice", None)
    choice = choice or getattr(engine, "share_floor", None)
    if choice is not None and choice.why:
        lines.append(f"  device_share={choice.why}")
    elif resolved.device_share and not report["device_share_params"]:
        last = "unit (the root's own parameters, or a block)" if resolved.offload_params else "bucket (bucket_size_mb)"
        lines.append(
            f"  device share: none: device_share={resolved.device_share:g} holds less than the last {last}, "
            "which it takes whole; give a larger fraction"
        )
    if steps:
        per = {k: 1e3 * v / steps for k, v in totals.items()}
        hidden = 100 * hidden_fraction(totals["transfer"], totals["transfer_wait"])
        lines.append(
            f"  per optimizer step over {steps} steps ({per.get('step', 0.0):.1f} ms): forward "
            f"{per.get('forward', 0.0):.1f} ms, backward {per['backward']:.1f} ms, transfer wait "
            f"{per['transfer_wait']:.1f} ms ({hidden:.0f}% of transfers hidden), CPU step {per['cpu_step']:.1f} ms, "
            f"DPU wait {per['update_wait']:.1f} ms, copy-back {per['copy_back']:.1f} ms; "
            f"skipped steps {session.skipped_steps}"
        )
        lines.append(
            f"  CPU step schedule: {resolved.cpu_step}; {100 * totals['speculated_fraction'] / steps:.0f}% of the "
            f"parameters updated during backward on average, {session.rollbacks} rollback(s)"
        )
    return "\n".join(lines)
