"""When the CPU optimizer step runs: one class per ``cpu_step`` value, behind :class:`Schedule`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_zero_offload.engine.schedules.base import Schedule, StepInputs
from lightning_zero_offload.engine.schedules.delayed import DelayedSchedule
from lightning_zero_offload.engine.schedules.speculative import SpeculativeSchedule
from lightning_zero_offload.engine.schedules.sync import SyncSchedule

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.parts import ScheduleParts
    from lightning_zero_offload.engine.step.update import UpdatePipeline

SCHEDULES: dict[str, Callable[[ScheduleParts[UpdatePipeline]], Schedule]] = {
    s.name: s for s in (SyncSchedule, SpeculativeSchedule, DelayedSchedule)
}


def make_schedule(name: str, parts: ScheduleParts[UpdatePipeline]) -> Schedule:
    """The schedule ``cpu_step=name`` on the offload path (in place the engine runs ``SyncSchedule`` only)."""
    return SCHEDULES[name](parts)


__all__ = ["DelayedSchedule", "Schedule", "SpeculativeSchedule", "StepInputs", "SyncSchedule", "make_schedule"]
