"""Whether speculating pays, measured, where the speculative schedule's snapshot does not hide behind
forward and backward (engine/schedules/speculative.py): a few steps timed as sync, the faster kept."""

from __future__ import annotations

import statistics
import time
from collections import deque


class SpeculationChooser:
    """Whether speculating pays, measured, where its snapshot does not hide behind forward and backward.

    A step's time runs from its first forward to the end of the step. While the snapshot is ready when
    the first speculated bucket needs it, speculating costs nothing extra and nothing changes. After a
    step that waited for it (longer than 2% of the step and ``LATE_S``) ``LATE_STEPS`` times in a row,
    the next ``PROBE_STEPS`` steps run as sync, and the faster of the two (median step time) runs for
    the next ``HOLD_STEPS``; then the other one is timed again. Results do not depend on it: a
    speculated step equals the synchronous one.
    """

    PROBE_STEPS = 3
    HOLD_STEPS = 64
    LATE_S = 5e-3  # a wait shorter than this is a thread waking up, not a snapshot that did not hide
    LATE_STEPS = 2  # consecutive steps that waited, before sync is timed

    def __init__(self) -> None:
        self.speculating = True
        self.probing = False
        self.hold = 1  # steps before the choice may be measured again (the first step warms up)
        self.times: dict[bool, deque[float]] = {True: deque(maxlen=self.PROBE_STEPS), False: deque(maxlen=3)}
        self._start: float | None = None
        self._waited = 0.0
        self._late_steps = 0

    def forward_started(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def waited_for_snapshot(self, seconds: float) -> None:
        self._waited += seconds

    def step_done(self, speculated: bool) -> None:
        start, waited, self._start, self._waited = self._start, self._waited, None, 0.0
        if start is None:
            return
        elapsed = time.perf_counter() - start
        if speculated == self.speculating:  # not a step paused for clipping
            self.times[speculated].append(elapsed)
        self.hold = max(0, self.hold - 1)
        late = speculated and waited > max(self.LATE_S, 0.02 * elapsed)
        self._late_steps = self._late_steps + 1 if late else 0
        if self.probing:
            if len(self.times[self.speculating]) >= self.PROBE_STEPS:
                self._choose()
        elif self.hold == 0 and (not self.speculating or self._late_steps >= self.LATE_STEPS):
            self.probing, self.speculating = True, not self.speculating  # measure the other one
            self.times[self.speculating].clear()

    def _choose(self) -> None:
        medians = {mode: statistics.median(times) for mode, times in self.times.items() if times}
        self.speculating = medians.get(True, 0.0) <= medians.get(False, float("inf"))
        self.probing, self.hold = False, self.HOLD_STEPS
