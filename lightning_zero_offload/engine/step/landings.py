"""When each bucket's gradient landed in the last backward pass: seconds before backward's end ("auto"'s device share,
engine/step/device_share.py).

Where the device has timing events a bucket lands when its transfer starts on the device, and backward starts and
ends with the events ``begin`` and ``finish_backward`` record: all on the device's clock, which the host's hooks do
not move and which runs behind the host's (a GPU's backward ends well after the host queued it: its length on the
host clock would put a lead before backward's start). On a CPU device the host clock stands in, and backward's end
is the last gradient's hook; the hooks run on the thread that computes backward, so the time spent in them after a
bucket left is not backward's and does not count in its lead (a split embedding's hook sends its buckets one after
the other while backward has nothing left to compute), nor in the pass's length.
"""

from __future__ import annotations

import time

import torch


class LandingClock:
    """A backward pass's launches and gradient hooks on the host clock (and the device's, where it has events)."""

    def __init__(self, n_buckets: int) -> None:
        self.leads = [0.0] * n_buckets  # the last pass's, per bucket
        self.pass_s = 0.0  # the last pass's backward, on the clock of its leads
        self._started: tuple[float, torch.Event | None] | None = None  # this pass's start: host clock, device event
        self._launched: dict[int, tuple[float, torch.Event | None, float]] = {}  # at, started, hook seconds by then
        self._hook_started: float | None = None
        self._hook_s = 0.0  # in this pass's hooks so far (the one running excluded)
        self._last_gradient: tuple[float, float] | None = None  # its hook's start, the hook seconds before it

    def pass_started(self, at: float, event: torch.Event | None) -> None:
        """Backward starts at ``at`` (and ``event`` where the device has events): a pass that failed before its end
        leaves nothing behind."""
        self._started = (at, event)
        self._launched, self._hook_s, self._hook_started, self._last_gradient = {}, 0.0, None, None

    def hook_started(self) -> None:
        self._hook_started = time.perf_counter()
        self._last_gradient = (self._hook_started, self._hook_s)

    def hook_ended(self) -> None:
        if self._hook_started is not None:
            self._hook_s += time.perf_counter() - self._hook_started
            self._hook_started = None

    def launched(self, bucket_index: int, at: float, started: torch.Event | None) -> None:
        in_hook = 0.0 if self._hook_started is None else at - self._hook_started
        self._launched[bucket_index] = (at, started, self._hook_s + in_hook)

    def end_pass(self, backward_end: float, device_end: torch.Event | None) -> None:
        """Set :attr:`leads` and :attr:`pass_s` from this pass (``device_end``: backward's end on the device's clock,
        completed, where the launches and the start were timed with events too)."""
        launched, self._launched = self._launched, {}
        last, self._last_gradient = self._last_gradient, None
        host_end, hooks_by_end = (backward_end, self._hook_s) if last is None else last
        start, self._started = self._started, None
        start_at, start_event = (host_end, None) if start is None else start
        self._hook_s, self._hook_started = 0.0, None
        if device_end is not None and start_event is not None:
            self.pass_s = start_event.elapsed_time(device_end) / 1e3
        else:
            self.pass_s = max(0.0, host_end - start_at - hooks_by_end)
        for index, (at, started, hooks_by_launch) in launched.items():
            if device_end is not None and started is not None:
                lead = started.elapsed_time(device_end) / 1e3
            else:
                lead = host_end - at - max(0.0, hooks_by_end - hooks_by_launch)
            self.leads[index] = max(0.0, lead)
