"""``device_share="auto"`` in the ZeRO-2 mode: the last buckets to keep on the device, chosen after the first step.

The ZeRO-2 mode can re-plan its layout at any step (engine/lifecycle.py), so "auto" waits for what the first
step measured instead of estimating it: the device memory its peak left free, its backward time and its CPU step
time. The CPU step of a bucket can start once its gradient has landed (``cpu_step="speculative"``); the buckets
whose gradients land last leave their step after backward, where nothing hides it. "auto" takes the fewest last
buckets onto the device that leave at most one bucket's step after backward (a bucket of the median size: a
parameter larger than a bucket is split across buckets; the speculative pipeline of :func:`exposed_after_backward`,
gradients taken to land in layout order, evenly over backward), and never more
state than :data:`AUTO_ACTIVATION_RESERVE` short of the device memory the first step's peak left free. Where
the target is out of reach (``cpu_step="sync"`` steps everything after backward), the most buckets that fit.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_zero_offload.engine.infra.collectives import least_over_ranks
from lightning_zero_offload.kernels.device import BF16_STATE_CHUNK, BF16_STATE_SCRATCH_BYTES

if TYPE_CHECKING:
    from lightning_zero_offload.engine.stats import StepStats
    from lightning_zero_offload.engine.step.cpu_state import CpuState
    from lightning_zero_offload.engine.step.layout import Layout

AUTO_ACTIVATION_RESERVE = 0.2  # of the device memory left free: never the share's (activations vary by batch)


@dataclass(frozen=True)
class ShareChoice:
    """What "auto" chose: the fraction to keep on the device (whole units or buckets within it), the parameters it
    puts there, and why, in the words the run's summary prints."""

    share: float
    params: int
    why: str


def exposed_after_backward(shards: Sequence[int], on_host: int, backward_s: float, step_s_per_element: float) -> float:
    """Seconds of host step left after backward when the first ``on_host`` buckets of ``shards`` (this rank's
    elements of each, in layout order: the order their gradients land, evenly over ``backward_s``) are stepped
    one after the other as they land."""
    total = sum(shards)
    finish = landed = 0.0
    for numel in shards[:on_host]:
        landed += numel
        finish = max(finish, backward_s * landed / max(1, total)) + step_s_per_element * numel
    return max(0.0, finish - backward_s)


def choose_bucket_share(
    shards: Sequence[int],
    numels: Sequence[int],
    backward_s: float,
    step_s_per_element: float,
    state_bytes_per_element: int,
    device_room: int,
    speculative: bool,
) -> ShareChoice:
    """The device share of the last buckets (``shards``: this rank's elements of each bucket, ``numels``: all
    ranks', in layout order), from the first step's ``backward_s`` and CPU step time per element, within
    ``device_room`` bytes (the reserve taken off already)."""
    total = sum(numels)
    one_bucket = step_s_per_element * statistics.median(shards)
    fitting = 0  # the most last buckets whose state the room holds
    while fitting < len(shards) and state_bytes_per_element * sum(shards[len(shards) - fitting - 1 :]) <= device_room:
        fitting += 1
    for kept in range(fitting + 1):
        on_host = len(shards) - kept
        if not on_host:
            return _choice(kept, numels, total, "every bucket")
        if speculative and exposed_after_backward(shards, on_host, backward_s, step_s_per_element) <= one_bucket:
            what = f"the fewest last buckets ({kept}) that leave at most one bucket's step after backward"
            return _choice(kept, numels, total, what)
    if speculative:
        why = "no share it takes leaves as little as one bucket's step after backward"
    else:
        why = "cpu_step='sync' steps every host bucket after backward"
    return _choice(fitting, numels, total, f"the most the device memory left free takes ({fitting} buckets): {why}")


def _choice(kept: int, numels: Sequence[int], total: int, why: str) -> ShareChoice:
    params = sum(numels[len(numels) - kept :]) if kept else 0
    # a hair above the fraction the kept buckets hold, so that the same buckets are chosen from it again
    share = min(1.0, (params + 0.5) / total) if params else 0.0
    return ShareChoice(share, params, f"auto: {params / 1e6:.1f}M parameters, {why}")


def auto_bucket_share(
    layout: Layout, state: CpuState, first_step: StepStats, speculative: bool, device: torch.device
) -> ShareChoice:
    """:func:`choose_bucket_share` from the first step's own backward and CPU step times and the device memory
    its peak left (free, or cached by this process, beyond the peak), the least any rank has."""
    if device.type == "cpu":
        return ShareChoice(0.0, 0, "auto: none, a CPU device is host memory")
    free, _ = torch.accelerator.get_memory_info(device)
    left = free + torch.accelerator.memory_reserved(device) - torch.accelerator.max_memory_allocated(device)
    (left,) = least_over_ranks([left], layout.world_size, device)  # every rank chooses alike
    scratch = BF16_STATE_SCRATCH_BYTES * min(BF16_STATE_CHUNK, max(b.shard_numel for b in layout.buckets))
    return choose_bucket_share(
        [b.shard_numel for b in layout.buckets],
        [b.numel for b in layout.buckets],
        first_step.backward_s,
        first_step.cpu_step_s / max(1, state.split),
        4 * state.dtype.itemsize,  # master, moments, gradient
        int((1 - AUTO_ACTIVATION_RESERVE) * left) - scratch,
        speculative,
    )
