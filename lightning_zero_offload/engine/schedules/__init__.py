"""When the CPU optimizer step runs: one class per ``cpu_step`` value, behind :class:`Schedule`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_zero_offload.engine.schedules.base import Schedule, StepInputs
from lightning_zero_offload.engine.schedules.delayed import DelayedSchedule
from lightning_zero_offload.engine.schedules.speculative import SpeculativeSchedule
from lightning_zero_offload.engine.schedules.sync import SyncSchedule

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.parts import ScheduleParts

SCHEDULES: dict[str, type[Schedule]] = {s.name: s for s in (SyncSchedule, SpeculativeSchedule, DelayedSchedule)}


def make_schedule(name: str, parts: ScheduleParts) -> Schedule:
    return SCHEDULES[name](parts)


__all__ = ["DelayedSchedule", "Schedule", "SpeculativeSchedule", "StepInputs", "SyncSchedule", "make_schedule"]
