"""Whether a configuration fits: each memory requirement checked against what the machine has, for
every schedule and checkpoint format, with the configuration the engine would resolve."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from lightning_zero_offload.engine.options import OffloadOptions, Resolved, resolve
from lightning_zero_offload.planner.machine import GB, Machine
from lightning_zero_offload.planner.memory import (
    ALLOCATOR_OVERHEAD,
    CHECKPOINT_FORMATS,
    SCHEDULES,
    Activations,
    HostMemory,
    activation_estimate,
    activation_room,
    device_memory,
    device_runtime_bytes,
    host_memory,
)
from lightning_zero_offload.planner.offload_params import (
    FsdpUnits,
    device_memory_params,
    fsdp_units,
    host_memory_params,
    initialized_unit_bytes,
)
from lightning_zero_offload.planner.shape import LayoutSummary, ModelShape, layout_summary

EXACT_SCHEDULES = ("sync", "speculative")  # same result as a plain optimizer step; delayed uses stale weights
SETUP = "host RAM, setup (the module as built + the engine's state)"
# A model built in configure_model (either mode); offload_params: one built whole before fit.
SETUP_BY_BLOCKS = "host RAM, setup (configure_model: the engine's buffers + one block whole in fp32)"
SETUP_WHOLE = "host RAM, setup (the module built whole on every rank: build it in configure_model)"


@dataclass
class Check:
    """One memory requirement against what the machine has (``available`` None: not known, not checked)."""

    name: str
    need: int
    available: int | None

    @property
    def fits(self) -> bool:
        return self.available is None or self.need <= self.available


@dataclass
class Verdict:
    """Whether one configuration (CPU-step schedule and checkpoint format) fits host and device memory."""

    schedule: str
    checkpoint_format: str
    checks: list[Check]

    @property
    def fits(self) -> bool:
        return all(c.fits for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.fits]


def host_checks(
    host: HostMemory, checkpoint_format: str, available: int | None, schedule: str = "", setup: str = SETUP
) -> list[Check]:
    """Host RAM per node at each moment of a run: steady state, engine setup (named ``setup``), checkpoint save."""
    steady = "host RAM, training" + (" (with delayed's second gradient buffer)" if schedule == "delayed" else "")
    return [
        Check(steady, host.steady_per_node, available),
        Check(setup, host.setup_per_node, available),
        Check(f'host RAM, saving a "{checkpoint_format}" checkpoint', host.save_per_node(checkpoint_format), available),
    ]


@dataclass
class Evaluation:
    """Memory of one configuration of nodes, model size, micro-batch and activation checkpointing."""

    layout: LayoutSummary
    host: dict[str, HostMemory]
    device_states: dict[str, int]
    device_total: int  # model states + frozen parameters + activations + the runtime
    activations: Activations | None
    verdicts: dict[str, Verdict]
    resolved: dict[str, Resolved]
    device_runtime: int = 0  # the CUDA context and the allocator's overhead (0 on a CPU device)
    activation_room: int | None = None  # activation bytes the device has room for (None: its memory is not known)
    units: FsdpUnits | None = None  # offload_params: FSDP2's units (None: the ZeRO-2 mode)

    @property
    def fits(self) -> bool:
        return any(v.fits for v in self.verdicts.values())

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules evaluated: all three, or with offload_params or a device share the exact ones (delayed is
        refused)."""
        return tuple(self.resolved)


def resolve_for(options: OffloadOptions, machine: Machine, dtype: torch.dtype, world: int, ranks: int) -> Resolved:
    """What the engine would run with on ``machine`` (its cores, not this process's)."""
    cores = machine.cpu_cores
    device = torch.device(machine.device_type)
    return resolve(options, device, dtype, world, ranks, cores=cores, torch_threads=machine.torch_threads or cores)


def schedule_options(options: OffloadOptions, schedule: str) -> OffloadOptions:
    """``options`` with ``cpu_step=schedule``, as the planner evaluates each schedule. ``in_place_on_cpu=True``
    requires the sync schedule in place; the others, which never run in place, are planned without it."""
    in_place = None if options.in_place_on_cpu and schedule != "sync" else options.in_place_on_cpu
    return replace(options, cpu_step=schedule, in_place_on_cpu=in_place)


def evaluate(
    shape: ModelShape,
    dtype: torch.dtype,
    machine: Machine,
    devices: int,
    num_nodes: int,
    options: OffloadOptions,
    batch_size: int,
    seq_len: int,
    n_layer: int | None,
    checkpointing: bool,
) -> Evaluation:
    world = devices * num_nodes
    zero2_share = 0.0 if options.offload_params else options.fixed_device_share  # the last buckets on the device
    layout = layout_summary(shape, options.bucket_size_mb, dtype, world, zero2_share)
    # cpu_step="delayed" takes neither parameter offload nor a device share
    schedules = EXACT_SCHEDULES if options.offload_params or zero2_share else SCHEDULES
    configs = {s: resolve_for(schedule_options(options, s), machine, dtype, world, devices) for s in schedules}
    units = None
    setup = SETUP
    if options.offload_params:
        units = fsdp_units(shape, n_layer, world)
        host = {
            s: host_memory_params(
                units,
                dtype,
                configs[s],
                devices,
                machine.device_type,
                module_bytes=shape.built_bytes,
                configure_model=shape.configure_model,
            )
            for s in schedules
        }
        states = device_memory_params(units, dtype, configs["sync"].state_dtype, options.device_share)
        once = states["root_params"] + states.get("device_share", 0) + states.get("device_share_step", 0)
        cycled = sum(states.values()) - once  # gathered, allocated and freed unit by unit, every step
        setup = SETUP_BY_BLOCKS if shape.configure_model else SETUP_WHOLE
        held = "root params + blocks in flight" + (" + device share" if options.device_share else "")
    else:
        # In configure_model the engine takes the model block by block (materialize.BlockwiseInit).
        built = initialized_unit_bytes(fsdp_units(shape, n_layer, 1)) if shape.configure_model else shape.built_bytes
        host = {
            s: host_memory(layout, dtype, configs[s], devices, machine.device_type, shape.params, module_bytes=built)
            for s in schedules
        }
        setup = SETUP_BY_BLOCKS if shape.configure_model else SETUP
        states = device_memory(layout, dtype, configs["sync"].state_dtype)
        # Frozen parameters go to the device as they are (fp32 assumed); activations come on top.
        once = sum(states.values()) + 4 * shape.frozen  # allocated once
        cycled = 0
        held = "model states" + (" + device share" if zero2_share else "")
    activations = None
    if n_layer:
        activations = activation_estimate(batch_size, seq_len, shape.hidden, n_layer, dtype, checkpointing)
    per_step = (activations.bytes if activations else 0) + cycled
    on_gpu = machine.device_type != "cpu"  # a CPU device is host memory: no CUDA runtime, counted on the host
    if not on_gpu:  # the host buffers hold the device's model states already; what else it holds, added
        beside = {"device_activations": activations.bytes if activations else 0}
        if not options.offload_params:
            beside["device_frozen_params"] = 4 * shape.frozen  # offload_params: in the frozen shards
        host = {s: _with_device_memory(h, beside) for s, h in host.items()}
    runtime = device_runtime_bytes(per_step) if on_gpu else 0
    total = once + per_step + runtime
    host_gb = machine.host_memory_gb * GB
    device_gb = room = None
    if on_gpu and machine.device_memory_gb is not None:
        device_gb = int(machine.device_memory_gb * GB)
        room = activation_room(device_gb, once + cycled + math.ceil(ALLOCATOR_OVERHEAD * cycled))
    verdicts = {}
    for schedule in schedules:
        for checkpoint_format in CHECKPOINT_FORMATS:
            checks = host_checks(host[schedule], checkpoint_format, int(host_gb), schedule, setup)
            if activations:  # fails, whatever the activations are, when nothing is left for them
                before = once + cycled + (device_runtime_bytes(cycled) if on_gpu else 0)
                name = f"device memory per GPU, before activations ({held} + runtime)"
                checks.append(Check(name, before, device_gb))
            what = held + (" + activations" if activations else "") + (" + runtime" if on_gpu else "")
            checks.append(Check(f"device memory per GPU ({what})", total, device_gb))
            verdicts[f"{schedule}/{checkpoint_format}"] = Verdict(schedule, checkpoint_format, checks)
    return Evaluation(layout, host, states, total, activations, verdicts, configs, runtime, room, units)


def _with_device_memory(host: HostMemory, beside: dict[str, int]) -> HostMemory:
    """``host`` with the CPU device's memory beyond the model states the engine's host buffers count already."""
    per_rank = {**host.per_rank, **beside}
    return replace(host, per_rank=per_rank, per_node=sum(per_rank.values()) * host.ranks_per_node)
