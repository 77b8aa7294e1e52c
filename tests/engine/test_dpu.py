"""Delayed Parameter Update: the engine against a hand-written one-step-delayed reference loop."""

import copy

import pytest
import torch
from engine_helpers import CPU, batches, loss_fn, make_net, options

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
