"""``device_share="auto"``: the parameter-offload mode's device share, chosen from the machine's memory at setup.

FSDP2 fixes where a unit keeps its shards when it wraps it, so the share is chosen before the first step, from
what the planner knows then: the host memory each share needs (its own pre-flight verdicts), the device memory
the share's state takes, and what is free on the device. The activations are not known before a step runs:
"auto" keeps :data:`AUTO_ACTIVATION_RESERVE` of the device memory free at setup beyond FSDP2's own buffers for
them, and puts on the device no more than the host needs. Within that room, it takes the fewest units, in the
order their gradients arrive last, that

- let the host hold the rest (training, setup and the checkpoint's save, as the pre-flight checks them), and
- with ``cpu_step="speculative"``, hold the unit whose gradient arrives last: its step is the one no backward
  is left to hide (the root's own parameters: the embedding, a tied head).

A model whose host need fits nowhere gets the most units the device takes, and the pre-flight's error. The
planner's ``--largest`` answers the converse question (the share that trains the largest model, activations
estimated), which a run can pass as a number.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_zero_offload.engine.infra.collectives import least_over_ranks
from lightning_zero_offload.engine.offload_params.placement import device_resident
from lightning_zero_offload.engine.options import OffloadOptions, resolve
from lightning_zero_offload.engine.step.device_share import AUTO_ACTIVATION_RESERVE, ShareChoice, parameters_text
from lightning_zero_offload.planner.machine import GB, Machine, format_gb, probes
from lightning_zero_offload.planner.memory import DEVICE_CONTEXT_BYTES
from lightning_zero_offload.planner.offload_params import (
    device_fraction,
    device_memory_params,
    fsdp_units,
    host_memory_params,
)
from lightning_zero_offload.planner.preflight import resident_bytes, zero2_share_that_fits
from lightning_zero_offload.planner.shape import ModelShape, layout_summary
from lightning_zero_offload.planner.verdicts import SETUP_BY_BLOCKS, SETUP_WHOLE, Check, host_checks

# The GPU's room at setup for the ZeRO-2 share a short host needs: its state and the weights, 80% of what is free.
START_ROOM = f"GPU memory at setup for the share a short host needs ({1 - AUTO_ACTIVATION_RESERVE:.0%} of it)"


def choose_device_share(
    shape: ModelShape,
    options: OffloadOptions,
    param_dtype: torch.dtype,
    world_size: int,
    local_world_size: int,
    device: torch.device,
    *,
    host_budget: int,
    device_free: int | None,
    resident: int = 0,
) -> ShareChoice:
    """The share "auto" runs with (see the module's docstring). ``host_budget``: host bytes this node's ranks may
    use (the pre-flight's); ``device_free``: device bytes free now on this rank's device (None: unknown);
    ``resident``: host bytes of the module as built (0: built on the meta device, materialized unit by unit)."""
    if device.type == "cpu":
        return ShareChoice(0.0, 0, "auto: none, a CPU device is host memory (nothing to move)")
    if device_free is None:
        return ShareChoice(0.0, 0, "auto: none, the device's free memory is not known")
    units = fsdp_units(shape, None, world_size)
    sizes = [units.root_params, *units.unit_sizes]
    prefixes = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    # whole units within the share: half a parameter over the prefix, so that rounding never drops the last one
    shares = [0.0] + [min(1.0, (prefix + 0.5) / units.params) for prefix in prefixes[1:]]
    base = replace(options, device_share=0.0)
    own = device_memory_params(units, param_dtype, resolve(base, device, param_dtype, world_size).state_dtype)
    room = int((1 - AUTO_ACTIVATION_RESERVE) * max(0, device_free - sum(own.values())))

    def host_fits(share: float) -> bool:
        config = resolve(replace(base, device_share=share), device, param_dtype, world_size, local_world_size)
        built = {"module_bytes": resident, "configure_model": not resident}
        need = host_memory_params(units, param_dtype, config, local_world_size, device.type, **built)
        setup = SETUP_WHOLE if resident else SETUP_BY_BLOCKS
        return all(c.fits for c in host_checks(need, options.checkpoint_format, host_budget, config.cpu_step, setup))

    def cost(share: float) -> int:
        held = device_memory_params(units, param_dtype, resolve(base, device, param_dtype).state_dtype, share)
        return held.get("device_share", 0) + held.get("device_share_step", 0)

    affordable = [k for k, share in enumerate(shares) if cost(share) <= room]
    host_k = next((k for k in affordable if host_fits(shares[k])), None)
    speculative = resolve(base, device, param_dtype, world_size).cpu_step == "speculative"
    tail_k = next((k for k, prefix in enumerate(prefixes) if prefix > 0), 0) if speculative else 0
    k = max(host_k if host_k is not None else affordable[-1], tail_k if tail_k in affordable else 0)
    params = prefixes[k]
    reasons = []
    if host_k is None:
        reasons.append("the host cannot hold the rest even so (the pre-flight says what to change)")
    elif host_k:
        reasons.append(f"the host ({format_gb(host_budget)} available) holds the rest with it, not with fewer")
    if speculative and k == tail_k and tail_k:
        reasons.append("the last unit's step, which no backward is left to hide, runs there")
    if not k:
        reasons.append("the host holds everything")
    fraction = device_fraction(units, shares[k])
    why = (
        f"auto: {parameters_text(params)} parameters ({fraction:.1%}) on the device, {format_gb(cost(shares[k]))} of "
        f"state there, of {format_gb(room)} it may take ({AUTO_ACTIVATION_RESERVE:.0%} of the "
        f"{format_gb(max(0, device_free - sum(own.values())))} free beyond FSDP2's buffers kept for activations): "
        + "; ".join(reasons)
    )
    return ShareChoice(shares[k], params, why)


def auto_device_share(
    module: nn.Module,
    options: OffloadOptions,
    param_dtype: torch.dtype,
    world_size: int,
    local_world_size: int,
    device: torch.device,
) -> ShareChoice:
    """:func:`choose_device_share` for ``module`` on this machine now: the host memory the pre-flight would allow
    this node's ranks, the device memory free on ``device``, each the least over the ranks (a collective where
    there are several), so that every rank makes the same choice. A module sharded already (an earlier setup)
    keeps its units where they are."""
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        held = sum(p.numel() for p in device_resident(module))
        share = min(1.0, (held + 0.5) / sum(p.numel() for p in module.parameters())) if held else 0.0
        kept = f"auto: {parameters_text(held)} parameters kept on the device where setup put them"
        return ShareChoice(share, held, kept)
    available, _ = probes.host_memory_limit()
    resident = resident_bytes(module)
    device_free = None
    if device.type != "cpu":
        free = torch.accelerator.get_memory_info(device)[0]
        available, device_free = least_over_ranks([available, free], world_size, device)
    return choose_device_share(
        ModelShape.of(module),
        options,
        param_dtype,
        world_size,
        local_world_size,
        device,
        host_budget=available + resident * local_world_size,  # the pre-flight's: setup releases the module
        device_free=device_free,
        resident=resident,
    )


def planned_share(
    shape: ModelShape, options: OffloadOptions, dtype: torch.dtype, machine: Machine, devices: int, world_size: int
) -> tuple[OffloadOptions, ShareChoice | None]:
    """``options`` with ``device_share="auto"`` made the number a run would choose on ``machine`` (its device
    empty but for the runtime, its host memory all available); other options as they are, and no choice."""
    if options.device_share != "auto":
        return options, None
    if not options.offload_params:  # the ZeRO-2 mode: the host's start at setup; the rest from a measured step
        share, params, room = zero2_start(shape, options, dtype, machine, devices, world_size)
        planned = (
            f"the {share:g} a run starts with: the smallest with which the host holds the rest" if share else "none"
        )
        if room is not None and not room.fits:
            planned += f" (the host needs a share whose {format_gb(room.need)} exceed {room.name})"
        why = (
            "auto: chosen after the second step, from its backward and CPU step times, when each bucket's gradient "
            f"landed and the device memory the peak left (planned here as {planned}; --device-share F plans a fraction)"
        )
        return replace(options, device_share=share), ShareChoice(share, params, why)
    device_free = None
    if machine.device_type != "cpu" and machine.device_memory_gb is not None:
        device_free = int(machine.device_memory_gb * GB) - DEVICE_CONTEXT_BYTES
    choice = choose_device_share(
        shape,
        options,
        dtype,
        world_size,
        devices,
        torch.device(machine.device_type),
        host_budget=int(machine.host_memory_gb * GB),
        device_free=device_free,
        resident=0 if shape.configure_model else shape.built_bytes,
    )
    return replace(options, device_share=choice.share), choice


def zero2_start(
    shape: ModelShape, options: OffloadOptions, dtype: torch.dtype, machine: Machine, devices: int, world_size: int
) -> tuple[float, int, Check | None]:
    """The ZeRO-2 share a run's pre-flight starts ``device_share="auto"`` with on ``machine`` (planner/preflight.py):
    the smallest with which the host holds the rest, where the GPU has room for its state and the weights within
    80% of its free memory. The share and its parameters (0: none), and the check of that room where the host
    needs a share (failed: the run starts with none, and the pre-flight refuses)."""
    if machine.device_type == "cpu" or machine.device_memory_gb is None:
        return 0.0, 0, None
    device = torch.device(machine.device_type)
    try:
        config = resolve(replace(options, device_share=0.0), device, dtype, world_size, devices)
    except ValueError:  # a combination the engine refuses: the plan says so
        return 0.0, 0, None
    resident = 0 if shape.configure_model else shape.built_bytes
    budget = int(machine.host_memory_gb * GB)  # the module as built not yet in use, as the planner's verdicts take it
    found = zero2_share_that_fits(
        config, options, shape, dtype, (world_size, devices), device, resident, shape.configure_model, budget, first=0
    )
    if not found or not found[0]:
        return 0.0, 0, None
    share, _, device_bytes = found
    free = int(machine.device_memory_gb * GB) - DEVICE_CONTEXT_BYTES
    room = Check(START_ROOM, device_bytes + dtype.itemsize * shape.params, int((1 - AUTO_ACTIVATION_RESERVE) * free))
    if not room.fits:
        return 0.0, 0, room
    return share, layout_summary(shape, options.bucket_size_mb, dtype, 1, share).device_shard_numel, room
