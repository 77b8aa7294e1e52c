"""The engine's settings: checked once, at construction, with errors that name the strategy option to change.

"auto" settings (``cpu_step="auto"``, ``overlap=None``, ``cpu_threads=None``) are resolved per device by
:func:`resolve_auto`, the one place that encodes what the benchmarks found about them (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch

from lightning_zero_offload.engine.checks import check_bool, check_choice, check_int, check_real
from lightning_zero_offload.engine.scaler import LossScalerConfig

CheckpointFormat = Literal["full", "sharded"]
CpuStep = Literal["auto", "sync", "speculative", "delayed"]
SpeculationRollback = Literal["auto", "undo", "snapshot"]
CPU_STEPS = ("auto", "sync", "speculative", "delayed")
SPECULATION_ROLLBACKS = ("auto", "undo", "snapshot")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_cpu_threads(local_world_size: int = 1) -> int:
    """Cores this process may use, shared evenly between the ranks of one node.

    Deliberately ignores ``OMP_NUM_THREADS``: torchrun sets it to 1, which would silently make the
    CPU optimizer single-threaded.
    """
    return max(1, usable_cores() // max(1, local_world_size))


@dataclass
class OffloadOptions:
    """Engine settings (the strategy's options of the same names; see docs/configuration.md)."""

    bucket_size_mb: float = 25.0
    pin_memory: bool = True
    overlap: bool | None = None
    cpu_threads: int | None = None
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    cpu_step: CpuStep = "auto"
    delayed_param_update: bool = False  # deprecated alias of cpu_step="delayed"
    dpu_warmup_steps: int = 40
    dpu_weight_prediction: bool = False
    speculation_rollback: SpeculationRollback = "auto"
    checkpoint_format: CheckpointFormat = "full"
    max_consecutive_skipped_steps: int | None = 20
    in_place_on_cpu: bool | None = None

    def __post_init__(self) -> None:
        check_real("bucket_size_mb", self.bucket_size_mb, "> 0 (megabytes)", lambda v: v > 0)
        check_bool("pin_memory", self.pin_memory)
        check_bool("overlap", self.overlap, optional=True)
        check_int("cpu_threads", self.cpu_threads, 1, optional=True)
        if not isinstance(self.loss_scaler, LossScalerConfig):
            raise TypeError(f"loss_scaler must be a LossScalerConfig, got {type(self.loss_scaler).__name__}")
        check_choice("cpu_step", self.cpu_step, CPU_STEPS)
        check_bool("delayed_param_update", self.delayed_param_update)
        check_int("dpu_warmup_steps", self.dpu_warmup_steps, 0)
        check_bool("dpu_weight_prediction", self.dpu_weight_prediction)
        check_choice("speculation_rollback", self.speculation_rollback, SPECULATION_ROLLBACKS)
        check_choice("checkpoint_format", self.checkpoint_format, ("full", "sharded"))
        check_int("max_consecutive_skipped_steps", self.max_consecutive_skipped_steps, 1, optional=True)
        check_bool("in_place_on_cpu", self.in_place_on_cpu, optional=True)
        if self.delayed_param_update:
            if self.cpu_step not in ("auto", "delayed"):
                raise ValueError(
                    f"delayed_param_update=True contradicts cpu_step={self.cpu_step!r}: "
                    "drop delayed_param_update and set only cpu_step"
                )
            warnings.warn(
                "delayed_param_update=True is deprecated: write cpu_step='delayed' instead",
                FutureWarning,
                stacklevel=3,
            )
            self.cpu_step = "delayed"
        if self.dpu_weight_prediction and self.cpu_step != "delayed":
            raise ValueError("dpu_weight_prediction=True only changes the delayed update; set cpu_step='delayed' too")

    def bucket_numel(self, element_size: int) -> int:
        return max(1, int(self.bucket_size_mb * 2**20) // element_size)


@dataclass(frozen=True)
class Resolved:
    """The settings an engine on a given device actually runs with (no "auto" left)."""

    cpu_step: Literal["sync", "speculative", "delayed"]
    overlap: bool
    cpu_threads: int


def resolve_auto(options: OffloadOptions, device: torch.device, local_world_size: int = 1) -> Resolved:
    """Turn the "auto" settings into concrete ones for ``device``.

    On a CPU device forward/backward and the CPU step run on the same cores: a gradient worker thread
    or a step running beside backward only competes with it (docs/benchmarks.md, "CPU device, default
    settings"), so the schedule is synchronous, nothing overlaps, and the kernels use torch's own thread
    count (at most this rank's share of the cores). On an accelerator the host cores are free during
    forward/backward: the gradient worker overlaps backward, the CPU step is speculated behind it (exact,
    and faster on the simulated device: docs/benchmarks.md) and each rank gets its share of the node's
    cores.
    """
    accelerator = device.type != "cpu"
    cpu_step = options.cpu_step if options.cpu_step != "auto" else ("speculative" if accelerator else "sync")
    overlap = options.overlap if options.overlap is not None else accelerator
    if options.cpu_threads is None:
        threads = default_cpu_threads(local_world_size)
        if not accelerator:  # the threads forward/backward use, never more than this rank's share of cores
            threads = min(threads, torch.get_num_threads())
    else:
        threads = options.cpu_threads
        cores = usable_cores()
        if threads > cores:
            warnings.warn(
                f"cpu_threads={threads} is more than the {cores} cores this process may use; using {cores} "
                "(more threads than cores only makes the CPU step slower)",
                UserWarning,
                stacklevel=3,
            )
            threads = cores
    return Resolved(cpu_step, overlap, max(1, threads))  # type: ignore[arg-type]


def use_in_place(
    options: OffloadOptions, device: torch.device, param_dtype: torch.dtype, world_size: int, cpu_step: str
) -> bool:
    """Whether the engine runs in place (engine/in_place.py) instead of the offload data path.

    Only where nothing would be offloaded: forward/backward on the CPU itself, in fp32 (the device
    parameters *are* fp32 master weights), one process (no shards) and the synchronous step (the other
    schedules keep device weights apart from the master on purpose). There the offload path's copies
    are pure cost (docs/benchmarks.md, "CPU device, default settings").
    """
    reasons = [
        why
        for why, unmet in (
            (f"the device is {device.type}, not cpu", device.type != "cpu"),
            (f"the parameters are {param_dtype}, not float32 (precision='32-true')", param_dtype != torch.float32),
            (f"there are {world_size} processes, not 1", world_size != 1),
            (f"cpu_step is {cpu_step!r}, not 'sync'", cpu_step != "sync"),
        )
        if unmet
    ]
    if options.in_place_on_cpu and reasons:
        raise ValueError(
            "in_place_on_cpu=True needs a CPU device, precision='32-true', one process and cpu_step='sync', but "
            + "; ".join(reasons)
            + ". Leave in_place_on_cpu unset (None) to use it exactly where it applies."
        )
    return options.in_place_on_cpu is not False and not reasons
