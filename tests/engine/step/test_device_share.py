"""``device_share`` in the ZeRO-2 mode: the last buckets keep master, moments and gradient on the device and step
there, and training is the same as without a share (bf16 state bitwise, fp32 state within fp32 rounding)."""

from functools import partial

import pytest
import torch
from engine_helpers import CLIP, batches, loss_fn, moments, train_clipped

from lightning_zero_offload.engine import OffloadEngine, OffloadOptions
from lightning_zero_offload.engine.step.device_share import ShareChoice, choose_bucket_share, exposed_after_backward
from lightning_zero_offload.engine.step.layout import build_layout
from lightning_zero_offload.engine.step.shard_buffer import ShardBuffer, first_device_bucket
from lightning_zero_offload.testing.ranks import run_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FP32_ROUNDING = 1e-6  # relative, per tensor; observed 0 at one rank (the device step is torch's fused Adam)


def train(share, cpu_state="fp32", dtype=torch.float32, **kw):
    return train_clipped(cpu_state, dtype, device_share=share, **kw)


def close(got: list[torch.Tensor], want: list[torch.Tensor], cpu_state: str) -> bool:
    if cpu_state == "bf16":
        return all(torch.equal(a, b) for a, b in zip(got, want))
    return all(float((a - b).norm() / b.norm().clamp_min(1e-30)) <= FP32_ROUNDING for a, b in zip(got, want))


def test_the_last_buckets_whole_and_within_the_share_are_on_the_device():
    layout = build_layout([torch.Size([300]), torch.Size([200]), torch.Size([100])], bucket_numel=250)
    # reverse registration: the first layer last, split into a full bucket and its remainder
    assert [b.numel for b in layout.buckets] == [100, 200, 250, 50]
    assert first_device_bucket(layout, 0.0) == 4
    assert first_device_bucket(layout, 0.08) == 4  # the last bucket alone is 1/12: whole buckets only
    assert first_device_bucket(layout, 0.09) == 3  # part of the split parameter
    assert first_device_bucket(layout, 0.5) == 2
    assert first_device_bucket(layout, 0.8) == 2
    assert first_device_bucket(layout, 0.84) == 1
    assert first_device_bucket(layout, 1.0) == 0


def test_a_window_lies_on_one_side():
    buffer = ShardBuffer(torch.zeros(4), torch.ones(3))
    assert torch.equal(buffer[slice(1, 3)], torch.zeros(2)) and torch.equal(buffer[slice(5, 7)], torch.ones(2))
    with pytest.raises(IndexError, match="straddles the device share"):
        buffer[slice(3, 5)]


@pytest.mark.parametrize(
    ("cpu_state", "dtype", "cpu_step"),
    [
        ("fp32", torch.float32, "sync"),
        ("fp32", torch.float32, "speculative"),
        ("fp32", torch.bfloat16, "speculative"),
        ("bf16", torch.bfloat16, "sync"),
        ("bf16", torch.bfloat16, "speculative"),
    ],
)
def test_a_share_trains_as_none_with_clipping_and_accumulation(cpu_state, dtype, cpu_step):
    _, want = train(0.0, cpu_state, dtype, cpu_step=cpu_step)
    _, got = train(0.5, cpu_state, dtype, cpu_step=cpu_step)
    assert 0 < got.state.first_device_bucket < len(got.layout.buckets)  # some buckets on each side
    assert close(got.master_params(), want.master_params(), cpu_state)
    assert close(moments(got), moments(want), cpu_state)
    assert got.state.steps == want.state.steps


def test_a_split_parameters_window_has_a_piece_on_each_side():
    buffer = ShardBuffer(torch.zeros(4), torch.ones(3))
    (place, host), (device_place, device) = buffer.pieces(slice(2, 6))
    assert (place, device_place) == (slice(0, 2), slice(2, 4))
    assert torch.equal(host, torch.zeros(2)) and torch.equal(device, torch.ones(2))
    assert [p for p, _ in buffer.pieces(slice(0, 4))] == [slice(0, 4)]
    assert [p for p, _ in buffer.pieces(slice(4, 7))] == [slice(0, 3)] and buffer.pieces(slice(4, 7))[0][1].sum() == 3


def test_the_whole_state_on_the_device_trains_as_none():
    _, want = train(0.0, cpu_step="speculative")
    _, got = train(1.0, cpu_step="speculative")
    assert got.state.first_device_bucket == 0 and got.memory_report()["host_state_bytes"] == 0
    assert close(got.master_params(), want.master_params(), "fp32")


def test_the_device_share_is_neither_speculated_nor_counted_on_the_host():
    _, none = train(0.0, cpu_step="speculative", clip=None)
    _, engine = train(0.5, cpu_step="speculative", clip=None)
    report, state = engine.memory_report(), engine.state
    on_device = state.device_share_numel
    assert 0 < on_device == report["device_share_params"] <= 0.5 * report["params"]
    assert report["device_state_bytes"] == 4 * 4 * on_device  # fp32 master, moments, gradient
    # master, moments and gradient on the device; nor is the rollback's snapshot of master and moments on the host
    assert report["host_state_bytes"] == none.memory_report()["host_state_bytes"] - 4 * (4 + 3) * on_device
    host_numel = sum(b.numel for b in engine.layout.buckets[: state.first_device_bucket])
    assert engine.last.speculated_fraction == pytest.approx(host_numel / report["params"])


def test_a_checkpoint_moves_between_shares():
    """Saved with a share, loaded without (and back): the run goes on as the one that never changed."""
    _, want = train(0.0, steps=6, accumulate=1)
    for saved, loaded in ((0.5, 0.0), (0.0, 1.0)):
        _, first = train(saved, steps=3, accumulate=1)
        net, second = train(loaded, steps=0, accumulate=1)
        second.load_master_params(first.master_params())
        second.load_optimizer_state_dict(first.optimizer_state_dict())
        assert close(second.master_params(), first.master_params(), "fp32")
        for x, y in batches(6)[3:]:
            second.begin_backward()
            loss_fn(net, (x, y)).backward()
            second.step(clip_norm=CLIP)
        assert close(second.master_params(), want.master_params(), "fp32")


def test_a_write_into_a_device_bucket_and_a_reset_step_count_land_as_without_a_share():
    results = []
    for share in (0.0, 1.0):
        net, engine = train(share, steps=2, accumulate=1)
        with torch.no_grad():
            net[4].weight.mul_(0.5)  # a callback's write between steps, into the last layer's bucket
        engine.set_param_step(0, 0)  # optimizer.state[p]["step"] = 0: fresh moments for the first weight
        for x, y in batches(2, seed=3):
            engine.begin_backward()
            loss_fn(net, (x, y)).backward()
            engine.step()
        results.append((engine.master_params(), moments(engine)))
    assert close(results[1][0], results[0][0], "fp32") and close(results[1][1], results[0][1], "fp32")


def test_what_a_share_cannot_run_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="use cpu_step='speculative'"):
        train(0.5, cpu_step="delayed", steps=0)
    with pytest.raises(ValueError, match="device_share=0"):
        train(0.5, in_place_on_cpu=True, overlap=None, steps=0)


def share_at_rank(rank: int, share: float | str, cpu_state: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    floor = None
    if share == "grown":  # from a short host's floor (0.2) to what "auto" chose after the second step (0.5)
        from lightning_zero_offload.engine.step import device_share

        device_share.room_after_peak = lambda device: 10**9  # as an accelerator might have
        device_share.choose_bucket_share = lambda *args, **kwargs: ShareChoice(0.5, 0, "auto: as an accelerator might")
        share, floor = "auto", ShareChoice(0.2, 0, "auto: a short host's floor")
    _, engine = train(share, cpu_state, cpu_step="speculative", rank=rank, world=2, share_floor=floor)
    assert engine.layout.world_size == 2 and (engine.state.device_share_numel > 0) == (share != 0.0)
    if floor is not None:
        assert engine.state.first_device_bucket == first_device_bucket(engine.layout, 0.5)
    return engine.master_params(), moments(engine)


@pytest.mark.slow  # two processes
@pytest.mark.parametrize("share", [0.5, "grown"])
@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
def test_a_share_trains_as_none_at_two_ranks(cpu_state, share, tmp_path):
    """A share from the start, or one grown in place after the second step (each rank moves its own buckets)."""
    (tmp_path / "none").mkdir(), (tmp_path / "shared").mkdir()
    want = run_ranks(partial(share_at_rank, share=0.0, cpu_state=cpu_state), 2, tmp_path / "none")
    got = run_ranks(partial(share_at_rank, share=share, cpu_state=cpu_state), 2, tmp_path / "shared")
    for (weights, state), (want_weights, want_state) in zip(got, want):
        assert close(weights, want_weights, cpu_state) and close(state, want_state, cpu_state)


def test_measured_landings_replace_the_even_model():
    """The largest bucket last in the layout but landing halfway through backward (say the layers registered in
    reverse): with the measured landings its step starts then, and most of it is hidden."""
    shards, rate = [10, 10, 10, 10, 40], 1 / 80
    assert exposed_after_backward(shards, 5, 1.0, rate) == pytest.approx(0.5)  # lands at the end
    leads = [0.875, 0.75, 0.625, 0.5, 0.5]
    assert exposed_after_backward(shards, 5, 1.0, rate, leads) == pytest.approx(0.125)
    late = [0.875, 0.75, 0.625, 0.5, 0.0]  # the measured lead of a tied embedding's bucket: none
    assert exposed_after_backward(shards, 5, 1.0, rate, late) == pytest.approx(0.5)


def test_the_transfer_before_each_step_counts_in_the_pipeline_not_in_the_bound():
    """The gradient worker copies and adds a bucket's gradient before its step: with that three times the step, the
    four small buckets no longer keep up with backward, and more of them go to the device."""
    shards, rate = [10, 10, 10, 10, 40], 1 / 80
    alone = choose_bucket_share(shards, shards, 1.0, rate, 16, device_room=10**6, speculative=True)
    slow = choose_bucket_share(shards, shards, 1.0, rate, 16, 10**6, True, None, transfer_s_per_element=3 * rate)
    assert alone.params == 40 and slow.params == 60


def test_the_steps_own_tail_counts_against_the_bound():
    """Eight buckets landing evenly, each stepped in the time to the next landing: the last one's step is all that is
    left after backward, exactly one bucket's. The step's own tail after it (validation, copy-back) then exceeds the
    bound unless that bucket goes to the device; a tail longer than a bucket's step asks for no CPU step after
    backward at all."""
    shards, rate = [10] * 8, 1 / 80
    assert exposed_after_backward(shards, 8, 1.0, rate) == pytest.approx(0.125)
    untimed = choose_bucket_share(shards, shards, 1.0, rate, 16, device_room=10**6, speculative=True)
    assert untimed.params == 0 and "(0)" in untimed.why and "included" not in untimed.why
    tailed = choose_bucket_share(shards, shards, 1.0, rate, 16, 10**6, True, tail_s=0.05)
    assert tailed.params == 10 and "(1)" in tailed.why and "the step's own 50.0 ms included" in tailed.why
    long = choose_bucket_share(shards, shards, 1.0, rate, 16, 10**6, True, tail_s=0.2)
    assert long.params == 10 and "no CPU step after backward (the step's own 200.0 ms exceed" in long.why


def test_a_step_reports_its_tail_apart_from_the_cpu_step_it_ran():
    """sync runs its whole CPU step in step(), after backward; the tail is the rest of the time from the last landing
    (before step() began) to step()'s end."""
    for schedule in ("sync", "speculative"):
        _, engine = train(0.0, cpu_step=schedule, steps=3)
        stats = engine.last
        assert 0 <= stats.cpu_step_after_backward_s <= stats.cpu_step_s
        assert stats.tail_s >= stats.total_s - stats.cpu_step_after_backward_s > 0
        if schedule == "sync":
            assert stats.cpu_step_after_backward_s == stats.cpu_step_s > 0 and stats.tail_s < stats.total_s


def test_the_streamer_measures_when_each_bucket_landed():
    """Backward of the MLP reaches its layers in the layout's order: each later bucket lands closer to its end."""
    _, engine = train(0.0, cpu_step="speculative", steps=1, accumulate=1)
    leads = engine.grads.landings.leads
    assert len(leads) == len(engine.layout.buckets) >= 4
    assert leads == sorted(leads, reverse=True) and leads[0] > leads[-1] >= 0


def test_auto_keeps_the_bucket_whose_step_no_backward_is_left_to_hide():
    """A tied embedding's bucket (the largest, its gradient last): with it on the host the step ends half a step
    after backward; with it on the device the rest ends within backward."""
    shards = [10, 10, 10, 10, 40]
    rate = 1 / 80  # the whole step takes as long as backward
    assert exposed_after_backward(shards, 5, 1.0, rate) == pytest.approx(0.5)
    assert exposed_after_backward(shards, 4, 1.0, rate) == 0.0
    choice = choose_bucket_share(shards, shards, 1.0, rate, 16, device_room=10**6, speculative=True)
    assert choice.params == 40 and 0.5 <= choice.share < 0.51 and "fewest last buckets (1)" in choice.why
    # the fraction chosen keeps the same bucket when the engine lays it out
    layout = build_layout([torch.Size([n]) for n in reversed(shards)], bucket_numel=10)
    assert first_device_bucket(layout, choice.share) == 4


def test_auto_starts_its_share_at_a_parameters_edge():
    """Bucket 3 continues a parameter split from bucket 2: the rule's two last buckets would put that parameter's
    state on both sides (its optimizer.state then refuses to be read, at whatever step "auto" decides), so "auto"
    takes three; where the room holds fewer, one."""
    shards, rate, starts = [10] * 5, 1 / 30, {0, 1, 2, 4}
    assert choose_bucket_share(shards, shards, 1.0, rate, 16, device_room=10**6, speculative=True).params == 20
    whole = choose_bucket_share(shards, shards, 1.0, rate, 16, device_room=10**6, speculative=True, starts=starts)
    assert whole.params == 30 and "fewest last buckets (3)" in whole.why
    short = choose_bucket_share(shards, shards, 1.0, rate, 16, device_room=16 * 25, speculative=True, starts=starts)
    assert short.params == 10 and "(1 buckets)" in short.why


def test_auto_stays_within_the_room_and_takes_the_most_it_can_where_the_target_is_out_of_reach():
    shards = [10, 10, 10, 10, 40]
    none = choose_bucket_share(shards, shards, 1.0, 1 / 80, 16, device_room=16 * 40 - 1, speculative=True)
    assert none.share == 0.0 and "(0 buckets)" in none.why
    sync = choose_bucket_share(shards, shards, 1.0, 1 / 80, 16, device_room=16 * 60, speculative=False)
    assert sync.params == 60 and "cpu_step='sync' steps every host bucket after backward" in sync.why


def test_auto_keeps_at_least_the_buckets_the_host_needs():
    """The pre-flight's floor (buckets on the device since setup) stays whatever the rule and the room say; the rule
    adds to it."""
    shards = [10, 10, 10, 10, 40]
    rate = 1 / 80
    kept = choose_bucket_share(shards, shards, 1.0, rate, 16, device_room=0, speculative=True, floor=2)
    assert kept.params == 50 and "fewest last buckets (2)" in kept.why
    assert "2 of them on the device since setup" in kept.why
    assert choose_bucket_share(shards, shards, 1.0, rate, 16, device_room=10**6, speculative=True, floor=1).params == 40
    more = choose_bucket_share(shards, shards, 1.0, 1 / 20, 16, device_room=10**6, speculative=True, floor=1)
    assert more.params == 60  # the step twice backward's: the rule adds two buckets to the floor's one
    sync = choose_bucket_share(shards, shards, 1.0, rate, 16, device_room=16 * 50, speculative=False, floor=3)
    assert sync.params == 60 and "(3 buckets)" in sync.why


def test_auto_starts_with_the_share_the_host_needs_and_keeps_it(monkeypatch):
    """Where the host holds the rest only with a share, the pre-flight gives the engine a floor: it starts with those
    buckets on the device, "auto" keeps them where the device has no room for more (no re-plan) and adds to them
    where the rule asks for more; training is as without a share."""
    from lightning_zero_offload.engine.step import device_share

    floor = ShareChoice(0.3, 0, "auto: the host's floor")
    _, want = train(0.0, cpu_step="speculative")
    _, early = train("auto", cpu_step="speculative", share_floor=floor, steps=2)
    assert early.share_choice is None and early.resolved.device_share == 0.3
    floor_buckets = len(early.layout.buckets) - early.state.first_device_bucket
    assert floor_buckets == len(early.layout.buckets) - first_device_bucket(early.layout, 0.3) > 0

    monkeypatch.setattr(device_share, "room_after_peak", lambda device: 0)
    monkeypatch.setattr(type(early), "take_device_share", lambda engine, share: pytest.fail("re-planned"))
    _, kept = train("auto", cpu_step="speculative", share_floor=floor)
    assert kept.share_choice is not None and "on the device since setup" in kept.share_choice.why
    assert kept.state.first_device_bucket == early.state.first_device_bucket
    assert close(kept.master_params(), want.master_params(), "fp32") and close(moments(kept), moments(want), "fp32")

    monkeypatch.undo()
    given = []
    choose = device_share.choose_bucket_share

    def more(*args, starts):
        given.append(args[-1])
        return choose(*args[:-1], floor=len(args[0]) - 1, starts=starts)  # every bucket but the first

    monkeypatch.setattr(device_share, "room_after_peak", lambda device: 10**9)
    monkeypatch.setattr(device_share, "choose_bucket_share", more)
    _, grown = train("auto", cpu_step="speculative", share_floor=floor)
    assert given == [floor_buckets] and grown.state.first_device_bucket <= 1  # all but the first, or every one
    assert close(grown.master_params(), want.master_params(), "fp32") and close(moments(grown), moments(want), "fp32")


@pytest.mark.parametrize(
    ("cpu_state", "dtype"), [("fp32", torch.float32), ("fp32", torch.bfloat16), ("bf16", torch.bfloat16)]
)
def test_a_larger_share_moves_its_buckets_to_the_device_in_place(monkeypatch, cpu_state, dtype):
    """The buckets a larger share adds move to the device within the state, one buffer at a time: no parameter's
    state is gathered whole (a host short of memory could not hold that copy), the weights' device copy is the one
    setup made (a second would take device memory), the ledger then counts what an engine built with that share
    holds, and training goes on as without a share (bf16 state bitwise)."""
    from lightning_zero_offload.engine import engine as engine_module
    from lightning_zero_offload.engine import state_dicts
    from lightning_zero_offload.engine.step import device_share

    _, want = train(0.0, cpu_state, dtype, cpu_step="speculative")
    _, built = train(0.5, cpu_state, dtype, cpu_step="speculative", steps=1)
    half = ShareChoice(0.5, built.state.device_share_numel, "auto: half, as an accelerator might")
    monkeypatch.setattr(device_share, "room_after_peak", lambda device: 10**9)
    monkeypatch.setattr(device_share, "choose_bucket_share", lambda *args, **kwargs: half)
    gathered, publishers = [], []
    monkeypatch.setattr(state_dicts, "full_tensors", lambda *args: gathered.append(args))
    publisher = engine_module.Publisher
    monkeypatch.setattr(engine_module, "Publisher", lambda *args: publishers.append(publisher(*args)) or publishers[-1])
    net, grown = train("auto", cpu_state, dtype, cpu_step="speculative")
    assert gathered == [] and grown.share_choice is half and publishers == [grown.publisher]
    flat = grown.publisher.flat_params.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == flat for p in net.parameters())
    assert grown.state.first_device_bucket == built.state.first_device_bucket < len(grown.layout.buckets)
    assert grown.memory_report() == built.memory_report()
    monkeypatch.undo()
    assert close(grown.master_params(), want.master_params(), cpu_state)
    assert close(moments(grown), moments(want), cpu_state) and grown.state.steps == want.state.steps


def test_the_room_is_what_the_peak_left_less_the_reserve_and_the_bf16_steps_scratch(monkeypatch):
    """The room "auto" gives the share: 80% of the device memory the peak left (20% kept for activations), less the
    bf16 step's scratch; not less the weights' device copy, which a larger share keeps as it is."""
    from lightning_zero_offload.engine.step import device_share
    from lightning_zero_offload.kernels.device import BF16_STATE_CHUNK, BF16_STATE_SCRATCH_BYTES

    _, engine = train(0.0, cpu_step="speculative", steps=2)
    rooms = []
    monkeypatch.setattr(device_share, "room_after_peak", lambda device: 10**6)
    monkeypatch.setattr(device_share, "choose_bucket_share", lambda *args, **kwargs: rooms.append(args[5]))
    device_share.auto_bucket_share(engine.layout, engine.state, engine.last, True, engine.device, None, False)
    scratch = BF16_STATE_SCRATCH_BYTES * min(BF16_STATE_CHUNK, max(b.shard_numel for b in engine.layout.buckets))
    assert rooms == [int(0.8 * 10**6) - scratch]


def test_the_gradients_read_at_one_rank_hold_the_shares_values():
    """User code reading p.grad (engine.gradients(): views of the host part) gets the device share's gradients as
    real tensors, not the placeholders a streamed save takes."""
    read = {}
    for share in (0.0, 0.5):
        net, engine = train(share, steps=0)
        x, y = batches(1)[0]
        engine.begin_backward()
        loss_fn(net, (x, y)).backward()
        read[share] = engine.gradients()
        assert engine.state.device_share_numel > 0 or share == 0.0
    assert not any(g.is_meta for g in read[0.5]) and all(map(torch.equal, read[0.5], read[0.0]))


def test_a_floor_is_for_auto_in_the_zero2_mode_only():
    with pytest.raises(ValueError, match="share_floor"):
        train(0.0, share_floor=ShareChoice(0.3, 0, "auto: floor"))


def test_auto_on_a_cpu_device_keeps_nothing_and_says_why():
    _, engine = train("auto", steps=2)
    assert engine.share_choice is None  # the second step is the one measured: chosen before the third
    _, engine = train("auto", steps=3)
    assert engine.share_choice is not None and engine.share_choice.share == 0.0
    assert "a CPU device is host memory" in engine.share_choice.why
    assert engine.state.device_share_numel == 0


def test_auto_re_plans_after_the_second_step_and_trains_as_none(monkeypatch):
    """What an accelerator's "auto" does, its device memory pretended: after the second step the engine chooses from
    what that step measured (each bucket's landing too), re-plans with the share, and the run goes on as without
    one."""
    from lightning_zero_offload.engine.step import device_share

    chosen = []
    choose = device_share.choose_bucket_share

    def watched(shards, numels, backward_s, rate, nbytes, room, speculative, leads, transfer_rate, tail_s, floor, **kw):
        assert backward_s > 0 and rate > 0 and transfer_rate > 0 and tail_s > 0 and speculative and floor == 0
        assert 0 < room < 0.8 * 10**9
        assert len(leads) == len(shards) and all(0 <= lead <= backward_s for lead in leads)
        args = (shards, numels, backward_s, rate, nbytes, room, speculative, leads, transfer_rate, tail_s)
        measured = choose(*args, **kw)
        assert 0 <= measured.share <= 1  # on these CPUs it may be none: the re-plan is tested with half
        chosen.append(ShareChoice(0.5, 0, "auto: as an accelerator might"))
        return chosen[-1]

    monkeypatch.setattr(device_share, "room_after_peak", lambda device: 10**9)
    monkeypatch.setattr(device_share, "choose_bucket_share", watched)
    _, want = train(0.0, cpu_step="speculative")
    _, got = train("auto", cpu_step="speculative")
    assert len(chosen) == 1 and got.share_choice is chosen[0]
    assert 0 < got.state.device_share_numel <= 0.5 * sum(b.numel for b in got.layout.buckets)
    assert close(got.master_params(), want.master_params(), "fp32") and close(moments(got), moments(want), "fp32")


@pytest.mark.slow  # two processes
def test_a_streamed_full_save_at_two_ranks_holds_what_a_run_without_a_share_saves(tmp_path):
    from workers.checkpoints import BUCKET_MB, streamed_saves

    files = tmp_path / "files"
    files.mkdir()
    settings = {str(share): (share, BUCKET_MB) for share in (0.0, 0.5)}
    run_ranks(partial(streamed_saves, str(files), settings), 2, tmp_path)
    want, got = (torch.load(files / f"{share}.ckpt", weights_only=True) for share in (0.0, 0.5))
    assert want["state_dict"].keys() == got["state_dict"].keys()
    assert close(list(got["state_dict"].values()), list(want["state_dict"].values()), "fp32")
    want_state, got_state = (c["optimizer_states"][0]["state"] for c in (want, got))
    assert want_state.keys() == got_state.keys()
    for key, entry in want_state.items():
        pairs = [(got_state[key][m], entry[m]) for m in ("exp_avg", "exp_avg_sq")]
        assert close([g for g, _ in pairs], [w for _, w in pairs], "fp32")


class UnusedAtFirst(torch.nn.Module):
    """A head used by some micro-batches only: its buckets get no gradient from the others."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.extra = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), torch.nn.Linear(4, 64)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + (self.extra(h).sum(-1, keepdim=True) if use_extra else 0)


def test_a_share_grown_mid_window_keeps_the_window_and_nothing_older():
    """The gradient buffer moves whole; the buckets no gradient of this window reached yet hold an older window's
    values, and stay fresh (the next gradient overwrites them) instead of being added to."""

    def fit(grow: bool) -> list[torch.Tensor]:
        model = UnusedAtFirst()
        options = OffloadOptions(in_place_on_cpu=False, bucket_size_mb=0.0001)
        engine = OffloadEngine(
            torch.optim.AdamW(model.parameters(), lr=1e-2), torch.device("cpu"), torch.float32, options
        )
        generator = torch.Generator().manual_seed(1)
        for step in range(3):
            for part in range(2):
                if grow and (step, part) == (1, 1):
                    engine.take_device_share(0.5)
                engine.begin_backward()
                x = torch.randn(3, 4, generator=generator)
                (model(x, use_extra=(step, part) != (1, 0)).pow(2).mean() / 2).backward()
                engine.finish_backward()
            engine.step()
            engine.zero_grad()
        return engine.master_params()

    assert close(fit(grow=True), fit(grow=False), "fp32")


def test_auto_reads_the_device_peak_of_the_measured_step_alone(monkeypatch):
    """Not the setup's, nor an earlier fit's in this process (a batch-size search's): the peak statistics restart at
    each forward of the second step's window, and not after it (the choice reads them before the third)."""
    from lightning_zero_offload.engine.step import device_share

    resets = []
    monkeypatch.setattr(device_share, "reset_peak_memory", resets.append)
    counts = []
    for steps in (1, 2, 3):
        resets.clear()
        _, engine = train("auto", steps=steps)
        counts.append(len(resets))
    assert counts == [0, 2, 2] and engine.share_choice is not None  # two micro-batches a step
    assert resets == [engine.device, engine.device]
