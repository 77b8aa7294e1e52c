"""Delayed Parameter Update: the engine against a hand-written one-step-delayed reference loop."""

import copy

import pytest
import torch
from engine_helpers import CPU, DelayedReference, batches, loss_fn, make_net, options

from lightning_zero_offload import CPUAdam
from lightning_zero_offload.engine import OffloadEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only add barriers


def test_dpu_trajectory_equals_the_delayed_reference_including_warmup():
    warmup, steps = 4, 14
    master_ref = make_net()
    device_ref = copy.deepcopy(master_ref)
    ref_opt = torch.optim.AdamW(master_ref.parameters(), lr=1e-2, weight_decay=0.01)
    net = make_net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    engine = OffloadEngine(opt, CPU, torch.float32, options(cpu_step="delayed", dpu_warmup_steps=warmup))

    pending = None
    for t, batch in enumerate(batches(steps), start=1):
        # reference: grads of step t are computed on `device_ref`
        loss_fn(device_ref, batch).backward()
        for p_master, p_dev in zip(master_ref.parameters(), device_ref.parameters()):
            p_master.grad, p_dev.grad = p_dev.grad, None
        if t <= warmup:  # synchronous: the update is used by the very next step
            ref_opt.step()
            device_ref.load_state_dict(master_ref.state_dict())
        else:  # delayed: swap in update t-1 now, update t becomes visible at step t+2
            if pending is not None:
                device_ref.load_state_dict(pending)
            ref_opt.step()
            pending = copy.deepcopy(master_ref.state_dict())
        ref_opt.zero_grad()

        loss_fn(net, batch).backward()
        engine.step()
        assert engine.schedule.active == (t >= warmup)
        for p_dev, p in zip(device_ref.parameters(), net.parameters()):
            torch.testing.assert_close(p.detach(), p_dev.detach(), rtol=1e-6, atol=1e-7)
        for p_master, master in zip(master_ref.parameters(), engine.master_params()):
            torch.testing.assert_close(master, p_master.detach(), rtol=1e-6, atol=1e-7)
    # the delayed steps actually used stale parameters (the test would pass trivially otherwise)
    assert pending is not None
    assert any(not torch.equal(p.detach(), m) for p, m in zip(net.parameters(), engine.master_params()))
    engine.sync()
    assert all(torch.equal(p.detach(), m) for p, m in zip(net.parameters(), engine.master_params()))


def test_dpu_bf16_uses_a_second_gradient_buffer_and_publishes_rne_copies():
    net = make_net()
    engine = OffloadEngine(
        torch.optim.AdamW(net.parameters(), lr=1e-2),
        CPU,
        torch.bfloat16,
        options(cpu_step="delayed", dpu_warmup_steps=0),
    )
    assert len(engine.schedule.grad_buffers) == 2 and engine.grad is engine.schedule.grad_buffers[0]
    for batch in batches(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(net, batch).backward()
        engine.step()
    assert engine.grad is engine.schedule.grad_buffers[1]  # swapped after each delayed step
    engine.sync()
    for p, master in zip(net.parameters(), engine.master_params()):
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


def predicting_engine(net, warmup: int = 2, prediction: bool = True) -> OffloadEngine:
    return OffloadEngine(
        torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1),
        CPU,
        torch.bfloat16,
        options(cpu_step="delayed", dpu_warmup_steps=warmup, dpu_weight_prediction=prediction),
    )


def test_weight_prediction_publishes_the_last_update_applied_twice_and_evaluates_on_true_weights():
    warmup = 2
    net = make_net()
    engine = predicting_engine(net, warmup)
    masters = []  # W_t after each step t
    for t, batch in enumerate(batches(8), start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(net, batch).backward()
        engine.step()
        masters.append(engine.master_params())  # waits for the update; does not swap it in
        if t >= warmup + 2:  # step t swapped in update t-1, predicted from W_{t-2} one update ahead
            before, after = masters[t - 3], masters[t - 2]
            for p, w0, w1 in zip(net.parameters(), before, after):
                assert torch.equal(p.detach(), (w1 + (w1 - w0)).to(torch.bfloat16))
    # the device really holds a prediction, not the master (the test would pass trivially otherwise)
    assert any(not torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(net.parameters(), masters[-2]))
    engine.sync()  # evaluation: the true latest weights, not a prediction
    for p, master in zip(net.parameters(), engine.master_params()):
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


def test_weight_prediction_needs_dpu_and_a_low_precision_copy():
    with pytest.raises(ValueError, match="cpu_step='delayed'"):
        options(dpu_weight_prediction=True)
    with pytest.raises(ValueError, match="bf16-mixed"):
        OffloadEngine(
            torch.optim.AdamW(make_net().parameters()),
            CPU,
            torch.float32,
            options(cpu_step="delayed", dpu_weight_prediction=True),
        )


def test_a_skipped_step_takes_the_prediction_back():
    net = make_net()
    engine = predicting_engine(net)
    for t, batch in enumerate(batches(6), start=1):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(net, batch)
        if t == 5:  # inf gradients: step 5 is skipped, so the prediction of update 5 must not stay
            with pytest.warns(RuntimeWarning, match="skipped"):
                (loss * float("inf")).backward()
                engine.step()
            assert engine.schedule.state_dict() == {}
            for p, master in zip(net.parameters(), engine.master_params()):
                assert torch.equal(p.detach(), master.to(torch.bfloat16))
        else:
            loss.backward()
            engine.step()
    assert engine.skipped_steps == 1


def test_a_loaded_prediction_is_saved_again_by_a_run_without_prediction():
    net = make_net()
    source = predicting_engine(net)
    for batch in batches(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(net, batch).backward()
        source.step()
    state = source.state_dict()["schedule"]
    assert "next_params" in state["pending"]
    target = predicting_engine(make_net(), prediction=False)
    target.load_state_dict({"schedule": state})
    again = target.state_dict()["schedule"]["pending"]
    assert all(torch.equal(a, b) for a, b in zip(again["next_params"], state["pending"]["next_params"]))


CLAMP = 0.15


def clamp_data(net, t, saved):
    for p in net.parameters():
        p.data.clamp_(-CLAMP, CLAMP)


def clamp_through_parameter(net, t, saved):
    with torch.no_grad():
        for p in net.parameters():
            p.clamp_(-CLAMP, CLAMP)


def reassign_data(net, t, saved):
    if t == 5:
        net[0].weight.data = torch.full_like(net[0].weight, 0.01)


def load_state_dict_mid_fit(net, t, saved):
    if t == 3:
        saved.update({k: v.clone() for k, v in net.state_dict().items()})
    if t == 7:
        net.load_state_dict(saved)


def params(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in net.parameters()]


WRITES = [clamp_data, clamp_through_parameter, reassign_data, load_state_dict_mid_fit]
PRECISIONS = [
    pytest.param(torch.float32, False, id="fp32"),
    pytest.param(torch.bfloat16, False, id="bf16"),
    pytest.param(torch.bfloat16, True, id="bf16-predicted"),
]


def run_with_writes(write, dtype, prediction, steps=10, warmup=2, forward_hook=True):
    """The engine and the reference side by side; returns the largest device and master differences."""
    net = make_net()
    ref_net = copy.deepcopy(net)  # the reference makes it the device copy
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    engine = OffloadEngine(
        opt, CPU, dtype, options(cpu_step="delayed", dpu_warmup_steps=warmup, dpu_weight_prediction=prediction)
    )
    masters = [p.detach().clone() for p in ref_net.parameters()]
    ref_opt = CPUAdam(masters, lr=1e-2, weight_decay=0.01)  # the engine's kernel: bitwise comparable
    ref = DelayedReference(list(ref_net.to(dtype).parameters()), ref_opt, warmup, prediction)
    saved, ref_saved = {}, {}
    device_diff = 0.0
    for t, batch in enumerate(batches(steps), start=1):
        if forward_hook:
            engine.before_training_forward()
            ref.before_forward()
        for model in (net, ref_net):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
                loss_fn(model, batch).backward()
        engine.step()
        ref.step()
        write(net, t, saved)
        write(ref_net, t, ref_saved)
        diffs = [float((a - b).abs().max()) for a, b in zip(params(net), params(ref_net))]
        device_diff = max(device_diff, *diffs)
    last_written = [p.detach().clone() for p in net.parameters()]  # the device values after the last write
    engine.close()  # the module gets the master weights
    masters = ref.finish()
    master_diff = max(float((p.detach() - m).abs().max()) for p, m in zip(net.parameters(), masters))
    return device_diff, master_diff, net, last_written, ref


@pytest.mark.parametrize(("dtype", "prediction"), PRECISIONS)
@pytest.mark.parametrize("write", WRITES)
def test_writes_between_delayed_steps_match_the_delayed_reference(write, dtype, prediction):
    device_diff, master_diff, _, _, _ = run_with_writes(write, dtype, prediction)
    # The reference steps with the engine's kernel and rounds as the engine does: equal bitwise (observed),
    # at every step on the device and at the end in the master. A lost write differs by its size (>= 1e-2).
    assert device_diff == 0 and master_diff == 0


@pytest.mark.parametrize(("dtype", "prediction"), PRECISIONS)
def test_the_last_write_before_teardown_is_what_the_module_keeps(dtype, prediction):
    """At the end of fit the pending update of the last step lands first and the written elements keep
    the value written: a module clamped at the last step comes back clamped where the clamp wrote."""

    def clamp_last(net, t, saved):
        if t == 10:
            clamp_data(net, t, saved)

    _, _, unclamped, before, _ = run_with_writes(lambda net, t, saved: None, dtype, prediction)
    _, _, net, after, _ = run_with_writes(clamp_last, dtype, prediction)
    written = 0
    for p, b, a in zip(net.parameters(), before, after):
        mask = a != b.to(a.dtype)  # the engines are identical until the write: these elements were written
        written += int(mask.sum())
        assert torch.equal(p.detach()[mask], a[mask].float())
    assert written > 0  # the clamp had work to do
    assert max(float(p.detach().abs().max()) for p in unclamped.parameters()) > 1.5 * CLAMP


def test_a_checkpoint_between_a_step_and_a_write_changes_nothing():
    """Reading the state between steps runs the pending update early and keeps what the device was given,
    so a write after it (weight averaging at the end of fit, after the epoch's checkpoint) is merged
    exactly as without the read, and training continues bitwise the same."""

    def run(read_state: bool):
        net = make_net()
        engine = predicting_engine(net)
        for t, batch in enumerate(batches(8), start=1):
            engine.before_training_forward()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss_fn(net, batch).backward()
            engine.step()
            clamp_data(net, t, {})
            if read_state and t in (4, 8):
                engine.master_params(), engine.optimizer_state_dict(), engine.state_dict()
            if t in (4, 8):
                with torch.no_grad():
                    net[0].weight.fill_(0.5)  # no element holds it: every one is written
        engine.close()
        return [p.detach() for p in net.parameters()]

    plain, read = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, read))
    assert torch.equal(read[0], torch.full_like(read[0], 0.5))  # the last write survived


def test_writes_are_merged_the_same_without_the_forward_hook():
    """An engine driven without before_training_forward runs the update at the step, with the same result."""
    hooked = run_with_writes(clamp_data, torch.bfloat16, True)[2]
    unhooked = run_with_writes(clamp_data, torch.bfloat16, True, forward_hook=False)[2]
    assert all(torch.equal(a, b) for a, b in zip(hooked.parameters(), unhooked.parameters()))


def test_a_write_during_backward_under_the_delayed_update_is_refused():
    net = make_net()
    engine = predicting_engine(net, warmup=0)
    for batch in batches(2):
        engine.before_training_forward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(net, batch).backward()
        engine.step()
    engine.before_training_forward()  # the update of the last step runs from here on
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_fn(net, batches(1)[0]).backward()
    net[0].weight.data.mul_(0.5)  # as on_before_optimizer_step could
    with pytest.raises(RuntimeError, match="between steps .*cpu_step='sync' or 'speculative'"):
        engine.step()


def test_a_write_under_delayed_then_a_checkpoint_resumes_bitwise():
    """A write between steps, a checkpoint right after it, a fresh engine resumed from it: the same run."""

    def step(engine, net, t, batch):
        engine.before_training_forward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(net, batch).backward()
        engine.step()
        clamp_data(net, t, {})

    data = batches(10)
    full_net = make_net()
    full = predicting_engine(full_net)
    for t, batch in enumerate(data, start=1):
        step(full, full_net, t, batch)
    first_net = make_net()
    first = predicting_engine(first_net)
    for t, batch in enumerate(data[:5], start=1):
        step(first, first_net, t, batch)
    saved = {"master": first.master_params(), "optimizer": first.optimizer_state_dict(), "engine": first.state_dict()}
    assert "pending" in saved["engine"]["schedule"]
    net = make_net(seed=3)
    engine = predicting_engine(net)
    engine.load_master_params(saved["master"])
    engine.load_optimizer_state_dict(saved["optimizer"])
    engine.load_state_dict(saved["engine"])
    for t, batch in enumerate(data[5:], start=6):
        step(engine, net, t, batch)
    full.close()
    engine.close()
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(full_net.parameters(), net.parameters()))


def delayed_engine(net, dtype, prediction, warmup=2) -> OffloadEngine:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    return OffloadEngine(
        opt, CPU, dtype, options(cpu_step="delayed", dpu_warmup_steps=warmup, dpu_weight_prediction=prediction)
    )


def evaluate(engine, net, dtype) -> bool:
    """What the strategy does at validation start inside fit, then an evaluation forward. The evaluation
    sees the latest master weights (the true ones, not a prediction); returns whether the device held
    other weights for training before it."""
    before = [p.detach().clone() for p in net.parameters()]
    engine.sync()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
        loss_fn(net, batches(1, seed=9)[0])
    latest = [m.to(dtype) for m in engine.master_params()]
    assert same(params(net), latest)
    return not same(before, latest)


def train_evaluating(dtype, prediction, evaluations=(), after_step=None, save_at=None, resume=None, steps=8):
    """Steps of two micro-batches (gradient accumulation) under the delayed update, with evaluations where
    ``evaluations`` says: ``(t, "window")`` between step t's two micro-batches (the update of step t-1
    runs behind the first one), ``(t, "after")`` between step t and the next.

    ``after_step(net, t)``: a callback writing the weights after step t (after its evaluation, if any).
    ``save_at``: ``(t, "before" | "during")``: the state a checkpoint saves after step t, before or during
    its evaluation. ``resume``: ``(engine, net, first_step)`` to continue. Returns the device weights after
    each step, the final (closed) weights, the saved state and whether each evaluation changed the device.
    """
    if resume is None:
        net = make_net()
        engine, first = delayed_engine(net, dtype, prediction), 1
    else:
        engine, net, first = resume
    data = batches(2 * steps)
    device_after_step, changed, saved = [], [], None

    def save():
        return {
            "master": engine.master_params(),
            "optimizer": engine.optimizer_state_dict(),
            "engine": engine.state_dict(),
        }

    for t in range(first, steps + 1):
        for micro in (0, 1):  # the strategy's calls around each micro-batch
            engine.before_training_forward()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
                loss = loss_fn(net, data[2 * (t - 1) + micro])
            engine.begin_backward()
            loss.backward()
            engine.finish_backward()
            if micro == 0 and (t, "window") in evaluations:
                changed.append(evaluate(engine, net, dtype))
        engine.step()
        engine.zero_grad()
        device_after_step.append([p.detach().clone() for p in net.parameters()])
        if save_at == (t, "before"):
            saved = save()
        if (t, "after") in evaluations:
            changed.append(evaluate(engine, net, dtype))
            if save_at == (t, "during"):
                saved = save()
        if after_step is not None:
            after_step(net, t)
    engine.close()
    return device_after_step, params(net), saved, changed


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# The warm-up is steps 1-2: from step 3 on, an evaluation shows the device other weights than training's.
EVALUATIONS = [(2, "after"), (4, "window"), (5, "after"), (6, "after"), (7, "window")]


@pytest.mark.parametrize(("dtype", "prediction"), PRECISIONS)
def test_evaluations_inside_training_change_nothing_in_training(dtype, prediction):
    """Evaluation (validation inside fit) sees the latest weights, and training goes on with the stale ones
    it had, at every step as without the evaluation: between steps and inside an accumulation window."""
    plain_steps, plain = train_evaluating(dtype, prediction)[:2]
    steps, weights, _, changed = train_evaluating(dtype, prediction, EVALUATIONS)
    for t, (a, b) in enumerate(zip(steps, plain_steps), start=1):
        assert same(a, b), f"the device weights after step {t} differ from those of the run without evaluations"
    assert same(weights, plain)
    assert changed == [False, True, True, True, True]  # the evaluations saw other weights than training


@pytest.mark.parametrize(("dtype", "prediction"), PRECISIONS)
@pytest.mark.parametrize("when", ["before", "during"])
def test_a_checkpoint_around_an_evaluation_resumes_as_the_uninterrupted_run(dtype, prediction, when):
    """A checkpoint written right before an evaluation (ModelCheckpoint(every_n_train_steps) at the last
    batch of an epoch, then the epoch-end validation) or during it (monitoring a validation metric): the
    resumed run, which does not evaluate again, trains as the uninterrupted run, which did."""
    _, uninterrupted, saved, _ = train_evaluating(dtype, prediction, [(5, "after")], save_at=(5, when))
    assert "pending" in saved["engine"]["schedule"]  # the update of step 5 is swapped in at step 6
    net = make_net(seed=3)
    engine = delayed_engine(net, dtype, prediction)
    engine.load_master_params(saved["master"])
    engine.load_optimizer_state_dict(saved["optimizer"])
    engine.load_state_dict(saved["engine"])
    resumed = train_evaluating(dtype, prediction, resume=(engine, net, 6))[1]
    assert same(resumed, uninterrupted)
    assert same(uninterrupted, train_evaluating(dtype, prediction)[1])  # and as a run that never evaluated


def swap_an_average_in_and_out(net, t):
    """Weight averaging around an evaluation: other weights in, the trained ones back."""
    trained = [p.detach().clone() for p in net.parameters()]
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(0.5)
        for p, w in zip(net.parameters(), trained):
            p.copy_(w)


def fill_first_weight(net, t):
    """Every element written: the values are far from any the device may hold (a write of the value an
    element already holds is no write; during an evaluation the device holds other weights than between steps)."""
    if t in (4, 6):
        with torch.no_grad():
            net[0].weight.fill_(0.75 if t == 4 else -0.75)  # the weights are within +-0.3, then near 0.75


@pytest.mark.parametrize(("dtype", "prediction"), PRECISIONS)
def test_a_write_after_an_evaluation_is_a_write_between_steps(dtype, prediction):
    """A write after the evaluation began (a callback at validation end or at the epoch's end) is merged as
    a write between steps: the master and the weights training continues with take the written value."""
    evaluations = [(4, "after"), (6, "after")]
    plain = train_evaluating(dtype, prediction)[1]
    assert same(train_evaluating(dtype, prediction, evaluations, swap_an_average_in_and_out)[1], plain)
    filled = train_evaluating(dtype, prediction, evaluations, fill_first_weight)[1]
    assert same(filled, train_evaluating(dtype, prediction, after_step=fill_first_weight)[1])
    assert not same(filled, plain)  # the write changed the run
