"""The engine's settings, valid by construction, and the one function that resolves them for a device.

:class:`OffloadOptions` is frozen and checks every field when it is built, with errors that name the
strategy option to change. The settings of one schedule are grouped with it (:class:`DelayedOptions`,
:class:`SpeculativeOptions`). :func:`resolve` turns every "auto" into what runs on a given device, dtype
and world size; the engine, the pre-flight check and the planner all call it, so the planner predicts
what the engine does. Options that do not apply there come back as notes, which the engine warns once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.option_values import check_bool, check_choice, check_int, check_real
from lightning_zero_offload.engine.scaler import LossScalerConfig
from lightning_zero_offload.warning import ZeroOffloadWarning

CheckpointFormat = Literal["full", "sharded"]
CpuStep = Literal["auto", "sync", "speculative", "delayed"]
ScheduleName = Literal["sync", "speculative", "delayed"]  # a resolved cpu_step: the schedule that runs
SpeculationRollback = Literal["auto", "undo", "snapshot"]
CpuStateDtype = Literal["fp32", "bf16"]
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the cpu_state option -> the state's dtype
CPU_STATES = tuple(STATE_DTYPES)
CPU_STEPS = ("auto", "sync", "speculative", "delayed")
SPECULATION_ROLLBACKS = ("auto", "undo", "snapshot")


@dataclass(frozen=True)
class DelayedOptions:
    """The settings of ``cpu_step="delayed"`` (the strategy's ``dpu_warmup_steps``, ``dpu_weight_prediction``)."""

    warmup_steps: int = 40
    weight_prediction: bool = False

    def __post_init__(self) -> None:
        check_int("dpu_warmup_steps", self.warmup_steps, 0)
        check_bool("dpu_weight_prediction", self.weight_prediction)


@dataclass(frozen=True)
class SpeculativeOptions:
    """The settings of ``cpu_step="speculative"`` (the strategy's ``speculation_rollback``)."""

    rollback: SpeculationRollback = "auto"

    def __post_init__(self) -> None:
        check_choice("speculation_rollback", self.rollback, SPECULATION_ROLLBACKS)


# The strategy's flat names of the grouped settings: name -> (OffloadOptions field, that group's field).
GROUPED_OPTION_NAMES = {
    "speculation_rollback": ("speculative", "rollback"),
    "loss_scale_init": ("loss_scaler", "init_scale"),
    "loss_scale_growth_interval": ("loss_scaler", "growth_interval"),
    "loss_scale_growth_factor": ("loss_scaler", "growth_factor"),
    "loss_scale_backoff_factor": ("loss_scaler", "backoff_factor"),
    "loss_scale_hysteresis": ("loss_scaler", "hysteresis"),
    "loss_scale_min": ("loss_scaler", "min_scale"),
    "dpu_warmup_steps": ("delayed", "warmup_steps"),
    "dpu_weight_prediction": ("delayed", "weight_prediction"),
}
_OPTION_NAME = {place: name for name, place in GROUPED_OPTION_NAMES.items()}


@dataclass(frozen=True)
class OffloadOptions:
    """Engine settings (the strategy's options of the same names; see docs/configuration.md)."""

    bucket_size_mb: float = 25.0
    pin_memory: bool = True
    overlap: bool | None = None
    cpu_threads: int | None = None
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    cpu_step: CpuStep = "auto"
    cpu_state: CpuStateDtype = "fp32"
    delayed: DelayedOptions = field(default_factory=DelayedOptions)
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    checkpoint_format: CheckpointFormat = "full"
    max_consecutive_skipped_steps: int | None = 20
    in_place_on_cpu: bool | None = None
    offload_params: bool = False
    device_share: float | Literal["auto"] = 0.0

    def __post_init__(self) -> None:
        check_real("bucket_size_mb", self.bucket_size_mb, "> 0 (megabytes)", lambda v: v > 0)
        check_bool("pin_memory", self.pin_memory)
        check_bool("overlap", self.overlap, optional=True)
        check_int("cpu_threads", self.cpu_threads, 1, optional=True)
        groups = (("loss_scaler", LossScalerConfig), ("delayed", DelayedOptions), ("speculative", SpeculativeOptions))
        for name, kind in groups:
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}")
        check_choice("cpu_step", self.cpu_step, CPU_STEPS)
        check_choice("cpu_state", self.cpu_state, CPU_STATES)
        check_choice("checkpoint_format", self.checkpoint_format, ("full", "sharded"))
        check_int("max_consecutive_skipped_steps", self.max_consecutive_skipped_steps, 1, optional=True)
        check_bool("in_place_on_cpu", self.in_place_on_cpu, optional=True)
        check_bool("offload_params", self.offload_params)
        if self.device_share != "auto":
            check_real("device_share", self.device_share, 'in [0, 1] (a fraction of the parameters), or "auto"', _unit)
        if self.delayed.weight_prediction and self.cpu_step != "delayed":
            raise ValueError("dpu_weight_prediction=True only changes the delayed update; set cpu_step='delayed' too")

    @property
    def fixed_device_share(self) -> float:
        """The device share as a number to start with: ``"auto"`` is chosen at setup with ``offload_params``
        (planner/device_share.py, which replaces it) and after a measured step without (none until then)."""
        if self.device_share != "auto":
            return self.device_share
        if self.offload_params:
            raise ValueError("device_share='auto' is chosen when the model is sharded: replace it with the choice")
        return 0.0

    def bucket_numel(self, element_size: int) -> int:
        return max(1, int(self.bucket_size_mb * 2**20) // element_size)


@dataclass(frozen=True)
class Resolved:
    """What an engine runs with on a given device, dtype and world size: no "auto" left.

    ``speculation_rollback`` is set only for the speculative schedule and ``delayed`` only for the delayed
    one. ``state_dtype`` is the dtype of the CPU state (master, moments, gradient buffers). ``notes`` name
    each option given that does not apply here (or only in part), and why.
    """

    cpu_step: ScheduleName
    overlap: bool
    cpu_threads: int
    in_place: bool
    pin_memory: bool
    speculation_rollback: Literal["undo", "snapshot"] | None
    delayed: DelayedOptions | None
    state_dtype: torch.dtype = torch.float32
    notes: tuple[str, ...] = ()
    offload_params: bool = False
    device_share: float = 0.0  # the fraction of the parameters whose units or buckets stay on the device

    def warn(self) -> None:
        """Warn once for each note (the engine calls this when it is built; re-planning does not)."""
        for note in self.notes:
            warnings.warn(note, ZeroOffloadWarning, stacklevel=3)


def _changed(options: OffloadOptions, group: str) -> list[str]:
    """``name=value``, by the strategy's names, for each setting of ``group`` that is not its default."""
    given = getattr(options, group)
    default = type(given)()
    return [
        f"{_OPTION_NAME[group, f.name]}={getattr(given, f.name)!r}"
        for f in fields(given)
        if getattr(given, f.name) != getattr(default, f.name)
    ]


def resolve(
    options: OffloadOptions,
    device: torch.device,
    param_dtype: torch.dtype,
    world_size: int = 1,
    local_world_size: int = 1,
    *,
    cores: int | None = None,
    torch_threads: int | None = None,
) -> Resolved:
    """Every "auto" of ``options`` made concrete for ``device``, ``param_dtype`` and ``world_size`` ranks
    (``local_world_size`` of them on this node).

    ``cores`` (the cores this process may use) and ``torch_threads`` (the threads torch's own CPU ops
    use) default to this process's; the planner passes a planned machine's. Raises ``ValueError`` for a
    combination that cannot run (``in_place_on_cpu=True`` where it does not apply, weight prediction
    without a low-precision copy).

    On a CPU device forward/backward and the CPU step run on the same cores, so the schedule is
    synchronous, nothing overlaps and the kernels use torch's own thread count (at most this rank's share
    of the cores). On an accelerator the host cores are free during forward/backward: the gradient
    worker overlaps backward, the CPU step is speculated behind it, and each rank gets its share of the
    node's cores (docs/benchmarks.md has the measurements behind both).
    """
    cores = kernels.usable_cores() if cores is None else cores
    accelerator = device.type != "cpu"
    notes = []
    compact = options.cpu_state == "bf16"
    if options.cpu_step == "auto":
        # bf16 state is chosen for memory: speculating it needs a snapshot of the state (6 more B/param, a
        # stochastically rounded step cannot be undone), so "auto" keeps it at its 8 B/param with sync. So is
        # offload_params, where the snapshot adds 12 B/param to 16, and the only measurement (the simulated
        # device: docs/benchmarks.md) found speculation slower than sync.
        cpu_step: ScheduleName = "speculative" if accelerator and not compact and not options.offload_params else "sync"
        step_said = (
            f"cpu_step='auto' runs {cpu_step!r} on a {device.type} device"
            + (" with cpu_state='bf16'" if compact else "")
            + (" with offload_params=True" if options.offload_params else "")
        )
    else:
        cpu_step = options.cpu_step
        step_said = f"cpu_step is {cpu_step!r}"

    if options.cpu_threads is None:  # OMP_NUM_THREADS is not consulted: torchrun sets it to 1
        threads = max(1, cores // max(1, local_world_size))
        if not accelerator:  # the threads forward/backward use, never more than this rank's share of cores
            threads = min(threads, torch.get_num_threads() if torch_threads is None else torch_threads)
    else:
        threads = options.cpu_threads
        if threads > cores:
            notes.append(
                f"cpu_threads={threads} is more than the {cores} cores this process may use; using {cores} "
                "(more threads than cores only makes the CPU step slower)"
            )
            threads = cores

    # In place (engine/step/in_place.py) only where nothing would be offloaded: forward/backward on the CPU
    # itself, in fp32 (the device parameters *are* the fp32 master), one process (no shards) and the sync
    # step (the other schedules keep the device weights apart from the master on purpose).
    unmet = [
        why
        for why, fails in (
            (f"the device is {device.type}, not cpu", device.type != "cpu"),
            (f"the parameters are {param_dtype}, not float32 (precision='32-true')", param_dtype != torch.float32),
            (f"there are {world_size} processes, not 1", world_size != 1),
            (f"cpu_step is {cpu_step!r}, not 'sync'", cpu_step != "sync"),
            ("cpu_state is 'bf16', not 'fp32'", options.cpu_state != "fp32"),
            ("offload_params is True (the parameters are FSDP2 shards)", options.offload_params),
            (f"device_share is {options.device_share}, not 0", options.device_share not in (0, "auto")),
        )
        if fails
    ]
    if options.in_place_on_cpu and unmet:
        raise ValueError(
            "in_place_on_cpu=True needs a CPU device, precision='32-true', one process, cpu_step='sync', "
            "cpu_state='fp32' and device_share=0, but "
            + "; ".join(unmet)
            + ". Leave in_place_on_cpu unset (None) to use it exactly where it applies."
        )
    in_place = options.in_place_on_cpu is not False and not unmet

    if in_place:
        overlap = False  # nothing is streamed or published, so nothing can overlap
        if options.overlap is not None:
            notes.append(
                f"overlap={options.overlap} has no effect: this run trains in place (a CPU device, "
                "precision='32-true', one process, cpu_step='sync'), where no gradient is streamed and no weight "
                "published; set in_place_on_cpu=False to run the offload data path it would overlap"
            )
    else:
        overlap = options.overlap if options.overlap is not None else accelerator

    if compact:
        _check_compact_state(options, param_dtype, cpu_step)
    if options.offload_params:
        notes.extend(_check_offload_params(options, cpu_step))
    elif options.device_share and cpu_step == "delayed":
        raise ValueError(
            f"device_share={options.device_share} steps the last buckets on the device, and cpu_step='delayed' "
            "updates the master in the background one step behind, which the device share does not follow: use "
            "cpu_step='speculative' (the CPU step hidden in backward, results as sync) or 'sync', or device_share=0"
        )

    rollback: Literal["undo", "snapshot"] | None = None
    if cpu_step == "speculative":
        # "auto" is the snapshot: a rolled-back step equals sync bitwise. The undo inverts the step
        # algebraically and loses the moments to cancellation exactly when a rollback is likely (an isolated
        # spike, clipped hard: docs/dpu.md), and a stochastically rounded (bf16) step cannot be inverted at all.
        chosen = options.speculative.rollback
        rollback = chosen if chosen != "auto" else "snapshot"
    elif options.speculative != SpeculativeOptions():
        notes.append(
            f"speculation_rollback={options.speculative.rollback!r} has no effect: it applies to "
            f"cpu_step='speculative' only, and {step_said}"
        )

    delayed = None
    if cpu_step == "delayed":
        delayed = options.delayed
        if delayed.weight_prediction and param_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                "dpu_weight_prediction writes the predicted weights into the low-precision copy the device "
                f"uses, and these parameters are {param_dtype}: use precision='bf16-mixed' or '16-mixed', "
                "or set dpu_weight_prediction=False"
            )
    elif options.delayed != DelayedOptions():
        changed = _changed(options, "delayed")
        notes.append(f"{', '.join(changed)} has no effect: it applies to cpu_step='delayed' only, and {step_said}")

    if param_dtype != torch.float16 and options.loss_scaler != LossScalerConfig():
        changed = _changed(options, "loss_scaler")
        notes.append(
            f"{', '.join(changed)} {'has' if len(changed) == 1 else 'have'} no effect: loss scaling runs only "
            f"under precision='16-mixed', and the parameters are {param_dtype}"
        )

    pin = options.pin_memory and device.type == "cuda"  # page-locked staging speeds up CUDA copies only
    state_dtype = STATE_DTYPES[options.cpu_state]
    return Resolved(
        cpu_step,
        overlap,
        max(1, threads),
        in_place,
        pin,
        rollback,
        delayed,
        state_dtype,
        tuple(notes),
        options.offload_params,
        options.fixed_device_share,
    )


def _unit(value: float) -> bool:
    return 0 <= value <= 1


def with_compact_state(options: OffloadOptions) -> OffloadOptions:
    """``options`` with ``cpu_state="bf16"``, as a fix to suggest: the rollback left to "auto" (bf16 state
    refuses "undo"); :func:`resolve` still refuses what bf16 state cannot run (fp16, weight prediction)."""
    speculative = SpeculativeOptions() if options.speculative.rollback == "undo" else options.speculative
    return replace(options, cpu_state="bf16", speculative=speculative)


def _check_offload_params(options: OffloadOptions, cpu_step: ScheduleName) -> list[str]:
    """Refuse what ``offload_params=True`` cannot run, naming the fix; the notes for options it ignores."""
    if cpu_step == "delayed":
        raise ValueError(
            "cpu_step='delayed' lets the device compute with weights one step old while the CPU updates the master; "
            "with offload_params=True FSDP2 gathers each block's master shard itself, for forward and again for "
            "backward, so a block's delayed update could only be written after its backward gather (written "
            "before, forward and backward would see different weights): behind backward, the window "
            "cpu_step='speculative' uses exactly. Use cpu_step='speculative' or 'sync'"
        )
    if options.bucket_size_mb != OffloadOptions.bucket_size_mb:
        return [
            f"bucket_size_mb={options.bucket_size_mb} has no effect with offload_params=True: FSDP2 moves and "
            "reduces gradients one wrapped block at a time (the blocks are the buckets)"
        ]
    return []


def _check_compact_state(options: OffloadOptions, param_dtype: torch.dtype, cpu_step: ScheduleName) -> None:
    """Refuse what ``cpu_state="bf16"`` cannot run, naming the fix (docs/compact-state.md)."""
    if param_dtype == torch.float16:
        raise ValueError(
            "cpu_state='bf16' keeps the master weights in bf16, which fp16 device parameters cannot hold (bf16 "
            "spans fp32's range, fp16 overflows above 65504): use precision='bf16-mixed' with cpu_state='bf16', "
            "or cpu_state='fp32' with precision='16-mixed'"
        )
    if cpu_step == "speculative" and options.speculative.rollback == "undo":
        raise ValueError(
            "speculation_rollback='undo' inverts the Adam step algebraically, which a stochastically rounded bf16 "
            "step cannot be: with cpu_state='bf16' use speculation_rollback='snapshot' (or 'auto', which takes it)"
        )
    if cpu_step == "delayed" and options.delayed.weight_prediction:
        raise ValueError(
            "dpu_weight_prediction writes a predicted copy of the weights apart from the master, and "
            "cpu_state='bf16' hands the device the bf16 master itself: set dpu_weight_prediction=False, or use "
            "cpu_state='fp32'"
        )
