"""Will my model fit, how fast will it train, and what should I set: answered before the first step.

``plan(model, ...)`` predicts, per node and per rank, the host RAM the engine allocates
(:mod:`~lightning_zero_offload.planner.memory`, buffer by buffer), the device memory of the model states,
and the time of one optimizer step split into forward/backward, gradient transfers, CPU step and
copy-back, for each CPU-step schedule (:mod:`~lightning_zero_offload.planner.timing`). The model is a
handful of rates: host memory bandwidth (the Adam step moves 28 B/param), host<->device and interconnect
bandwidth, and the device's achieved forward+backward FLOP/s (about 6 x params x tokens).
:func:`~lightning_zero_offload.planner.machine.measure_machine` measures them here; pass a
:class:`~lightning_zero_offload.planner.machine.Machine` to plan for another host or GPU.
``python -m lightning_zero_offload.planner`` is the command line (docs/planning.md).
"""

from __future__ import annotations

import math
from dataclasses import replace
from numbers import Integral

import torch
from torch import nn

from lightning_zero_offload.engine.options import OffloadOptions, SpeculativeOptions
from lightning_zero_offload.planner.device_share import planned_share
from lightning_zero_offload.planner.fixes import fixes_for
from lightning_zero_offload.planner.machine import Machine, format_gb, measure_machine
from lightning_zero_offload.planner.memory import (
    CHECKPOINT_FORMATS,
    PLAIN_DEVICE_BYTES_PER_PARAM,
    PLAIN_GRAD_BYTES_PER_PARAM,
    SCHEDULES,
    device_runtime_bytes,
)
from lightning_zero_offload.planner.offload_params import FsdpUnits, ParamsOffload, traffic
from lightning_zero_offload.planner.report import Plan
from lightning_zero_offload.planner.shape import ModelShape, assumed_depth, layout_summary, width_for
from lightning_zero_offload.planner.timing import step_time, step_time_params
from lightning_zero_offload.planner.verdicts import EXACT_SCHEDULES, Verdict, evaluate, resolve_for

DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}
BUCKET_CHOICES_MB = (1, 2, 4, 8, 16, 25, 32, 64, 128, 256)


def plan(
    model: nn.Module | int | float,
    *,
    batch_size: int,
    seq_len: int,
    devices: int = 1,
    num_nodes: int = 1,
    precision: str = "bf16-mixed",
    bucket_size_mb: float = 25.0,
    cpu_threads: int | None = None,
    accumulate_grad_batches: int = 1,
    n_layer: int | None = None,
    machine: Machine | None = None,
    checkpoint_format: str = "full",
    activation_checkpointing: bool = False,
    hidden: int | None = None,
    in_place_on_cpu: bool | None = None,
    speculation_rollback: str = "auto",
    cpu_state: str = "fp32",
    offload_params: bool = False,
    configure_model: bool = False,
    device_share: float | str = 0.0,
) -> Plan:
    """Predict memory and step time of training ``model`` with zero_offload, and recommend settings.

    Every configuration (CPU-step schedule x checkpoint format) gets a verdict against host RAM (steady
    state, setup with the module as built, checkpoint save) and device memory (parameters, gradient
    buckets, activations and the CUDA runtime's own memory); only what fits is recommended, and when nothing
    fits ``fixes`` lists the smallest changes that would.

    Args:
        model: an ``nn.Module`` (build it on ``torch.device("meta")`` to count without allocating) or the
            number of trainable parameters.
        batch_size, seq_len: micro-batch per rank, as the run will use them (step time and activations
            scale with ``batch_size * seq_len`` tokens).
        devices, num_nodes: ranks per node and nodes (as in ``Trainer(devices=, num_nodes=)``).
        precision: ``"bf16-mixed"``, ``"16-mixed"`` or ``"32-true"``.
        bucket_size_mb, cpu_threads, in_place_on_cpu, speculation_rollback, cpu_state: the strategy options to
            evaluate, resolved as the engine resolves them (``Plan.resolved``); ``in_place_on_cpu=True`` applies
            to the sync schedule, the only one that runs in place, and ``speculation_rollback`` to the
            speculative one. ``cpu_state="bf16"`` holds master, moments and gradient buffers in bf16
            (docs/compact-state.md): half the host bytes of ``"fp32"``.
        n_layer: transformer layers; adds attention's 12 x layers x hidden x seq FLOPs/token, and is the depth of
            the activation estimate. Without it the activations are estimated for an assumed shape, named in
            ``Plan.activations.assumed_shape`` (a built model's own list of blocks, or the planner's
            32-layer transformer for a parameter count); ``Plan.activation_room`` is what any shape may use.
        machine: the rates to use; None measures this machine (:func:`measure_machine`).
        checkpoint_format: the strategy option you intend to use; both formats get a verdict.
        activation_checkpointing: whether the model recomputes activations (changes the activation estimate).
        hidden: the model width for the attention FLOPs and activations (default: the model's most common
            matmul input width; for a parameter count, ``sqrt(params / (12 x n_layer))``).
        offload_params: plan the parameters offloaded too (the strategy option: FSDP2 shards per block on the
            host, only the blocks in flight on the device; ``Plan.params_offload`` has its units and traffic).
        configure_model: the model is built in ``configure_model`` or under ``init_module(empty_init=True)``:
            on the meta device, then materialized block by block (into its shards with ``offload_params``,
            into the ZeRO-2 engine's master weights without), never whole.
        device_share: with ``offload_params``, the fraction of the parameters whose units keep their shards and
            state on the device (the strategy option).
    """
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
    sizes = {"batch_size": batch_size, "seq_len": seq_len, "devices": devices}
    if hidden is not None:
        sizes["hidden"] = hidden
    for name, value in sizes.items():
        if not isinstance(value, Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if num_nodes < 1 or accumulate_grad_batches < 1:
        raise ValueError("num_nodes and accumulate_grad_batches must be >= 1")
    options = OffloadOptions(  # checks each option as the strategy does
        bucket_size_mb=bucket_size_mb,
        cpu_threads=cpu_threads,
        checkpoint_format=checkpoint_format,  # type: ignore[arg-type]
        in_place_on_cpu=in_place_on_cpu,
        speculative=SpeculativeOptions(speculation_rollback),  # type: ignore[arg-type]
        cpu_state=cpu_state,  # type: ignore[arg-type]
        offload_params=offload_params,
        device_share=device_share,
    )
    if n_layer is not None and n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    shape = replace(ModelShape.of(model), configure_model=configure_model)
    if offload_params and shape.units_refused:
        raise ValueError(f"offload_params=True refuses this model: {shape.units_refused}")
    if hidden is not None:
        shape = replace(shape, hidden=hidden)
    elif shape.shapes is None and n_layer:
        shape = replace(shape, hidden=width_for(shape.params, n_layer))
    tokens = batch_size * seq_len
    dtype = DTYPES[precision]
    if machine is None:
        machine = measure_machine(threads=cpu_threads, tokens=tokens, linear_shapes=shape.linear_shapes, dtype=dtype)
    world = devices * num_nodes
    # The activations need a depth: without n_layer, an assumed one (said in the plan); the attention FLOPs
    # of the step time stay out, as before.
    depth, assumed = n_layer, ""
    if n_layer is None:
        depth, width, assumed = assumed_depth(shape, hidden_given=hidden is not None)
        shape = replace(shape, hidden=width)
    options, choice = planned_share(shape, options, dtype, machine, devices, world)  # "auto": a run's choice
    args = (dtype, machine, devices, num_nodes, options, batch_size, seq_len, depth, activation_checkpointing)
    memory = evaluate(shape, *args)
    if memory.activations is not None:
        memory.activations.assumed_shape = assumed
    threads = memory.resolved["sync"].cpu_threads  # the thread rule does not depend on the schedule
    layout = memory.layout
    state_dtype = memory.resolved["sync"].state_dtype
    flops = step_flops(shape, tokens * accumulate_grad_batches, seq_len, n_layer)
    units, micro, shard = memory.units, accumulate_grad_batches, layout.shard_numel
    params_offload = None
    if units is None:
        steps = {
            s: step_time(layout, dtype, s, machine, threads, devices, flops, micro, state_dtype)
            for s in memory.schedules
        }
    else:
        steps = {
            s: step_time_params(
                units,
                dtype,
                s,
                machine,
                threads,
                devices,
                flops,
                micro,
                state_dtype,
                memory.resolved[s].pin_memory,
                memory.resolved[s].device_share,
            )
            for s in memory.schedules
        }
        moved = traffic(units, dtype, state_dtype, micro, memory.resolved["sync"].device_share)
        params_offload = ParamsOffload(units, moved, configure_model)
        shard = units.shard_numel
    plain = None
    if machine.device_type != "cpu":
        activations = memory.activations.bytes if memory.activations else 0
        plain = PLAIN_DEVICE_BYTES_PER_PARAM * shape.params + 4 * shape.frozen + activations
        plain += device_runtime_bytes(PLAIN_GRAD_BYTES_PER_PARAM * shape.params + activations)
    result = Plan(
        params=shape.params,
        shard_params=shard,
        world_size=world,
        ranks_per_node=devices,
        tokens_per_step=tokens * accumulate_grad_batches * world,
        machine=machine,
        host=memory.host,
        device_bytes=memory.device_states,
        steps=steps,
        bucket_size_mb=bucket_size_mb,
        cpu_threads=threads,
        checkpoint_format=checkpoint_format,
        activations=memory.activations,
        device_total=memory.device_total,
        device_runtime=memory.device_runtime,
        activation_room=memory.activation_room,
        verdicts=memory.verdicts,
        plain_device_bytes=plain,
        resolved=memory.resolved,
        cpu_state=cpu_state,
        params_offload=params_offload,
    )
    chosen = _chosen_format(memory.verdicts, checkpoint_format)
    if chosen is not None:
        allowed = [s for s in memory.schedules if memory.verdicts[f"{s}/{chosen}"].fits]
        result.recommended = recommend(
            shape, dtype, machine, devices, world, flops, micro, allowed=allowed, options=options, units=units
        )
        result.recommended["checkpoint_format"] = chosen
    if not memory.verdicts[f"sync/{checkpoint_format}"].fits or chosen is None:
        result.fixes = fixes_for(shape, args, memory, checkpoint_format)
    result.notes = _notes(result) + ([f"device_share={choice.why}"] if choice is not None else [])
    return result


def _chosen_format(verdicts: dict[str, Verdict], asked: str) -> str | None:
    """The asked checkpoint format if some schedule fits with it, else the other one if that fits."""
    for checkpoint_format in (asked, *(f for f in CHECKPOINT_FORMATS if f != asked)):
        if any(v.fits for v in verdicts.values() if v.checkpoint_format == checkpoint_format):
            return checkpoint_format
    return None


def step_flops(shape: ModelShape, tokens: int, seq_len: int, n_layer: int | None) -> float:
    """Forward+backward FLOPs of ``tokens`` per rank: 6 per matmul weight, and attention's 12 x layers x
    hidden x seq (without ``n_layer``: none)."""
    return tokens * (6 * shape.matmul_params + 12 * (n_layer or 0) * shape.hidden * seq_len)


def recommend(
    shape: ModelShape,
    dtype: torch.dtype,
    machine: Machine,
    ranks_per_node: int,
    world: int,
    flops: float,
    micro: int,
    allowed: list[str] | tuple[str, ...] = SCHEDULES,
    options: OffloadOptions | None = None,
    units: FsdpUnits | None = None,
) -> dict[str, object]:
    """Threads, bucket size and schedule with the shortest predicted step, among the ``allowed`` schedules
    (those that fit in memory; none allowed: an empty dict).

    Threads: the fewest that pull the rank's share of the node's bandwidth (the others stay free for the
    data loader); buckets: the smallest size within 1% of the fastest (less device memory, earlier
    start); schedule: the fastest exact one (delayed is reported, not recommended: it changes the
    optimizer's result, docs/dpu.md). ``options``: the ones planned (their ``cpu_state`` sets the bytes the
    CPU step moves; default: the strategy's defaults). With ``options.offload_params`` FSDP2 moves the
    gradients per block (``units``, required then): no bucket size to choose (``bucket_size_mb`` None).
    """
    exact = [s for s in EXACT_SCHEDULES if s in allowed]
    if not exact:
        return {}
    # The engine's default thread count; the state's dtype as planned.
    planned = OffloadOptions(cpu_state=options.cpu_state) if options else OffloadOptions()
    default = resolve_for(planned, machine, dtype, world, ranks_per_node)
    cores, state_dtype = default.cpu_threads, default.state_dtype
    threads = cores
    if machine.device_type != "cpu" and machine.host_bandwidth_per_thread_gbs:
        share = machine.host_bandwidth_gbs / ranks_per_node
        threads = min(cores, max(1, math.ceil(0.95 * share / machine.host_bandwidth_per_thread_gbs)))
    best: dict[str, tuple[float, float | None]]
    if options is not None and options.offload_params:
        if units is None:
            raise ValueError("recommend() with offload_params=True needs the model's FSDP2 units (units=)")
        best = {}
        for schedule in exact:
            step = step_time_params(
                units,
                dtype,
                schedule,
                machine,
                threads,
                ranks_per_node,
                flops,
                micro,
                state_dtype,
                default.pin_memory,
                options.fixed_device_share,
            )
            best[schedule] = (step.total, None)
    else:
        share = options.fixed_device_share
        layouts = {mb: layout_summary(shape, mb, dtype, world, share) for mb in BUCKET_CHOICES_MB}
        best = {}
        for schedule in [s for s in SCHEDULES if s in allowed]:
            totals = []
            for mb, layout in layouts.items():
                totals.append(
                    (
                        step_time(
                            layout, dtype, schedule, machine, threads, ranks_per_node, flops, micro, state_dtype
                        ).total,
                        mb,
                    )
                )
            fastest = min(t for t, _ in totals)
            best[schedule] = next((t, mb) for t, mb in totals if t <= 1.01 * fastest)
    schedule = min(exact, key=lambda s: best[s][0] * (1.0 if s == "sync" else 1.02))  # ties: sync
    step_s, bucket_mb = best[schedule]
    delayed = best.get("delayed")  # None: delayed does not fit in memory
    return {
        "cpu_step": schedule,
        "bucket_size_mb": bucket_mb,
        "cpu_threads": threads,
        "step_s": step_s,
        "delayed_step_s": delayed[0] if delayed else None,
        "delayed_speedup": step_s / delayed[0] if delayed else None,
    }


def _room(room: int | None) -> str:
    if room is None:
        return ""
    if room <= 0:
        return "; the model states and the runtime leave nothing for activations on the device, whatever the shape"
    return f"; whatever the shape, the device has room for {format_gb(room)} of activations per GPU"


def _notes(result: Plan) -> list[str]:
    m = result.machine
    notes = []
    if result.world_size > 1 and m.interconnect_gbs is None:
        notes.append("reduce-scatter/all-gather time not included (pass interconnect_gbs)")
    if m.device_type == "cpu":
        notes.append(
            "CPU device: forward/backward and the CPU step share the cores, so no schedule overlaps them; the "
            "device's memory is host memory, counted in the host RAM above (model states, frozen parameters and "
            "activations)"
        )
    elif m.device_memory_gb is None:
        notes.append("device memory not checked: the machine's device_memory_gb is not known")
    if result.params_offload is not None:
        notes += _offload_notes(result)
    if result.activations is not None and result.activations.assumed_shape:
        notes.append(
            f"n_layer not given: activations estimated for an assumed shape, {result.activations.assumed_shape}; "
            "give n_layer and hidden (--n-layer, --hidden) for the model's own" + _room(result.activation_room)
        )
    return notes


def _offload_notes(result: Plan) -> list[str]:
    units, notes = result.params_offload.units, []
    if units.root_params > units.largest_unit:
        notes.append(
            f"the root keeps {units.root_params / 1e6:.1f}M parameters that no repeated block holds, gathered on the "
            "device for the whole step: give the model blocks (an nn.ModuleList of identical layers) so that FSDP2 "
            "gathers them one block at a time"
        )
    if result.host["sync"].per_rank.get("pinned_rounding"):
        notes.append(
            "pinned_rounding: FSDP2 pins each parameter's shard, and torch's pinned allocator rounds every allocation "
            "up to a power of two (its default, read from torch's source, not measured); "
            "PYTORCH_CUDA_ALLOC_CONF=pinned_max_round_threshold_mb:<MB> leaves larger ones exact"
        )
    return notes
