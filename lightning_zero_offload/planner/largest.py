"""The largest model that trains on a machine: plain training on the GPU, and zero_offload with each cpu_state,
with the parameters on the GPU (ZeRO-2) and offloaded too (``offload_params``).

The models are the planner's family for a parameter count (a transformer of ``n_layer`` layers whose width
follows from the count, :func:`~lightning_zero_offload.planner.shape.width_for`), built on the host in fp32
as a module usually is, in the run's 16-bit dtype, or in ``configure_model`` (materialized block by block;
with ``offload_params`` always); for each way to
train, the largest count whose every memory requirement fits is found by bisection, and what a larger model
runs out of first is named.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from lightning_zero_offload.engine.options import STATE_DTYPES, OffloadOptions
from lightning_zero_offload.planner.device_share import planned_share, zero2_start
from lightning_zero_offload.planner.machine import GB, Machine
from lightning_zero_offload.planner.memory import (
    PLAIN_DEVICE_BYTES_PER_PARAM,
    PLAIN_GRAD_BYTES_PER_PARAM,
    activation_estimate,
    device_runtime_bytes,
)
from lightning_zero_offload.planner.model import DTYPES, recommend, step_flops
from lightning_zero_offload.planner.shape import DEFAULT_N_LAYER, ModelShape, width_for
from lightning_zero_offload.planner.verdicts import EXACT_SCHEDULES, Check, Evaluation, evaluate

PLAIN = "plain"  # no offload: the strategy Lightning picks by itself, AdamW on the GPU
CPU_STATE_SETUPS = ("fp32", "bf16")
_HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}
IN_CONFIGURE_MODEL = "in configure_model"  # built on the meta device, materialized block by block


@dataclass
class Largest:
    """The largest model one way of training fits: ``params`` (0: not even a small one) and, at that size,
    the schedule the planner recommends, the peak host RAM per node and the memory per GPU; ``binds``
    names the requirements a 0.1% larger model fails."""

    setup: str  # PLAIN or a cpu_state
    params: int
    cpu_step: str | None  # None for plain training
    host_need: int  # per node, the peak of training, setup and the save
    device_need: int  # per GPU
    binds: list[str]
    built: str = "fp32"  # the module's dtype as built, on the host until setup, or IN_CONFIGURE_MODEL
    refused: str = ""  # why this setup cannot run with these options at all
    offload_params: bool = False  # the parameters offloaded too, the model built in configure_model
    device_share: float = 0.0  # the fraction of the parameters whose units (offload_params) or buckets stay on the GPU
    auto_share: bool = False  # that fraction is device_share="auto"'s choice at this size
    step_s: float | None = None  # the predicted step time at that size, with that schedule (plain: not predicted)

    @property
    def name(self) -> str:
        if self.setup == PLAIN:
            return "plain training (AdamW on the GPU)"
        share = f', device_share="auto" -> {self.device_share:.3f}' if self.auto_share else ""
        if self.offload_params:
            return f'zero_offload_params, cpu_state="{self.setup}"{share}'
        built = {"fp32": "", IN_CONFIGURE_MODEL: f", {IN_CONFIGURE_MODEL}"}.get(self.built, f", built in {self.built}")
        return f'zero_offload, cpu_state="{self.setup}"{built}{share}'


@dataclass
class LargestModels:
    """:func:`largest_models`' answer, one row per way of training, with the assumptions it rests on."""

    rows: list[Largest]
    machine: Machine
    assumptions: str

    def __str__(self) -> str:
        m = self.machine
        width = max(68, *(len(row.name) for row in self.rows))
        lines = [
            f"largest model that trains on {m.name}: host RAM {m.host_memory_gb:.0f} GB per node, "
            f"{m.device_memory_gb:.0f} GB per GPU",
            *textwrap.wrap(f"assuming {self.assumptions}", 118),
            "",
            f"  {'how':<{width}} {'params':>8}  {'cpu_step':<12} {'host GB':>8} {'GPU GB':>7} {'s/step':>7}  "
            "a larger model runs out of",
        ]
        for row in self.rows:
            if row.refused:
                lines.append(f"  {row.name:<{width}} {'-':>8}  refused: {row.refused}")
                continue
            lines.append(
                f"  {row.name:<{width}} {row.params / 1e9:>7.2f}B  {row.cpu_step or '-':<12} {row.host_need / GB:>8.1f}"
                f" {row.device_need / GB:>7.1f} {_seconds(row.step_s):>7}  {'; '.join(row.binds)}"
            )
        return "\n".join(lines)


def largest_models(
    machine: Machine,
    *,
    batch_size: int = 1,
    seq_len: int = 2048,
    n_layer: int = DEFAULT_N_LAYER,
    devices: int = 1,
    num_nodes: int = 1,
    precision: str = "bf16-mixed",
    activation_checkpointing: bool = False,
    checkpoint_format: str = "full",
    bucket_size_mb: float = 25.0,
) -> LargestModels:
    """The largest model of the planner's family that trains on ``machine`` (its ``host_memory_gb`` and
    ``device_memory_gb``) without offload and with zero_offload under each cpu_state, with the given
    micro-batch, sequence length, depth and activation checkpointing. zero_offload needs an exact schedule
    (sync or speculative) that fits with ``checkpoint_format``'s save; the row names the one :func:`plan`
    recommends at that size."""
    if machine.device_type == "cpu" or machine.device_memory_gb is None:
        raise ValueError("the largest model needs a GPU's memory: give device_memory_gb (--device-memory-gb)")
    dtype = DTYPES[precision]
    host, device = int(machine.host_memory_gb * GB), int(machine.device_memory_gb * GB)
    never = device // dtype.itemsize + 1  # every rank holds all parameters on its GPU: this count never fits

    def plain_checks(params: int) -> list[Check]:
        activations = activation_estimate(
            batch_size, seq_len, width_for(params, n_layer), n_layer, dtype, activation_checkpointing
        ).bytes
        runtime = device_runtime_bytes(PLAIN_GRAD_BYTES_PER_PARAM * params + activations)  # as plan() counts it
        return [
            Check("host RAM, the module as built (fp32, one per GPU)", 4 * params * devices, host),
            Check(
                "GPU memory (16 B/param + activations + runtime)",
                PLAIN_DEVICE_BYTES_PER_PARAM * params + activations + runtime,
                device,
            ),
        ]

    params, binds = _largest(plain_checks, never)
    host_need, device_need = (c.need for c in plain_checks(max(1, params)))
    rows = [Largest(PLAIN, params, None, host_need, device_need, binds)]
    # A module built in the 16-bit dtype of the run halves what it holds until setup (the planner's fix); one
    # built in configure_model is materialized block by block (with offload_params, always).
    setups = [(built, False) for built in (("fp32",) if dtype == torch.float32 else ("fp32", _HALF[dtype]))]
    for built, offload_params in [*setups, (IN_CONFIGURE_MODEL, False), (IN_CONFIGURE_MODEL, True)]:
        for cpu_state in CPU_STATE_SETUPS:
            options = OffloadOptions(
                bucket_size_mb=bucket_size_mb,
                checkpoint_format=checkpoint_format,  # type: ignore[arg-type]
                cpu_state=cpu_state,  # type: ignore[arg-type]
                offload_params=offload_params,
            )
            context = (dtype, machine, devices, num_nodes, batch_size, seq_len, n_layer, activation_checkpointing)
            rows.append(_row(options, built, context))
            # and with the share a run's device_share="auto" chooses at each size (the ZeRO-2 mode's: its start)
            if offload_params or built == IN_CONFIGURE_MODEL:
                rows.append(_row(replace(options, device_share="auto"), built, context))

    assumptions = (
        f"a {n_layer}-layer transformer of width sqrt(params / (12 x {n_layer})), {precision}, micro-batch "
        f"{batch_size} x {seq_len} tokens, activation checkpointing {'on' if activation_checkpointing else 'off'} "
        "(activations by the planner's estimate, logits not included), the CUDA runtime's own memory reserved on "
        "each GPU (the context and the caching allocator's overhead), the module built on the host in fp32 "
        "(4 B/param until setup; 'built in bf16': module.to(torch.bfloat16) before fit, 2 B/param: the master "
        "weights start from the rounded values; 'in configure_model': built on the meta device and materialized "
        "one layer at a time, whole on the host in fp32, into the engine's state), "
        f"{devices} GPU(s) per node x {num_nodes} node(s), "
        f'checkpoint_format="{checkpoint_format}"; plain training keeps fp32 weights, gradients and AdamW '
        "moments on the GPU (16 B/param); zero_offload_params: the parameters offloaded too (offload_params=True, "
        "FSDP2 units of one layer, the model built in configure_model: one layer whole on the host at setup; each "
        "pinned shard rounded up to a power of two by torch's pinned allocator, for a GPT layer's four matrices)"
    )
    return LargestModels(rows, machine, assumptions)


def _row(options: OffloadOptions, built: str, context: tuple) -> Largest:
    """The largest model ``options`` train, the module built as ``built``, with the schedule :func:`plan`
    recommends at that size (``context``: dtype, machine, devices, nodes, micro-batch, sequence, depth,
    activation checkpointing)."""
    dtype, machine, devices, num_nodes, batch_size, seq_len, n_layer, checkpointing = context
    checkpoint_format, cpu_state = options.checkpoint_format, options.cpu_state
    args = (dtype, machine, devices, num_nodes, options, batch_size, seq_len, n_layer, checkpointing)
    shape_of = partial(_shape, n_layer, 2 if built in _HALF.values() else 4, built == IN_CONFIGURE_MODEL)
    checks = partial(_offload_checks, shape_of, args, checkpoint_format)
    if options.offload_params:  # the shards: training needs 4 x the state's bytes per parameter, on host or GPU
        room = machine.host_memory_gb + (machine.device_memory_gb * devices if options.device_share else 0)
        bound = int(room * GB) * num_nodes // (4 * STATE_DTYPES[cpu_state].itemsize) + 1
    else:
        bound = int(machine.device_memory_gb * GB) // dtype.itemsize + 1  # every rank holds all parameters
    try:
        params, binds = _largest(checks, bound)
    except ValueError as refusal:  # a combination the engine refuses (bf16 state with fp16 parameters)
        return Largest(cpu_state, 0, None, 0, 0, [], built, str(refusal), options.offload_params)
    row = Largest(cpu_state, params, None, 0, 0, binds, built, offload_params=options.offload_params)
    row.auto_share = options.device_share == "auto"
    if params:
        shape = shape_of(params)
        evaluation, options = _evaluated(shape, args)
        row.device_share = options.device_share  # type: ignore[assignment]
        verdicts = evaluation.verdicts
        fitting = [s for s in evaluation.schedules if verdicts[f"{s}/{checkpoint_format}"].fits]
        flops = step_flops(shape, batch_size * seq_len, seq_len, n_layer)
        world = devices * num_nodes
        chosen = recommend(shape, dtype, machine, devices, world, flops, 1, fitting, options, units=evaluation.units)
        row.cpu_step = str(chosen["cpu_step"])
        row.step_s = float(chosen["step_s"])  # type: ignore[arg-type]
        at = verdicts[f"{row.cpu_step}/{checkpoint_format}"].checks
        row.host_need = max(c.need for c in at if c.name.startswith("host"))
        row.device_need = max(c.need for c in at if c.name.startswith("device"))
    return row


def _shape(n_layer: int, built_bytes_per_param: int, configure_model: bool, params: int) -> ModelShape:
    """The planner's model of ``params`` parameters (width from the count), built with these bytes/param, or
    in configure_model."""
    return replace(
        ModelShape.of(params),
        hidden=width_for(params, n_layer),
        module_bytes=built_bytes_per_param * params,
        configure_model=configure_model,
    )


def _offload_checks(
    shape_of: Callable[[int], ModelShape], args: tuple, checkpoint_format: str, params: int
) -> list[Check]:
    """zero_offload's checks for a model of ``params``: those of the first exact schedule that fits, else
    sync's (the smallest); with the ZeRO-2 mode's ``device_share="auto"``, the GPU's room for the share a short host
    needs too."""
    shape = shape_of(params)
    verdicts = _evaluated(shape, args)[0].verdicts
    exact = [verdicts[f"{s}/{checkpoint_format}"] for s in EXACT_SCHEDULES]
    checks = next((v.checks for v in exact if v.fits), exact[0].checks)
    dtype, machine, devices, num_nodes, options, *_ = args
    if options.device_share == "auto" and not options.offload_params:
        _, _, room = zero2_start(shape, options, dtype, machine, devices, devices * num_nodes)
        # Where the GPU has no room for the share, the run starts with none: the host's checks failing fail for it
        failing = [c for c in checks if not c.fits]
        if room is not None and not room.fits and failing and all(c.name.startswith("host") for c in failing):
            checks = [room]
    return checks


def _seconds(step_s: float | None) -> str:
    return "-" if step_s is None else f"{step_s:.2f}"


def _evaluated(shape: ModelShape, args: tuple) -> tuple[Evaluation, OffloadOptions]:
    """:func:`evaluate` of ``args`` (``device_share="auto"``: the number a run would choose for ``shape``), and the
    options evaluated."""
    dtype, machine, devices, num_nodes, options, *rest = args
    options, _ = planned_share(shape, options, dtype, machine, devices, devices * num_nodes)
    return evaluate(shape, dtype, machine, devices, num_nodes, options, *rest), options


def _largest(checks_of: Callable[[int], list[Check]], never: int) -> tuple[int, list[str]]:
    """The largest count below ``never`` whose checks all pass, to 0.1% (0: not even one parameter), and the
    requirements the next larger count fails."""
    low, high = 0, never
    while high - low > max(1, low // 1000):
        mid = (low + high) // 2
        if all(c.fits for c in checks_of(mid)):
            low = mid
        else:
            high = mid
    return low, [c.name for c in checks_of(high) if not c.fits]
