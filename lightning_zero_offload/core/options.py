"""The options both front ends take, validated once and the same way: offload options, precision, timeout.

``make_offload_options`` is what ``ZeroOffloadStrategy(...)`` and ``ZeroOffloadFabricStrategy(...)`` call
with their keyword arguments; :data:`OPTIONS_DOC` documents those arguments for both classes.
"""

from __future__ import annotations

from dataclasses import fields
from datetime import timedelta
from typing import Any

import torch

from lightning_zero_offload.engine import LossScalerConfig, OffloadOptions
from lightning_zero_offload.engine.option_values import check_real
from lightning_zero_offload.engine.options import GROUPED_OPTION_NAMES, DelayedOptions, SpeculativeOptions

_GROUPS = {"loss_scaler": LossScalerConfig, "delayed": DelayedOptions, "speculative": SpeculativeOptions}
# The offload options as the front ends take them: OffloadOptions' fields, with the groups' (the loss
# scaler's and each schedule's settings) flattened to their own names.
OPTION_NAMES = (*(f.name for f in fields(OffloadOptions) if f.name not in _GROUPS), *GROUPED_OPTION_NAMES)


def make_offload_options(**arguments: Any) -> OffloadOptions:
    """The front ends' offload options (the names in :data:`OPTION_NAMES`) as validated ``OffloadOptions``.

    Options not given take ``OffloadOptions``' defaults; a name that is not an option raises ``TypeError``.
    """
    unknown = sorted(set(arguments) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"zero_offload has no option {', '.join(unknown)}; its options are {', '.join(OPTION_NAMES)}")
    grouped: dict[str, dict[str, Any]] = {group: {} for group in _GROUPS}
    for name, (group, field) in GROUPED_OPTION_NAMES.items():
        if name in arguments:
            grouped[group][field] = arguments.pop(name)
    return OffloadOptions(**{group: kind(**grouped[group]) for group, kind in _GROUPS.items()}, **arguments)


_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}
_ALIASES = {"bf16": "bf16-mixed", "16": "16-mixed", "32": "32-true"}
_ALTERNATIVES = {
    "bf16-true": "'bf16-mixed' (it already keeps bf16 weights on the device; fp32 master weights stay on the CPU)",
    "16-true": "'16-mixed' (it already keeps fp16 weights on the device; fp32 master weights stay on the CPU)",
    "64-true": "'32-true'",
    "transformer-engine": "'bf16-mixed'",
    "transformer-engine-float16": "'16-mixed'",
}


def resolve_precision(precision: str) -> tuple[str, torch.dtype]:
    """The canonical precision name and the dtype of the device parameters; unsupported names are refused
    with the supported alternative."""
    precision = _ALIASES.get(str(precision), str(precision))
    if precision not in _DTYPES:
        alternative = _ALTERNATIVES.get(precision)
        hint = f"use precision={alternative}" if alternative else f"choose one of {sorted(_DTYPES)}"
        raise ValueError(f"zero_offload does not support precision={precision!r}: {hint}.")
    return precision, _DTYPES[precision]


# About 31 years. timedelta itself ends near 8.6e13 s, but torch's C++ side counts in int64 micro- or
# nanoseconds and overflows long before that (gloo refuses timedelta.max as a negative timeout).
MAX_TIMEOUT_S = 1e9


def collective_timeout(timeout: timedelta | float | None) -> timedelta | None:
    """The ``timeout`` option as a timedelta (numbers are seconds, for config files), validated: a
    timedelta, seconds as an int or float, or None (torch's default)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    check_real(
        "timeout",
        seconds,
        f"of seconds in (0, {MAX_TIMEOUT_S:.0e}] (about 31 years), or a datetime.timedelta in that range",
        lambda s: 0 < s <= MAX_TIMEOUT_S,
    )
    return timedelta(seconds=seconds)


def coerced_precision(plugin_type: type, attribute: str) -> property:
    """A strategy's precision-plugin property that always holds a ``plugin_type``.

    Lightning builds a generic plugin from ``precision=`` and assigns it to the strategy; the offload step
    needs its own, so any other plugin assigned is replaced by ``plugin_type(plugin.precision)`` (which
    refuses unsupported precisions), and none set reads as ``"32-true"``.
    """

    def get(strategy: Any) -> Any:
        if getattr(strategy, attribute) is None:
            setattr(strategy, attribute, plugin_type("32-true"))
        return getattr(strategy, attribute)

    def set_(strategy: Any, plugin: Any) -> None:
        if plugin is not None and not isinstance(plugin, plugin_type):
            plugin = plugin_type(str(plugin.precision))
        setattr(strategy, attribute, plugin)

    return property(get, set_)


# What ``zero_offload`` names in Lightning's strategy registries (the Trainer's and Fabric's).
STRATEGY_DESCRIPTION = "ZeRO-Offload: fp32 master weights and Adam on the CPU, low-precision training on the device"

# The Args section of both front ends' docstrings (LightningCLI shows it as each option's help).
OPTIONS_DOC = """\
        bucket_size_mb: size of a gradient bucket on the device. Gradients leave the device a bucket at a
            time during backward and at most three buckets exist there; larger buckets mean fewer,
            more efficient transfers and collectives, smaller ones less device memory.
        pin_memory: page-lock the host staging buffers (CUDA only) so transfers are asynchronous and fast.
            Only bucket-sized buffers are pinned, never the master weights or the optimizer state.
        overlap: move and accumulate gradient buckets on a worker thread (and a side stream on CUDA) while
            backward continues, and publish bucket k while the CPU updates bucket k+1. ``False`` serialises
            everything. Default (None): on for an accelerator, off on a CPU device, where the worker would
            compete with backward for the same cores.
        cpu_threads: threads for the CPU Adam kernels. Default (None): on an accelerator the cores this
            process may use divided by the ranks on this node (``OMP_NUM_THREADS``, which torchrun sets to
            1, is not consulted); on a CPU device ``torch.get_num_threads()``. Capped at the usable cores.
        cpu_step: when the CPU optimizer step runs (docs/dpu.md). ``"sync"``: after backward, on the
            critical path. ``"speculative"``: each gradient bucket's step runs during backward, is validated
            after it (clipping, overflow) and corrected if needed; results equal ``"sync"``. ``"delayed"``:
            overlaps the next forward/backward, which sees one-step-stale weights (changes convergence).
            ``"auto"`` (default): ``"speculative"`` on an accelerator, ``"sync"`` on a CPU device, with
            ``cpu_state="bf16"`` (speculating it takes 6 more bytes of host memory per parameter) and with
            ``offload_params=True`` (12 more bytes per parameter with fp32 state).
        cpu_state: the dtype of the optimizer state on the CPU (docs/compact-state.md). ``"fp32"`` (default):
            fp32 master weights and moments, exact to torch's AdamW. ``"bf16"``: master weights, moments and
            gradient buffers in bf16, stochastically rounded (the same expected update as fp32), half the
            host memory per parameter and the device copy published as it is. Needs ``precision="bf16-mixed"``
            or ``"32-true"``; with ``cpu_step="speculative"`` the rollback is a snapshot.
        speculation_rollback: how ``cpu_step="speculative"`` takes a speculated bucket back when clipping
            triggers or a gradient overflows: ``"undo"`` inverts the Adam step algebraically (no extra memory;
            near sync while clipping scales a step mildly, far from it after a clipped spike), ``"snapshot"``
            copies the bucket's state before speculating (bitwise equal to sync; 12 bytes of host memory per
            parameter, 6 with ``cpu_state="bf16"``, where it is the only rollback). ``"auto"``: the snapshot
            (after a clipped spike the undo's moments lose precision to cancellation: docs/dpu.md).
        loss_scale_init: fp16 only: initial dynamic loss scale.
        loss_scale_growth_interval: fp16 only: overflow-free steps before the scale grows.
        loss_scale_growth_factor: fp16 only: factor by which the scale grows.
        loss_scale_backoff_factor: fp16 only: factor applied to the scale after ``loss_scale_hysteresis``
            overflowing steps (each overflowing step is skipped).
        loss_scale_hysteresis: fp16 only: overflows tolerated before the scale is lowered.
        loss_scale_min: fp16 only: the scale never goes below this.
        dpu_warmup_steps: with ``cpu_step="delayed"``, synchronous steps before the delayed update starts.
        dpu_weight_prediction: with ``cpu_step="delayed"``, run forward/backward on
            ``W_{t-1} + (W_{t-1} - W_{t-2})`` (the update still running predicted as a repeat of the last one)
            instead of ``W_{t-1}``. Costs no memory or bandwidth and narrows DPU's convergence gap without
            closing it (docs/dpu.md; the runs: docs/benchmarks.md, "DPU convergence").
            Needs a low-precision device copy ("bf16-mixed" or "16-mixed").
        checkpoint_format: ``"full"``: one file with the full fp32 weights and optimizer state (rank 0 writes).
            ``"sharded"``: a directory, each rank writes its own shard; resumable at any world size.
        max_consecutive_skipped_steps: raise :class:`~lightning_zero_offload.engine.failures.NonFiniteLossError`
            after this many optimizer steps in a row were skipped for inf/nan gradients (``None``: never). fp16
            also raises when a step overflows at ``loss_scale_min``. The default leaves room for fp16's loss
            scale to calibrate down from ``loss_scale_init`` (two skipped steps per halving).
        in_place_on_cpu: where nothing would be offloaded (a CPU device, ``"32-true"``, one process,
            ``cpu_step="sync"``), the parameters are the fp32 master weights and the step reads each gradient
            where backward left it: plain training's memory traffic, none of the offload path's copies.
            Default (None): exactly there. ``False``: always run the offload data path that an accelerator
            runs (on a CPU, its copies are real copies; useful to test it). ``True``: require it (an error
            says which condition is not met).
        offload_params: keep the parameters on the CPU too, sharded across ranks with torch FSDP2, each
            block's weights brought to the device just before it runs (docs/offload-params.md): the model is
            no longer limited by device memory, at about 2 bytes per parameter moved in each of forward and
            backward. The CPU step is this project's (the sharded parameter is the master). Also registered as
            ``strategy="zero_offload_params"``.
        device_share: with ``offload_params=True``, the fraction of the parameters (0 to 1) whose FSDP2 units keep
            their shards, gradients and optimizer state on the device and step there, chosen where gradients
            arrive last (the root's own parameters, then the first blocks): the host holds less, and the CPU
            step that cannot hide behind backward shrinks (docs/offload-params.md, "A device share"). Whole
            units, never more than the fraction. Results equal ``0``'s (fp32 state to fp32 rounding, bf16 state
            bitwise); checkpoints do not depend on it. ``"auto"``: chosen at setup, the fewest units that let the
            host hold the rest (with ``cpu_step="speculative"`` at least the last unit), within 80% of the device
            memory free beyond FSDP2's buffers; the summary says what it chose and why. Without
            ``offload_params`` (ZeRO-2), the last buckets, whole, keep master weights, moments and gradients on
            the device (a fraction, or ``"auto"``: chosen after the second step from its times and the device
            memory its peak left; not with ``cpu_step="delayed"``; docs/usage.md, "A device share").
        process_group_backend: torch.distributed backend (default: nccl on CUDA, gloo on CPU).
        timeout: how long any collective (the engine's, checkpointing's and Lightning's own) may wait for the
            other ranks before it raises: a ``timedelta`` or seconds. Default: torch's 30 minutes. A rank that
            fails does not wait for it: its peers are released as soon as it fails (docs/reliability.md).
        start_method: how Lightning starts the processes (as in ``DDPStrategy``).
"""

__all__ = [
    "OPTIONS_DOC",
    "OPTION_NAMES",
    "STRATEGY_DESCRIPTION",
    "coerced_precision",
    "collective_timeout",
    "make_offload_options",
    "resolve_precision",
]
