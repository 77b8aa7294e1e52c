"""``device_share="auto"`` in the ZeRO-2 mode: the last buckets to keep on the device, chosen after a measured step.

The ZeRO-2 mode can re-plan its layout at any step (engine/lifecycle.py), so "auto" waits for what a step measured
(the second: :data:`AUTO_MEASURED_STEP`) instead of estimating it: the device memory the peak so far left free,
its backward time, its CPU step time and when each bucket's gradient landed. The CPU step of a bucket can start
once its gradient has landed (``cpu_step="speculative"``); the buckets whose gradients land last leave their step
after backward, where nothing hides it. "auto" takes the fewest last buckets onto the device that leave at most one
bucket's step after backward (a bucket of the median size: a parameter larger than a bucket is split across
buckets; the speculative pipeline of :func:`exposed_after_backward`, each bucket stepped from when it landed: a
tied embedding's gradient, complete only when backward ends, lands last whatever its place), counting the step's
measured tail (validation, copy-back: no share removes it), and never more state than
:data:`AUTO_ACTIVATION_RESERVE` short of the device memory the peak so far left free. Where the target is out of
reach (``cpu_step="sync"`` steps everything after backward), the most buckets that fit. Its share starts at a
parameter's edge (a split parameter's buckets go together). Where the host holds the
rest only with a share, the pre-flight starts the engine with it (planner/preflight.py): "auto" keeps at least
those buckets.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lightning_zero_offload.engine.infra.collectives import least_over_ranks
from lightning_zero_offload.kernels.device import BF16_STATE_CHUNK, BF16_STATE_SCRATCH_BYTES

if TYPE_CHECKING:
    from lightning_zero_offload.engine.stats import StepStats
    from lightning_zero_offload.engine.step.cpu_state import CpuState
    from lightning_zero_offload.engine.step.landings import LandingClock
    from lightning_zero_offload.engine.step.layout import Layout

AUTO_ACTIVATION_RESERVE = 0.2  # of the device memory left free: never the share's (activations vary by batch)
# The step "auto" measures: the first is cold (buffers allocated, pages touched for the first time), and a gradient
# hook that allocates lands its bucket late by that.
AUTO_MEASURED_STEP = 2


@dataclass(frozen=True)
class ShareChoice:
    """What "auto" chose: the fraction to keep on the device (whole units or buckets within it), the parameters it
    puts there, and why, in the words the run's summary prints."""

    share: float
    params: int
    why: str


def exposed_after_backward(
    shards: Sequence[int],
    on_host: int,
    backward_s: float,
    step_s_per_element: float,
    leads: Sequence[float] | None = None,
) -> float:
    """Seconds of host work left after backward when the first ``on_host`` buckets of ``shards`` (this rank's
    elements of each, in layout order) are taken one after the other as they land, ``step_s_per_element`` each
    (the CPU step, and where known the gradient's transfer and accumulation before it): ``leads`` seconds
    before the end of backward (as timed), or without them evenly over ``backward_s`` in layout order."""
    if leads is None:
        total, landed = max(1, sum(shards)), itertools.accumulate(shards)
        lands = [backward_s * numel / total for numel in landed]
    else:
        lands = [max(0.0, backward_s - lead) for lead in leads]
    finish = 0.0
    for land, numel in sorted(zip(lands[:on_host], shards[:on_host])):
        finish = max(finish, land) + step_s_per_element * numel
    return max(0.0, finish - backward_s)


def choose_bucket_share(
    shards: Sequence[int],
    numels: Sequence[int],
    backward_s: float,
    step_s_per_element: float,
    state_bytes_per_element: int,
    device_room: int,
    speculative: bool,
    leads: Sequence[float] | None = None,
    transfer_s_per_element: float = 0.0,
    tail_s: float = 0.0,
    floor: int = 0,
    starts: Collection[int] | None = None,
) -> ShareChoice:
    """The device share of the last buckets (``shards``: this rank's elements of each bucket, ``numels``: all
    ranks', in layout order), from the measured step's ``backward_s``, CPU step and gradient transfer time per
    element and each bucket's landing ``leads`` before backward's end (:func:`exposed_after_backward`), within
    ``device_room`` bytes (the reserve taken off already). The bound is one (median) bucket's CPU step after
    backward, the step's own ``tail_s`` included; where that tail alone exceeds it, no CPU step left after
    backward. The last ``floor`` buckets stay whatever the rule and the room say (on the device already: the host
    holds the rest only without them). ``starts``: the buckets no parameter continues into from the one before
    (None: every bucket); the share starts at one of them (or at the floor), so that no parameter has its state
    on both sides, where ``optimizer.state[p]`` could show no live view of its moments."""
    total = sum(numels)
    one_bucket = step_s_per_element * statistics.median(shards)
    allowed = max(0.0, one_bucket - tail_s)  # of the host buckets' work after backward
    per_element = step_s_per_element + transfer_s_per_element  # what the gradient worker does with a bucket
    fitting = 0  # the most last buckets whose state the room holds
    while fitting < len(shards) and state_bytes_per_element * sum(shards[len(shards) - fitting - 1 :]) <= device_room:
        fitting += 1
    fitting = max(fitting, floor)
    whole = [k for k in range(floor, fitting + 1) if k == floor or starts is None or len(shards) - k in starts]
    fitting = whole[-1]
    for kept in whole:
        on_host = len(shards) - kept
        if not on_host:
            return _choice(kept, numels, total, "every bucket", floor)
        exposed = exposed_after_backward(shards, on_host, backward_s, per_element, leads)
        if speculative and exposed <= allowed:
            tail = f"the step's own {1e3 * tail_s:.1f} ms"
            if not allowed:
                left = f"no CPU step after backward ({tail} exceed one bucket's step)"
            else:
                left = "at most one bucket's step after backward" + (f" ({tail} included)" if tail_s else "")
            return _choice(kept, numels, total, f"the fewest last buckets ({kept}) that leave {left}", floor)
    if speculative:
        why = "no share it takes leaves as little as one bucket's step after backward"
    else:
        why = "cpu_step='sync' steps every host bucket after backward"
    why = f"the most the device memory left free takes ({fitting} buckets): {why}"
    return _choice(fitting, numels, total, why, floor)


def _choice(kept: int, numels: Sequence[int], total: int, why: str, floor: int) -> ShareChoice:
    params = sum(numels[len(numels) - kept :]) if kept else 0
    # a hair above the fraction the kept buckets hold, so that the same buckets are chosen from it again
    share = min(1.0, (params + 0.5) / total) if params else 0.0
    if floor:
        why += f"; {floor} of them on the device since setup, without which the host would not hold the rest"
    return ShareChoice(share, params, f"auto: {parameters_text(params)} parameters, {why}")


def parameters_text(params: int) -> str:
    """A parameter count as the summary prints it: in millions, or whole where that would read 0.0M."""
    return f"{params / 1e6:.1f}M" if params >= 10**5 else f"{params:,}"


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak :func:`room_after_peak` reads from here (an accelerator's; a CPU device keeps none)."""
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(device)


def room_after_peak(device: torch.device) -> int | None:
    """The device memory the peak so far left (free, or cached by this process, beyond the peak); None on a
    CPU device, whose memory is the host's."""
    if device.type == "cpu":
        return None
    free, _ = torch.accelerator.get_memory_info(device)
    return free + torch.accelerator.memory_reserved(device) - torch.accelerator.max_memory_allocated(device)


def auto_bucket_share(
    layout: Layout,
    state: CpuState,
    measured: StepStats,
    speculative: bool,
    device: torch.device,
    landings: LandingClock | None,
    keeps_its_share: bool = False,
) -> ShareChoice:
    """:func:`choose_bucket_share` from the ``measured`` step's CPU step and transfer times (the transfer: the
    gradients' copy to the host and accumulation there, which the gradient worker does before a bucket's step) and
    tail, the ``landings`` of its last backward pass (each bucket's lead before its end and the pass's length, on
    one clock: engine/step/landings.py; None: no bucket lands, in place) and the device memory the peak left (with
    ``keeps_its_share``, the buckets the state holds on the device now stay there, a short host's start: their state
    is in the peak, yet counted against the room: that covers the move's moment with one buffer's old and new device
    parts; the weights' device copy stays as it is); every rank from the same figures (the least room and backward
    time, the latest landings, the slowest step, transfer and tail), so all choose alike."""
    floor = len(layout.buckets) - state.first_device_bucket if keeps_its_share else 0
    left = room_after_peak(device)
    if left is None and not floor:
        return ShareChoice(0.0, 0, "auto: none, a CPU device is host memory")
    left = left or 0  # a CPU device: nothing beyond the floor given
    rate, transfer_rate = (seconds / max(1, state.split) for seconds in (measured.cpu_step_s, measured.transfer_s))
    leads, backward_s = ([], 0.0) if landings is None else (landings.leads, landings.pass_s)
    left, backward_s, minus_rate, minus_transfer_rate, minus_tail, *leads = least_over_ranks(
        [left, backward_s, -rate, -transfer_rate, -measured.tail_s, *leads], layout.world_size, device
    )
    scratch = BF16_STATE_SCRATCH_BYTES * min(BF16_STATE_CHUNK, max(b.shard_numel for b in layout.buckets))
    return choose_bucket_share(
        [b.shard_numel for b in layout.buckets],
        [b.numel for b in layout.buckets],
        backward_s,
        -minus_rate,
        4 * state.dtype.itemsize,  # master, moments, gradient
        int((1 - AUTO_ACTIVATION_RESERVE) * left) - scratch,
        speculative,
        leads,
        -minus_transfer_rate,
        -minus_tail,
        floor,
        starts={run.start for run in layout.bucket_runs()},
    )
