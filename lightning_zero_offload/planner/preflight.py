"""Pre-flight: before the engine allocates, check that this node's ranks fit in host RAM.

Runs in the strategy's setup (Trainer and Fabric), before any rank builds its engine (all ranks compute
the same numbers from the same node, so they fail together). The checks are the planner's own verdict
(:func:`~lightning_zero_offload.planner.verdicts.host_checks`): training's steady state, the setup peak and
the configured checkpoint format's save, against the memory this process can still get (MemAvailable or
a cgroup limit, whichever is less: :func:`~lightning_zero_offload.planner.machine.probes.host_memory_limit`).
``LZO_SKIP_MEMORY_CHECK=1`` skips it. In the ZeRO-2 mode with ``device_share="auto"`` on an accelerator, a host
that holds the rest only with the last buckets' state on the device gets the smallest such share instead of the
error, where the device has room for it: the engine starts with it, and its own "auto" adds to it after a
measured step (engine/step/device_share.py).
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from lightning_zero_offload.engine.infra.collectives import least_over_ranks
from lightning_zero_offload.engine.options import OffloadOptions, Resolved, resolve, with_compact_state
from lightning_zero_offload.engine.step.device_share import AUTO_ACTIVATION_RESERVE, ShareChoice, parameters_text
from lightning_zero_offload.planner.machine import format_gb, probes
from lightning_zero_offload.planner.memory import HostMemory, device_memory, host_memory, state_bytes_per_param
from lightning_zero_offload.planner.offload_params import fsdp_units, host_memory_params, initialized_unit_bytes
from lightning_zero_offload.planner.shape import LayoutSummary, ModelShape, layout_summary
from lightning_zero_offload.planner.verdicts import SETUP, SETUP_BY_BLOCKS, SETUP_WHOLE, host_checks

SKIP_CHECK_ENV = "LZO_SKIP_MEMORY_CHECK"


def resident_bytes(model: nn.Module) -> int:
    """Host bytes the module's trainable parameters hold now (released once the engine takes them); a
    placeholder of a model built on the meta device (an expanded zero) holds none."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        placeholder = p.numel() > 1 and 0 in p.stride()
        if p.requires_grad and id(p) not in seen and p.device.type == "cpu" and not placeholder:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def check_host_memory(
    model: nn.Module,
    options: OffloadOptions,
    param_dtype: torch.dtype,
    world_size: int,
    local_world_size: int,
    device: torch.device,
    *,
    blockwise: bool = False,
) -> ShareChoice | None:
    """Pre-flight: fail before the engine allocates if this node's ranks would not fit in host RAM.

    Raises :class:`MemoryError` with the numbers, what sets the limit and what to change. Set
    ``LZO_SKIP_MEMORY_CHECK=1`` to skip it (e.g. when swap or memory freed later will cover it). With
    ``offload_params``, a module with no parameter on the host (built on the meta device: configure_model,
    ``init_module(empty_init=True)``) is planned as materialized block by block; so is, without it, a module
    whose parameters are placeholders (``blockwise``: built on the meta device, filled by the engine block by
    block).

    Returns the ZeRO-2 ``device_share="auto"`` start on an accelerator where the host needs one (the module's
    docstring; a collective where there are several ranks, so that all take the same), else None.
    """
    if os.environ.get(SKIP_CHECK_ENV, "") not in ("", "0"):
        return None
    shape = ModelShape.of(model)
    config = resolve(options, device, param_dtype, world_size, local_world_size)  # what the engine will run
    zero2_share = 0.0 if options.offload_params else config.device_share  # the last buckets' state on the device
    layout = layout_summary(shape, options.bucket_size_mb, param_dtype, world_size, zero2_share)
    schedule = config.cpu_step
    resident = resident_bytes(model)
    need, setup, shard = _host_need(config, shape, layout, param_dtype, local_world_size, device, resident, blockwise)
    available, source = probes.host_memory_limit()
    auto_start = not options.offload_params and options.device_share == "auto" and device.type != "cpu"
    device_free = probes.device_memory_free(device) if auto_start else 0
    if auto_start:  # every rank from the same figures, so that all start with the same share
        available, device_free = least_over_ranks([available, device_free], world_size, device)
    # The module is already built (its bytes are in use, not available) and is released at setup.
    budget = available + resident * local_world_size
    failed = [c for c in host_checks(need, options.checkpoint_format, budget, schedule, setup) if not c.fits]
    if not failed:
        return None
    share = None
    if not options.offload_params and device.type != "cpu" and options.device_share in (0, "auto"):
        share = zero2_share_that_fits(
            config, options, shape, param_dtype, (world_size, local_world_size), device, resident, blockwise, budget
        )
    if auto_start and share is not None:
        fraction, peak, device_bytes = share
        on_device = device_bytes + _bytes_still_to_move(model, device, param_dtype)
        if on_device <= (1 - AUTO_ACTIVATION_RESERVE) * device_free:
            params = layout_summary(shape, options.bucket_size_mb, param_dtype, 1, fraction).device_shard_numel
            return ShareChoice(
                fraction,
                params,
                f"auto: {parameters_text(params)} parameters from setup on: the host holds the rest only with their "
                f"state on the device (this node then needs {format_gb(peak)} of its {format_gb(budget)}), which has "
                f"room for it ({format_gb(device_bytes)} of {format_gb(device_free)} free); re-chosen after the second "
                "step, never less",
            )
    worst = max(failed, key=lambda c: c.need)
    nodes = world_size // local_world_size
    per_param = state_bytes_per_param(config.state_dtype)
    per_node_state = per_param * shape.params * local_world_size / world_size
    module = resident * local_world_size
    fixes = []
    compact = _compact_state(
        options, device, param_dtype, world_size, local_world_size, layout, shape, resident, blockwise
    )
    if compact is not None:
        peak = max(c.need for c in host_checks(compact, options.checkpoint_format, budget, schedule, setup))
        if peak <= budget:
            fixes.append(
                f'cpu_state="bf16": master, moments and gradient buffer in bf16 (stochastically rounded, '
                f"docs/compact-state.md), {compact.state_per_rank / shard:.0f} B/param of state instead of "
                f"{need.state_per_rank / shard:.0f}, so this node needs about {format_gb(peak)} instead of "
                f"{format_gb(worst.need)}"
            )
    if module < 0.9 * budget:
        nodes_needed = math.ceil(nodes * (worst.need - module) / (0.9 * budget - module))
        fixes.append(
            f"more nodes: the optimizer state per node is {per_param} B x params / nodes (more ranks per node do "
            f"not help), so about {max(nodes + 1, nodes_needed)} nodes fit"
        )
    if options.offload_params and device.type != "cpu" and options.device_share == 0:
        fixes.append(
            'device_share="auto": whole units keep their shards and state on the device, as many as the host '
            'needs and the device has room for (docs/offload-params.md, "A device share")'
        )
    if share is not None:
        fraction, peak, device_bytes = share
        fix = (
            f"device_share={fraction:g}: the last buckets keep master weights, moments and gradients on the device "
            f"({format_gb(device_bytes)} of device memory per rank), so this node needs about {format_gb(peak)} "
            f"(zero-offload-plan --device-share {fraction:g} checks the device too)"
        )
        if auto_start:  # taken by itself where the device had room
            fix += (
                f'; device_share="auto" takes it by itself where the device has room, here only '
                f"{format_gb(device_free)} free with {1 - AUTO_ACTIVATION_RESERVE:.0%} of it for the state and the "
                "weights still to move there"
            )
        fixes.append(fix)
    fixes.append("fewer trainable parameters (freeze some: frozen parameters get no CPU state) or a smaller model")
    if schedule == "delayed":
        fixes.append(
            f"a schedule other than delayed saves {format_gb(need.per_rank['grad_second'] * local_world_size)}"
        )
    if schedule == "speculative" and need.per_rank.get("snapshot"):
        saved = format_gb(need.per_rank["snapshot"] * local_world_size)
        fixes.append(f'cpu_step="sync" saves {saved} (the snapshot that rolls a speculated step back exactly)')
        if options.cpu_state == "fp32":  # bf16 state rolls back from its snapshot only
            fixes.append(
                f'speculation_rollback="undo" also saves {saved}, but a step rolled back after a clipped spike '
                "is then only near sync's (docs/dpu.md)"
            )
    if options.checkpoint_format == "full":
        fixes.append(
            f'checkpoint_format="sharded": a full checkpoint also gathers '
            f"{format_gb(need.checkpoint_save_per_rank['full'] * local_world_size)} on this node while it is saved"
        )
    if module and param_dtype != torch.float32 and any(c.name.startswith("host RAM, setup") for c in failed):
        fixes.append("build the module in bf16/fp16 (2 B/param until setup; the master weights keep cpu_state's dtype)")
    checks = "; ".join(f"{c.name}: {format_gb(c.need)}" for c in failed)
    raise MemoryError(
        f"zero_offload needs about {format_gb(worst.need)} of host RAM on this node ({checks}; {local_world_size} "
        f"rank(s), optimizer state {format_gb(per_node_state)} for {shape.params / 1e6:.1f}M trainable params over "
        f"{world_size} rank(s), the module as built {format_gb(module)}), but only {format_gb(budget)} is available "
        f"({source}: {format_gb(available)} now, plus the module's own {format_gb(module)} that setup releases). "
        "Options: " + "; ".join(fixes) + f". Set {SKIP_CHECK_ENV}=1 to skip this check."
    )


def _bytes_still_to_move(model: nn.Module, device: torch.device, param_dtype: torch.dtype) -> int:
    """Device bytes of ``model``'s parameters that are not on ``device`` yet (trainable ones in ``param_dtype``)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen and p.device.type != device.type:
            seen.add(id(p))
            total += p.numel() * (param_dtype.itemsize if p.requires_grad else p.element_size())
    return total


def _compact_state(
    options: OffloadOptions,
    device: torch.device,
    param_dtype: torch.dtype,
    world_size: int,
    local_world_size: int,
    layout: LayoutSummary,
    shape: ModelShape,
    resident: int,
    blockwise: bool,
) -> HostMemory | None:
    """The host memory with ``cpu_state="bf16"`` instead of fp32 state; None where bf16 state does not apply
    (already bf16, or a combination it refuses: fp16 parameters, weight prediction)."""
    if options.cpu_state != "fp32":
        return None
    try:
        config = resolve(with_compact_state(options), device, param_dtype, world_size, local_world_size)
    except ValueError:
        return None
    return _host_need(config, shape, layout, param_dtype, local_world_size, device, resident, blockwise)[0]


def zero2_share_that_fits(
    config: Resolved,
    options: OffloadOptions,
    shape: ModelShape,
    param_dtype: torch.dtype,
    world_sizes: tuple[int, int],
    device: torch.device,
    resident: int,
    blockwise: bool,
    budget: int,
    first: int = 1,
) -> tuple[float, int, int] | None:
    """The smallest ZeRO-2 device share, in twentieths from ``first``, with which this node's host holds the rest
    within ``budget`` bytes (``resident``, ``blockwise``: see check_host_memory): (the share, the host's peak, the
    share's device bytes per rank); None where none does or the schedule takes no share."""
    if config.cpu_step == "delayed" or config.in_place:
        return None
    world_size, local_world_size = world_sizes
    for twentieths in range(first, 21):
        layout = layout_summary(shape, options.bucket_size_mb, param_dtype, world_size, twentieths / 20)
        need, setup, _ = _host_need(config, shape, layout, param_dtype, local_world_size, device, resident, blockwise)
        checks = host_checks(need, options.checkpoint_format, budget, config.cpu_step, setup)
        if all(c.fits for c in checks):
            on_device = device_memory(layout, param_dtype, config.state_dtype)
            device_bytes = on_device.get("device_share", 0) + on_device.get("device_share_step", 0)
            return twentieths / 20, max(c.need for c in checks), device_bytes
    return None


def _host_need(
    config: Resolved,
    shape: ModelShape,
    layout: LayoutSummary,
    param_dtype: torch.dtype,
    local_world_size: int,
    device: torch.device,
    resident: int,
    blockwise: bool,
) -> tuple[HostMemory, str, int]:
    """What the engine of ``config`` allocates on this node, the name of its setup check, and the trainable
    parameters of a rank's shard (``blockwise``: see check_host_memory)."""
    units = fsdp_units(shape, None, layout.world_size)
    if not config.offload_params:
        built = resident + (initialized_unit_bytes(units) if blockwise else 0)
        need = host_memory(layout, param_dtype, config, local_world_size, device.type, shape.params, module_bytes=built)
        return need, SETUP_BY_BLOCKS if blockwise else SETUP, max(1, layout.shard_numel)
    need = host_memory_params(
        units, param_dtype, config, local_world_size, device.type, module_bytes=resident, configure_model=not resident
    )
    return need, SETUP_WHOLE if resident else SETUP_BY_BLOCKS, max(1, units.shard_numel)
