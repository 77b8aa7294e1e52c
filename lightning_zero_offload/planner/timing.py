"""One optimizer step's time under each schedule, from the machine's rates (docs/planning.md, "The model")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_zero_offload.planner.machine import GB, Machine
from lightning_zero_offload.planner.machine.probes import ADAM_BYTES_PER_PARAM
from lightning_zero_offload.planner.offload_params import FsdpUnits, device_fraction, host_part, traffic
from lightning_zero_offload.planner.shape import LayoutSummary


@dataclass
class StepTime:
    """Seconds per optimizer step; ``transfer``, ``cpu_step`` and ``copy_back`` are the work, ``exposed``
    what of it the step waits for (the rest overlaps forward/backward)."""

    forward_backward: float
    transfer: float
    cpu_step: float
    copy_back: float
    exposed: float
    total: float
    bound_by: str


def step_time(
    layout: LayoutSummary,
    dtype: torch.dtype,
    schedule: str,
    m: Machine,
    threads: int,
    ranks_per_node: int,
    flops: float,
    micro: int,
    state_dtype: torch.dtype = torch.float32,
) -> StepTime:
    """One optimizer step's time under ``schedule`` (see docs/planning.md for the model). ``state_dtype``:
    the CPU state's; the Adam step and the gradient buffer move bytes of its size (bf16 state: half of fp32's,
    at the efficiency measured for its own kernel)."""
    # The device share's gradients stay on the device and its step runs there (at device bandwidth: left out).
    shard, element, world = layout.host_shard_numel, dtype.itemsize, layout.world_size
    state = state_dtype.itemsize
    buckets = layout.buckets
    bandwidth = m.rank_bandwidth(threads, ranks_per_node)
    forward_backward = flops / (m.device_tflops * 1e12)
    backward = forward_backward * 2 / 3
    collective = 0.0
    if world > 1 and m.interconnect_gbs:
        collective = element * layout.flat_numel * (world - 1) / world / (m.interconnect_gbs * GB)
    # per micro-batch: the gradient chunk crosses the bus, then is added into the gradient buffer
    # (overwrite: read 2-4 B, write the state's 2-4 B; later micro-batches also read the buffer)
    accumulate_bytes = (element + state) * shard + (micro - 1) * (element + 2 * state) * shard
    accumulate = accumulate_bytes / bandwidth + micro * buckets * m.call_overhead_s
    device_to_host = micro * (element * shard / (m.d2h_gbs * GB) + collective + buckets * m.link_latency_s)
    adam_bytes = ADAM_BYTES_PER_PARAM * state // 4  # read 4 state arrays, write 3
    efficiency = m.adam_efficiency
    if state_dtype == torch.bfloat16 and m.adam_bf16_state_efficiency is not None:
        efficiency = m.adam_bf16_state_efficiency
    cpu_step = shard * adam_bytes / (bandwidth * efficiency) + buckets * m.call_overhead_s
    copy_back = element * shard / (m.h2d_gbs * GB) + collective + buckets * m.link_latency_s
    transfer = device_to_host + accumulate
    if m.device_type == "cpu":
        # Forward/backward, copies and the CPU step all run on the same cores: nothing overlaps.
        exposed = transfer + cpu_step + copy_back
        total = forward_backward + exposed
    else:
        per_bucket = 1 / max(1, buckets)
        # Buckets stream during backward; what does not fit behind it, and the last bucket, is waited for.
        pipe = max(device_to_host, accumulate)
        tail = max(0.0, pipe - backward) + pipe * per_bucket
        if schedule == "sync":  # update bucket k+1 while bucket k is copied back
            exposed = tail + max(cpu_step, copy_back) + min(cpu_step, copy_back) * per_bucket
        elif schedule == "speculative":  # each bucket is updated as soon as its gradients are final
            host = accumulate + cpu_step  # what is left of it after backward overlaps the copy-back
            left = max(0.0, max(device_to_host, host) - backward) + host * per_bucket
            exposed = max(left, copy_back) + min(left, copy_back) * per_bucket
        else:  # delayed: step t's update runs during forward/backward of t+1; its result is swapped in
            exposed = tail + max(0.0, cpu_step - forward_backward) + copy_back
        total = forward_backward + exposed
    work = {
        "device compute": forward_backward,
        "host memory bandwidth": accumulate + cpu_step,
        "host-device link": device_to_host + copy_back - 2 * micro * collective,
        "interconnect": (micro + 1) * collective,
    }
    return StepTime(forward_backward, transfer, cpu_step, copy_back, exposed, total, max(work, key=work.get))


def step_time_params(
    units: FsdpUnits,
    dtype: torch.dtype,
    schedule: str,
    m: Machine,
    threads: int,
    ranks_per_node: int,
    flops: float,
    micro: int,
    state_dtype: torch.dtype,
    pinned: bool,
    device_share: float = 0.0,
) -> StepTime:
    """One optimizer step's time with ``offload_params=True`` (docs/planning.md, "Parameters offloaded too").

    Forward and backward each gather every unit (its shard up the link, then an all-gather), prefetching
    one unit ahead, so only what the compute cannot cover and the first unit are waited for. Gradients are
    reduced and copied down per unit; FSDP2 makes that copy synchronous in the thread that runs backward
    when a post-accumulate-grad hook is registered (the speculative step's), when the shard is added into
    an earlier micro-batch's gradient, or without pinned memory: the device then waits for every unit's
    reduce and copy (and the add). The CPU step (the ZeRO-2 mode's kernels over this rank's shard) runs
    after backward (sync), or per unit as its last gradient lands, behind the rest of the last backward
    (speculative). Nothing is copied back: the next forward gathers the updated shard (``copy_back`` 0).
    The device share's units neither cross the link nor step on the CPU; their step on the device is not
    modelled (a few milliseconds per GB of state at HBM bandwidth), and with one the speculative schedule's
    last unit, whose step no backward is left to hide, is the device's.
    """
    moved = traffic(units, dtype, state_dtype, micro, device_share)
    on_device = device_fraction(units, device_share)
    state, shard = state_dtype.itemsize, host_part(units.shard_numel, on_device)
    bandwidth = m.rank_bandwidth(threads, ranks_per_node)
    forward_backward = flops / (m.device_tflops * 1e12)
    collective = 0.0
    if units.world_size > 1 and m.interconnect_gbs:
        collective = (moved.all_gather + moved.reduce_scatter) / (m.interconnect_gbs * GB)
    latency = units.units * m.link_latency_s
    # one pass of gathers (forward's or backward's) and one of reduces, per micro-batch
    gather = moved.up / (2 * micro * m.h2d_gbs * GB) + latency
    reduce = moved.down / (micro * m.d2h_gbs * GB) + latency
    if collective:
        gather += moved.all_gather / (2 * micro * m.interconnect_gbs * GB)
        reduce += moved.reduce_scatter / (micro * m.interconnect_gbs * GB)
    accumulate = (micro - 1) * 3 * state * shard / bandwidth  # later micro-batches: read 2 shards, write 1
    efficiency = m.adam_efficiency
    if state_dtype == torch.bfloat16 and m.adam_bf16_state_efficiency is not None:
        efficiency = m.adam_bf16_state_efficiency
    cpu_step = shard * (ADAM_BYTES_PER_PARAM * state // 4) / (bandwidth * efficiency) + units.units * m.call_overhead_s
    transfer = micro * (2 * gather + reduce) + accumulate
    if m.device_type == "cpu":  # the same cores do everything: nothing overlaps
        exposed = transfer + cpu_step
    else:
        per_unit = 1 / max(1, units.units)
        forward_mb, backward_mb = forward_backward / 3 / micro, forward_backward * 2 / 3 / micro
        forward_wait = max(0.0, gather - forward_mb) + gather * per_unit
        blocking = micro if schedule == "speculative" or not pinned else micro - 1
        waits_for_copies = reduce + max(0.0, gather - backward_mb - reduce) + gather * per_unit
        overlapped = max(0.0, max(gather, reduce) - backward_mb) + (gather + reduce) * per_unit
        exposed = micro * forward_wait + blocking * waits_for_copies + (micro - blocking) * overlapped + accumulate
        if schedule == "speculative":
            last_backward = backward_mb + (reduce if blocking else 0.0)
            exposed += max(0.0, cpu_step - last_backward) + (0.0 if on_device else cpu_step * per_unit)
        else:
            exposed += cpu_step
    work = {
        "device compute": forward_backward,
        "host memory bandwidth": accumulate + cpu_step,
        "host-device link": moved.up / (m.h2d_gbs * GB) + moved.down / (m.d2h_gbs * GB),
        "interconnect": collective,
    }
    total = forward_backward + exposed
    return StepTime(forward_backward, transfer, cpu_step, 0.0, exposed, total, max(work, key=work.get))
