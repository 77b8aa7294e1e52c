"""Bucket landings and backward's length: on the host clock, time in the gradient hooks after a launch is not
backward's; where the device has events, both on the device's clock, whatever the host's says."""

from __future__ import annotations

from lightning_zero_offload.engine.step import landings
from lightning_zero_offload.engine.step.landings import LandingClock


def test_a_lead_counts_backwards_time_not_the_hooks_after_the_launch(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(landings.time, "perf_counter", lambda: now[0])
    clock = LandingClock(3)

    def hook(start: float, end: float, launches: dict[int, float]) -> None:
        now[0] = start
        clock.hook_started()
        for bucket, at in launches.items():
            clock.launched(bucket, at, None)
        now[0] = end
        clock.hook_ended()

    clock.pass_started(-3.0, None)  # a pass that failed before its end
    hook(-2.0, -1.0, {2: -1.5})
    clock.pass_started(-0.5, None)
    hook(0.0, 1.0, {0: 0.5})  # backward computes from 1 to 3
    hook(3.0, 5.0, {1: 3.2})  # a split parameter's hook: its buckets leave while backward has nothing left
    hook(5.0, 5.5, {})  # the last gradient: backward's end
    clock.end_pass(backward_end=6.0, device_end=None)
    assert clock.leads == [2.0, 0.0, 0.0]  # bucket 2 never launched: as before
    assert clock.pass_s == 2.5  # computing from -0.5 to 0 and from 1 to 3: bucket 0 landed 0.5 s in

    clock.pass_started(9.5, None)
    hook(10.0, 10.2, {2: 10.1})
    clock.end_pass(backward_end=11.0, device_end=None)  # one hook: the next pass starts afresh
    assert clock.leads == [2.0, 0.0, 0.0] and clock.pass_s == 0.5


class DeviceEvent:
    """A timing event at ``at`` seconds on a device's clock."""

    def __init__(self, at: float) -> None:
        self.at = at

    def elapsed_time(self, end: DeviceEvent) -> float:
        return 1e3 * (end.at - self.at)


def test_where_the_device_has_events_backwards_length_is_the_devices_like_the_leads(monkeypatch):
    """A GPU runs backward after the host queued it: its leads and length both on the device's clock, so that no
    bucket lands before backward starts (the host's 0.3 s of queueing against the device's 10 s of backward)."""
    now = [0.0]
    monkeypatch.setattr(landings.time, "perf_counter", lambda: now[0])
    clock = LandingClock(2)
    clock.pass_started(0.0, DeviceEvent(100.0))
    now[0] = 0.1
    clock.hook_started()
    clock.launched(0, 0.1, DeviceEvent(104.0))
    clock.launched(1, 0.1, DeviceEvent(109.0))
    now[0] = 0.2
    clock.hook_ended()
    clock.end_pass(backward_end=0.3, device_end=DeviceEvent(110.0))
    assert clock.leads == [6.0, 1.0] and clock.pass_s == 10.0
    landed = [clock.pass_s - lead for lead in clock.leads]
    assert landed == [4.0, 9.0]
