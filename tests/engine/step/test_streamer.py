"""Gradient streaming: device-buffer reuse, launch order, worker threads, transfer timing.

The GPU-only behaviours are made observable on the CPU with stand-in events whose completion the test
controls (on a CUDA device they are real events; the selection logic is the same code).
"""

import threading

import pytest
import torch
from engine_helpers import (
    CPU,
    Layers,
    batches,
    layers_training,
    loss_fn,
    make_net,
    options,
    two_groups,
)
from torch import nn
from workers.streaming import two_rank_checks

from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.infra import memory, streams
from lightning_zero_offload.engine.stats import hidden_fraction
from lightning_zero_offload.engine.step import streamer as grads
from lightning_zero_offload.engine.step.launch_order import Launch, LaunchOrder
from lightning_zero_offload.engine.step.layout import build_layout
from lightning_zero_offload.engine.step.streamer import DEVICE_BUFFER_CAP
from lightning_zero_offload.testing.ranks import run_ranks


class StandInEvent:
    """An event the test completes: ``query`` says whether the transfer it marks has finished."""

    done = False

    def query(self) -> bool:
        return self.done

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "StandInEvent") -> float:
        return 0.0


def stand_in_events(monkeypatch, done: bool) -> None:
    def record(device, timing=False):
        event = StandInEvent()
        event.done = done
        return event

    monkeypatch.setattr(grads, "record_event", record)


def bf16_run(net: nn.Module, steps: int, **kwargs) -> OffloadEngine:
    engine = OffloadEngine(two_groups(net), CPU, torch.bfloat16, options(**kwargs))
    for batch in batches(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(net, batch).backward()
        engine.step()
    return engine


def test_a_transfer_in_flight_is_never_waited_for_by_the_next_bucket(monkeypatch):
    """Transfers that never finish (the slowest bus): buffers grow to the cap, then the compute stream
    waits for the oldest transfer, never the one launched just before."""
    stand_in_events(monkeypatch, done=False)
    engine = bf16_run(make_net(width=64), 2)
    pool = engine.grads.device_buffers
    assert len(engine.layout.buckets) > DEVICE_BUFFER_CAP
    assert pool.allocated == DEVICE_BUFFER_CAP
    assert pool.waits, "with transfers that never finish, the cap must be reached"
    for waited, latest in pool.waits:
        assert waited != latest
    # results do not depend on which buffer a bucket got
    monkeypatch.undo()
    reference = bf16_run(make_net(width=64), 2)
    assert all(torch.equal(a, b) for a, b in zip(engine.master_params(), reference.master_params()))


def test_completed_transfers_are_reused_oldest_first_without_waiting(monkeypatch):
    stand_in_events(monkeypatch, done=True)
    engine = bf16_run(make_net(width=64), 2)
    pool = engine.grads.device_buffers
    assert pool.waits == [] and pool.allocated <= 2
    assert engine.memory_report()["device_grad_buffers_peak"] == pool.allocated


def test_device_buffer_pool_prefers_the_oldest_completed_buffer():
    pool = memory.DeviceBufferPool(4, torch.float32, CPU, cap=3)
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    events = [StandInEvent() for _ in range(3)]
    for tag, (buffer, event) in enumerate(zip((a, b, c), events)):
        pool.release(buffer, event, tag)
    events[1].done = events[2].done = True
    assert pool.acquire() is b  # a is still in flight; b is the oldest that finished
    assert pool.acquire() is c
    assert pool.acquire() is a and pool.waits == [(0, 2)]  # at the cap: wait for the oldest
    assert pool.allocated == 3


class CountedWaits(StandInEvent):
    """Counts the stream waits queued on it."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.waits = 0

    def wait(self, stream=None) -> None:
        self.waits += 1


def test_a_reused_buffer_gets_a_stream_wait_even_when_its_transfer_has_completed():
    """A completed ``query()`` is no synchronisation for the CUDA sanitizer; a stream wait is (and costs
    nothing once the event has completed)."""
    pool = memory.DeviceBufferPool(4, torch.float32, CPU, cap=3)
    a, b = pool.acquire(), pool.acquire()
    done, in_flight = CountedWaits(done=True), CountedWaits(done=False)
    pool.release(a, in_flight, 0)
    pool.release(b, done, 1)
    assert pool.acquire() is b and done.waits == 1
    assert pool.waits == []  # not a wait for a transfer in flight


def test_buffers_beyond_the_cap_are_freed_once_their_transfer_has_completed():
    pool = memory.DeviceBufferPool(4, torch.float32, CPU, cap=3)
    buffers = [pool.acquire() for _ in range(5)]  # none returned yet: the pool allocates past its cap
    events = [CountedWaits(done=False) for _ in buffers]
    for tag, (buffer, event) in enumerate(zip(buffers, events)):
        pool.release(buffer, event, tag)
    assert pool.allocated == 5  # the two beyond the cap still wait for their transfers
    for event in events:
        event.done = True
    assert pool.acquire() is buffers[2] and pool.allocated == 3  # the first two returned were the extra ones
    assert pool.peak == 5
    kept = [pool.acquire() for _ in range(2)]  # the two others kept, taken without allocating
    assert pool.allocated == 3 and all(any(b is k for b in buffers) for k in kept)


def peaks_per_step(net: nn.Module, engine: OffloadEngine, data) -> list[int]:
    peaks = []
    for batch in data:
        loss_fn(net, batch).backward()
        engine.step()
        peaks.append(engine.grads.take_device_buffer_peak())
    return peaks


@pytest.mark.parametrize("backwards", [True, False])
def test_out_of_order_model_holds_at_most_two_buckets_and_matches_torch(backwards):
    ref_net, net = Layers(backwards), Layers(backwards)
    ref_opt = torch.optim.AdamW(ref_net.parameters(), lr=1e-2)
    engine = OffloadEngine(torch.optim.AdamW(net.parameters(), lr=1e-2), CPU, torch.float32, options())
    assert len(engine.layout.buckets) >= 6
    assert engine.layout.slots[-1].bucket == engine.layout.slots[-3].bucket == 0  # unused shares bucket 0
    data = batches(5)
    peaks = peaks_per_step(net, engine, data)
    # The first backward learns which parameters get no gradient (bucket 0 waits for it until the flush).
    assert max(peaks[1:]) <= 2, peaks
    if backwards:
        assert peaks[0] <= 2, peaks
    for batch in data:
        loss_fn(ref_net, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p_ref, master in zip(ref_net.parameters(), engine.master_params()):
        torch.testing.assert_close(master, p_ref.detach(), rtol=1e-5, atol=1e-6)


def test_a_gradient_arriving_after_its_bucket_left_is_still_added():
    """The unused layer gets gradients from step 3 on: its bucket has already left when they arrive
    (the first backward taught the streamer not to wait for them), so they go in a second launch."""

    class LateUse(Layers):
        use_extra = False

        def forward(self, x):
            out = super().forward(x)
            return out + self.unused(x[:, :4]) if self.use_extra else out

    ref_net, net = LateUse(False), LateUse(False)
    ref_opt = torch.optim.AdamW(ref_net.parameters(), lr=1e-2)
    engine = OffloadEngine(torch.optim.AdamW(net.parameters(), lr=1e-2), CPU, torch.float32, options())
    for step, batch in enumerate(batches(6)):
        ref_net.use_extra = net.use_extra = step >= 2
        for model in (ref_net, net):
            loss_fn(model, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        engine.step()
    for p_ref, master in zip(ref_net.parameters(), engine.master_params()):
        torch.testing.assert_close(master, p_ref.detach(), rtol=1e-5, atol=1e-6)


def test_worker_threads_make_the_engine_device_current(monkeypatch):
    seen = []
    monkeypatch.setattr(
        streams, "set_thread_device", lambda device: seen.append((threading.current_thread().name, device))
    )
    engine = bf16_run(make_net(), 1)
    names = {name.rsplit("_", 1)[0] for name, _ in seen}
    assert names == {"zero-offload-grads", "zero-offload-step"}
    assert all(device == CPU for _, device in seen)
    engine.close()


def test_set_thread_device_selects_the_index(monkeypatch):
    selected = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", selected.append)
    pool = streams.worker_pool("probe", torch.device("cuda", 1))
    pool.submit(lambda: None).result()
    pool.shutdown()
    streams.set_thread_device(CPU)  # nothing to select on the CPU
    assert selected == [1]


def test_transfer_time_split_is_hidden_plus_exposed():
    for overlap in (True, False):
        engine = bf16_run(make_net(width=64), 1, overlap=overlap)
        assert 0 <= engine.last.transfer_wait_s <= engine.last.transfer_s
        if not overlap:  # the accumulate runs on the training thread: nothing is hidden
            assert engine.last.transfer_wait_s == engine.last.transfer_s


def test_hidden_fraction_stays_a_fraction():
    assert hidden_fraction(0.0, 0.0) == 0.0
    assert hidden_fraction(2.0, 0.5) == 0.75
    assert hidden_fraction(1.0, 2.8) == 0.0  # a wait longer than the work (scheduling) hides nothing
    assert hidden_fraction(1.0, -1e-9) == 1.0


def test_device_timing_counts_only_the_part_after_backward_as_exposed():
    """Side-stream transfers timed with events: spans before the backward-end event are hidden."""
    clock = iter(range(100))

    class Timed(StandInEvent):
        done = True

        def __init__(self):
            self.t = float(next(clock))

        def elapsed_time(self, other):
            return other.t - self.t

    origin = Timed()  # t=0
    spans = [(Timed(), Timed()), (Timed(), Timed())]  # [1, 2] and [3, 4] ms
    end = Timed()  # backward ends at 5 ms: both spans hidden
    spans.append((Timed(), Timed()))  # [6, 7] ms: after the end, exposed
    total, hidden = streams.device_transfer_times(origin, spans, end)
    assert total == pytest.approx(3e-3) and total - hidden == pytest.approx(1e-3)


@pytest.mark.slow  # ranks in processes
def test_two_ranks_fp16_headroom_and_agreed_launch_order(tmp_path):
    """Two gloo ranks: fp16 gradients that overflow when summed are averaged without overflow, and a
    model with an unused parameter and its head declared first holds at most two buckets after the
    first backward, with the same result as one rank."""
    fp16, peaks, weights = zip(*run_ranks(two_rank_checks, 2, tmp_path))
    assert fp16 == ((40000.0, False),) * 2
    assert all(max(p[1:]) <= 2 for p in peaks), peaks
    single = layers_training(rank=0, world=1)[1]
    for a, b, ref in zip(weights[0], weights[1], single):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-6)


def check_every_order(results: list[dict], world: int) -> None:
    for key, first in results[0].items():
        order, _, capped = key.split("/")
        assert first["buckets"] > 2 * DEVICE_BUFFER_CAP, key
        for rank, everything in enumerate(results):
            result = everything[key]
            assert all(torch.equal(a, b) for a, b in zip(result["master"], first["master"])), (key, rank)
            if capped == "True":
                # within the cap on the first backward (for any registration order), and at most the cap
                # kept by the pool afterwards
                assert result["peaks"][0] <= DEVICE_BUFFER_CAP, (key, rank, result["peaks"])
                assert result["kept"] <= DEVICE_BUFFER_CAP, (key, rank, result["kept"])
                if world == 1:  # every backward: no peer to agree with, a bucket may leave early at any time
                    assert max(result["peaks"]) <= DEVICE_BUFFER_CAP, (key, result["peaks"])
                if "/72/" in key:  # a bucket per block: each leaves in the learned order as it completes
                    assert max(result["peaks"][1:]) <= 2, (key, rank, result["peaks"])
                if world == 1 or "/72/" in key:
                    assert result["most"] <= DEVICE_BUFFER_CAP, (key, rank, result["most"])
                # sending buckets early to stay within the cap changes no bit
                uncapped = everything.get(f"{order}/{key.split('/')[1]}/False", result)
                assert all(torch.equal(a, b) for a, b in zip(result["master"], uncapped["master"])), (key, rank)
    # without the cap, the first backward of the reversed and shuffled models holds more (the case above)
    assert results[0]["reversed/72/False"]["peaks"][0] > DEVICE_BUFFER_CAP or world == 1
    assert results[0]["shuffled/100/False"]["peaks"][0] > DEVICE_BUFFER_CAP


def test_one_rank_stays_within_the_cap_for_any_registration_order():
    """One rank: a bucket whose gradients arrive far apart (a shuffled model, buckets straddling blocks)
    leaves partially when the cap is reached, the rest following, with bitwise the same result."""
    from workers.streaming import every_order

    check_every_order([every_order(0, 1)], world=1)


@pytest.mark.slow  # ranks in processes
@pytest.mark.parametrize("world", [2, 3])
def test_several_ranks_stay_within_the_cap_on_the_first_backward(tmp_path, world):
    """gloo ranks, models registered forward, reversed and shuffled: on the first backward the ranks agree
    which buckets leave (no order is known yet), so no rank holds more than the cap; results are the same
    on every rank and bitwise those of a run without the cap."""
    from workers import streaming

    fn = streaming.every_order_two_ranks if world == 2 else streaming.every_order_three_ranks
    check_every_order(run_ranks(fn, world, tmp_path), world)


def test_the_launch_order_yields_each_bucket_to_send_with_what_its_buffer_holds():
    """One rank, room for one device buffer: LaunchOrder decides, and hands back what to send (no callback)."""
    layout = build_layout([torch.Size([4])] * 4, bucket_numel=8)  # buckets (3, 2) and (1, 0)
    order = LaunchOrder(layout, None, CPU, cap=1)
    b01, b23 = layout.buckets[layout.slots[0].bucket], layout.buckets[layout.slots[2].bucket]
    assert list(order.arrived(0, b01.index)) == []  # its bucket waits for parameter 1
    # Parameter 2 needs a buffer: the held bucket leaves with what it has, not final (the rest follows).
    assert list(order.make_room()) == [Launch(b01, frozenset({0}), final=False)]
    assert list(order.arrived(2, b23.index)) == []
    assert list(order.arrived(3, b23.index)) == [Launch(b23, frozenset({2, 3}), final=True)]
    assert list(order.arrived(1, b01.index)) == [Launch(b01, frozenset({1}), final=False)]  # the evicted rest
    assert list(order.flush()) == []  # nothing is held any more


@pytest.mark.parametrize("in_place", [False, True])
def test_a_backward_pass_is_finished_once_and_the_step_does_not_finish_it_again(in_place):
    net = make_net()
    engine = OffloadEngine(two_groups(net), CPU, torch.float32, options(in_place_on_cpu=in_place))
    loss_fn(net, batches(1)[0]).backward()  # no begin_backward: the first gradient opens the pass
    assert engine.grads.finish_backward() and not engine.grads.finish_backward()
    engine.begin_backward()  # opens one even before any gradient
    assert engine.grads.finish_backward() and not engine.grads.finish_backward()
    assert not engine.step().skipped
