"""``cpu_step="sync"``: the CPU step after backward, on the critical path."""

from __future__ import annotations

from lightning_zero_offload.engine.schedules.base import Schedule, StepInputs, apply_now
from lightning_zero_offload.engine.stats import StepStats


class SyncSchedule(Schedule):
    """After backward: clip, CPU Adam and copy-back, bucket k published while bucket k+1 updates.

    Exact and simple; the whole CPU step is on the critical path, so it owns no state.
    """

    name = "sync"

    def apply(self, inputs: StepInputs, stats: StepStats) -> None:
        apply_now(self.parts, inputs, stats)
