"""The speculative schedule against the synchronous one (the exactness contract), and resume at every schedule.

Each run drives the engine as the strategy does: ``expect_step()`` before the backward that ends an
accumulation window, ``begin_backward()`` / ``finish_backward()`` around every backward, then ``step()``.
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_helpers import CPU, batches, options
from schedule_helpers import Net, snapshot, train, warmup
from torch import nn

from lightning_zero_offload.engine import LossScalerConfig, OffloadEngine
from lightning_zero_offload.testing.ranks import run_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("clip_norm", [None, 1e6], ids=["no-clip", "clip-not-triggered"])
def test_speculative_is_bitwise_sync_when_nothing_triggers(dtype, clip_norm):
    sync, sync_net, _ = train("sync", dtype, clip_norm=clip_norm)
    spec, spec_net, history = train("speculative", dtype, clip_norm=clip_norm)
    assert_bitwise(snapshot(spec, spec_net), snapshot(sync, sync_net))
    # the steps really ran during backward (else the test would pass trivially); buckets holding a
    # parameter without gradient (odd steps) wait for the all-reduce, the others are speculated
    assert all(s.speculated_fraction > 0.3 for s in history)
    assert min(s.speculated_fraction for s in history[1::2]) < max(s.speculated_fraction for s in history[::2]) <= 1
    assert spec.schedule.rollbacks == 0 and not any(s.rolled_back for s in history)


def median_norm() -> float:
    _, _, history = train("sync")
    norms = sorted(s.grad_norm for s in history)
    return norms[len(norms) // 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "factor", [1.0, 1e1, 1e4] + [pytest.param(f, marks=pytest.mark.slow) for f in (1e2, 1e3, 1e5)]
)  # the fast tier: no spike, a mild and a strong one
@pytest.mark.parametrize("clip", [{"clip_norm": 1.0}, {"clip_value": 1.0}], ids=["norm", "value"])
def test_a_clipped_spike_is_rolled_back_to_sync_bitwise_by_default(dtype, factor, clip):
    """One step's gradient x``factor`` under clipping, with the default rollback: the speculated step is
    taken back and redone as sync does it, whatever the strength (the undo's moments cancel there)."""
    sync, sync_net, sync_history = train("sync", dtype, spike=(6, factor), **clip)
    spec, spec_net, history = train("speculative", dtype, spike=(6, factor), **clip)
    assert spec.resolved.speculation_rollback == "snapshot"
    assert history[6].rolled_back or factor == 1.0  # the spike's step was speculated, then clipped
    assert_bitwise(snapshot(spec, spec_net), snapshot(sync, sync_net))


@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
def test_a_clipped_spike_with_a_device_share_is_rolled_back_as_without_one(cpu_state):
    """The last buckets' state on the device (never speculated) and the spike's speculated host buckets rolled back:
    the same as sync with the share, and as sync without one (bf16 state bitwise; fp32 to rounding, observed 0)."""
    spike = dict(spike=(6, 1e4), clip_norm=1.0, cpu_state=cpu_state)
    sync, sync_net, _ = train("sync", **spike)
    shared, shared_net, _ = train("sync", device_share=0.5, **spike)
    spec, spec_net, history = train("speculative", device_share=0.5, **spike)
    assert spec.state.device_share_numel > 0 and spec.state.split > 0 and history[6].rolled_back
    assert_bitwise(snapshot(spec, spec_net), snapshot(shared, shared_net))
    for ours, ref in zip(snapshot(spec, spec_net), snapshot(sync, sync_net)):
        if cpu_state == "bf16":
            assert torch.equal(ours, ref)
        else:
            torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rollback", ["snapshot", "undo"])
def test_clipping_that_triggers_on_some_steps_is_corrected(rollback):
    clip = median_norm()  # triggers on about half of the steps
    sync, sync_net, sync_history = train("sync", clip_norm=clip)
    spec, spec_net, history = train("speculative", clip_norm=clip, speculation_rollback=rollback)
    assert spec.schedule.rollbacks > 0 and any(s.rolled_back for s in history)
    assert any(s.speculated_fraction > 0 for s in history)
    if rollback == "snapshot":
        assert_bitwise(snapshot(spec, spec_net), snapshot(sync, sync_net))
    else:  # the inverted step is exact up to one fp32 rounding per value
        for ours, ref in zip(snapshot(spec, spec_net), snapshot(sync, sync_net)):
            torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rollback", ["snapshot", "undo"])
def test_clip_by_value_redoes_only_the_buckets_over_the_limit(rollback):
    sync, sync_net, _ = train("sync", torch.float32, clip_value=0.02)
    spec, spec_net, history = train("speculative", torch.float32, clip_value=0.02, speculation_rollback=rollback)
    assert spec.schedule.rollbacks > 0
    tolerance = {"rtol": 0, "atol": 0} if rollback == "snapshot" else {"rtol": 1e-6, "atol": 1e-7}
    for ours, ref in zip(snapshot(spec, spec_net), snapshot(sync, sync_net)):
        torch.testing.assert_close(ours, ref, **tolerance)


def test_speculation_pauses_while_clipping_triggers_and_resumes_after():
    spec, _, history = train("speculative", steps=14, clip_norm=1e-3)  # clips every step
    schedule = spec.schedule
    triggers = schedule.PAUSE_TRIGGERS
    assert schedule.rollbacks == triggers  # then paused: no more wasted passes
    assert all(s.speculated_fraction == 0 for s in history[triggers:])
    schedule.recent.extend([False] * schedule.WINDOW)  # the trigger rate fell
    assert not schedule.paused


def test_fp16_overflow_is_skipped_and_rolled_back_exactly_as_sync():
    scaler = LossScalerConfig(hysteresis=1)
    sync, sync_net, sync_history = train("sync", torch.float16, inf_at=5, loss_scaler=scaler)
    spec, spec_net, history = train("speculative", torch.float16, inf_at=5, loss_scaler=scaler)
    assert history[5].skipped and sync_history[5].skipped and spec.skipped_steps == sync.skipped_steps == 1
    assert spec.loss_scale == sync.loss_scale < 2.0**16  # backed off
    assert_bitwise(snapshot(spec, spec_net), snapshot(sync, sync_net))
    assert history[5].rolled_back and spec.schedule.rollbacks == 1  # the finite buckets were speculated
    assert history[4].speculated_fraction > 0 and history[6].speculated_fraction > 0


def test_an_announced_step_that_never_comes_is_rolled_back():
    """A caller announces a step on every backward: the accumulation backward's speculation is undone."""
    sync, sync_net, _ = train("sync")
    spec, spec_net, _ = train("speculative", announce_every_backward=True, speculation_rollback="snapshot")
    assert spec.schedule.rollbacks == 12  # one per accumulation window
    assert_bitwise(snapshot(spec, spec_net), snapshot(sync, sync_net))


def test_zero_grad_between_forward_and_backward_keeps_the_snapshot_taken_behind_the_forward(monkeypatch):
    """Lightning's loop calls zero_grad after the training forward and before backward: with nothing speculated
    yet, the snapshot taken behind that forward still holds, and backward takes none (it took each bucket's again,
    exposed: docs/benchmarks.md, "The ZeRO-2 share after Lightning's zero_grad stopped undoing the snapshot")."""
    from lightning_zero_offload.engine.step.cpu_state import CpuState

    taken = []
    snapshot_of = CpuState.snapshot
    monkeypatch.setattr(CpuState, "snapshot", lambda self, *args: taken.append(1) or snapshot_of(self, *args))
    net = Net()
    engine = OffloadEngine(net.optimizer(), CPU, torch.float32, options(cpu_step="speculative", bucket_size_mb=1e-3))
    steps = 4
    for step, (x, y) in enumerate(batches(steps, seed=3)):
        engine.expect_step(publish_early=True)
        engine.before_training_forward()
        loss = nn.functional.cross_entropy(net(x, step), y)
        engine.zero_grad()
        engine.begin_backward()
        loss.backward()
        engine.finish_backward()
        assert engine.step().speculated_fraction > 0.9
    host_buckets = engine.state.first_device_bucket
    assert host_buckets > 2 and len(taken) == steps * host_buckets  # once per bucket and step, behind the forward


def test_auto_is_sync_on_a_cpu_device_and_options_resolve_per_device():
    engine, _, history = train("auto", steps=1, overlap=None, cpu_threads=None)
    assert engine.schedule.name == "sync" and not engine.overlap
    assert engine.num_threads == min(torch.get_num_threads(), len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("cpu_step", ["sync", "speculative", "delayed"])
def test_resume_from_engine_state_is_bitwise(cpu_step):
    full, full_net, _ = train(cpu_step, steps=8, clip_norm=0.5)
    first, first_net, _ = train(cpu_step, steps=4, clip_norm=0.5)
    saved = {
        "engine": first.state_dict(),
        "optimizer": first.optimizer_state_dict(),
        "master": first.master_params(),
    }
    if cpu_step == "delayed":
        assert "pending" in saved["engine"]["schedule"]  # stale device weights in use
    # a fresh engine on a fresh model, loaded as the strategy does: weights, optimizer, engine state
    net = Net()
    engine = OffloadEngine(net.optimizer(), CPU, torch.bfloat16, options(cpu_step=cpu_step, **warmup(cpu_step)))
    engine.load_master_params(saved["master"])
    engine.load_optimizer_state_dict(saved["optimizer"])
    engine.load_state_dict(saved["engine"])
    data = batches(16, seed=3)
    for step in range(4, 8):
        for micro in range(2):
            x, y = data[step * 2 + micro]
            if micro == 1:
                engine.expect_step(publish_early=True)
            engine.begin_backward()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(net(x, step).float(), y) / 2
            loss.backward()
            engine.finish_backward()
        engine.step(clip_norm=0.5)
        for group in engine.optimizer.param_groups:
            group["lr"] *= 0.9
    assert_bitwise(snapshot(engine, net), snapshot(full, full_net))


@pytest.mark.slow  # two ranks in processes
def test_speculative_equals_sync_at_two_ranks(tmp_path):
    from workers.schedules import speculative_against_sync  # it imports this module by its plain name

    run_ranks(speculative_against_sync, 2, tmp_path, timeout=240)  # every rank checks its results


def test_speculation_gives_way_to_sync_where_its_snapshot_does_not_hide_and_is_tried_again(monkeypatch):
    """The chooser, on a clock of its own: speculating steps that wait for the snapshot take 12 units, sync
    steps 10; it measures sync after a late step, keeps the faster, and measures speculation again later."""
    from lightning_zero_offload.engine.schedules import chooser as chooser_module

    now = [0.0]
    monkeypatch.setattr(chooser_module.time, "perf_counter", lambda: now[0])
    chooser = chooser_module.SpeculationChooser()

    def step(waited: float, speculating_takes: float = 12.0, sync_takes: float = 10.0) -> bool:  # seconds
        speculated = chooser.speculating
        chooser.forward_started()
        chooser.waited_for_snapshot(waited if speculated else 0.0)
        now[0] += speculating_takes if speculated else sync_takes
        chooser.step_done(speculated)
        return speculated

    assert all(step(waited=0.0) for _ in range(5))  # the snapshot hid: nothing measured, nothing changes
    assert step(waited=1.0) and step(waited=0.0) and step(waited=1.0)  # one late step at a time: nothing either
    modes = [step(waited=1.0) for _ in range(8)]
    assert modes[:5] == [True, False, False, False, False]  # late twice in a row, then three sync steps: sync wins
    # sync holds for HOLD_STEPS steps from the choice (4 of them above), then speculation is measured again
    assert not any(step(waited=1.0) for _ in range(chooser_module.SpeculationChooser.HOLD_STEPS - 4))
    modes = [step(waited=1.0, speculating_takes=8.0) for _ in range(6)]
    assert modes == [True] * 6  # faster now: it stays
