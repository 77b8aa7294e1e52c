"""Bucket landings on the host clock: time in the gradient hooks after a launch is not backward's."""

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

    hook(0.0, 1.0, {0: 0.5})  # backward computes from 1 to 3
    hook(3.0, 5.0, {1: 3.2})  # a split parameter's hook: its buckets leave while backward has nothing left
    hook(5.0, 5.5, {})  # the last gradient: backward's end
    clock.end_pass(backward_end=6.0, device_end=None)
    assert clock.leads == [2.0, 0.0, 0.0]  # bucket 2 never launched: as before

    hook(10.0, 10.2, {2: 10.1})
    clock.end_pass(backward_end=11.0, device_end=None)  # one hook: the next pass starts afresh
    assert clock.leads == [2.0, 0.0, 0.0]
