"""The in-place engine (a CPU device, fp32, one process, sync): bitwise the offload data path, without its copies."""

import warnings

import pytest
import torch
from engine_helpers import CPU, batches, loss_fn, make_net, options, two_groups
from torch import nn

from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.options import OffloadOptions, resolve
from lightning_zero_offload.engine.step.in_place import InPlaceGradients

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def in_place(**kwargs):
    return options(in_place_on_cpu=True, **kwargs)


def train(engine_options, steps=12, micro=1, clip_norm=None, clip_value=None, skip_last_layer_on_odd=False, net=None):
    """Train make_net() with two param groups and a decaying lr; returns (engine, net, losses)."""
    net = net or make_net()
    engine = OffloadEngine(two_groups(net), CPU, torch.float32, engine_options)
    losses = []
    data = batches(steps * micro)
    for step in range(steps):
        for group in engine.optimizer.param_groups:
            group["lr"] *= 0.95  # a scheduler: read live by both paths
        for batch in data[step * micro : (step + 1) * micro]:
            x, y = batch
            h = net[:4](x)
            out = h[:, :4] if skip_last_layer_on_odd and step % 2 else net[4](h)
            loss = nn.functional.cross_entropy(out, y) / micro
            loss.backward()
            engine.finish_backward()
            losses.append(loss.item())
        engine.step(clip_norm=clip_norm, clip_value=clip_value)
    return engine, net, losses


def assert_same_state(a: OffloadEngine, b: OffloadEngine) -> None:
    for x, y in zip(a.master_params(), b.master_params()):
        assert torch.equal(x, y)
    state_a, state_b = a.optimizer_state_dict()["state"], b.optimizer_state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state_a[key][name], state_b[key][name]), (key, name)


def test_chosen_exactly_where_nothing_is_offloaded():
    auto = OffloadOptions()
    assert resolve(auto, CPU, torch.float32, 1).in_place
    assert not resolve(auto, CPU, torch.bfloat16, 1).in_place  # a low-precision copy to keep
    assert not resolve(auto, CPU, torch.float32, 2).in_place  # shards
    speculative = OffloadOptions(cpu_step="speculative")
    assert not resolve(speculative, CPU, torch.float32, 1).in_place  # device weights apart from the master
    assert not resolve(auto, torch.device("cuda"), torch.float32, 1).in_place
    assert not resolve(OffloadOptions(in_place_on_cpu=False), CPU, torch.float32, 1).in_place
    with pytest.raises(ValueError, match=r"precision='32-true'.*bfloat16.*cpu_step is 'delayed'.*unset"):
        resolve(OffloadOptions(in_place_on_cpu=True, cpu_step="delayed"), CPU, torch.bfloat16, 1)
    with pytest.raises(TypeError, match="in_place_on_cpu"):
        OffloadOptions(in_place_on_cpu="yes")
    # The engine's own resolution: a CPU device's defaults (sync) in fp32 run in place.
    engine = OffloadEngine(torch.optim.AdamW(make_net().parameters()), CPU, torch.float32, OffloadOptions())
    assert engine.in_place and isinstance(engine.grads, InPlaceGradients) and engine.cpu_step == "sync"


@pytest.mark.parametrize(
    "case",
    [
        {},
        {"clip_norm": 0.05},  # triggers on every step here
        {"clip_value": 0.01},
        {"micro": 3, "skip_last_layer_on_odd": True},  # accumulation, and a layer without gradient
    ],
    ids=["plain", "clip_norm", "clip_value", "accumulate_and_unused"],
)
def test_bitwise_the_offload_data_path(case):
    reference, ref_net, ref_losses = train(options(in_place_on_cpu=False), **case)
    engine, net, losses = train(in_place(), **case)
    assert not reference.in_place and engine.in_place
    assert losses == ref_losses
    assert_same_state(engine, reference)
    for p, q in zip(net.parameters(), ref_net.parameters()):
        assert torch.equal(p.detach(), q.detach())
    if case.get("clip_norm"):
        assert engine.last.grad_norm == pytest.approx(reference.last.grad_norm, rel=1e-12)


def test_parameters_are_the_master_and_nothing_is_copied():
    net = make_net()
    engine = OffloadEngine(torch.optim.AdamW(net.parameters(), lr=1e-2), CPU, torch.float32, in_place())
    storage = engine.master.host.untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == storage for p in net.parameters())
    assert engine.grad is None and engine.publisher.flat_params is engine.master.host
    report = engine.memory_report()
    n = sum(p.numel() for p in net.parameters())
    # master + two moments; no gradient buffer, staging or device copy (gradients live where autograd puts them)
    assert report["host_state_bytes"] == 12 * n and report["host_staging_bytes"] == 0
    assert report["device_total_bytes"] == 0
    loss_fn(net, batches(1)[0]).backward()
    assert all(p.grad is None for p in net.parameters())  # taken for the step, as the offload path takes them
    held = engine.grads.grads
    before = [p.detach().clone() for p in net.parameters()]
    engine.step()
    assert all(g is None for g in engine.grads.grads) and all(h is not None for h in held)
    assert all(not torch.equal(p.detach(), b) for p, b in zip(net.parameters(), before))  # updated in place
    assert engine.last.copy_back_s == 0.0 and engine.last.transfer_s == 0.0


def test_nonfinite_gradient_skips_the_step_and_leaves_everything_unchanged():
    net = make_net()
    engine = OffloadEngine(torch.optim.AdamW(net.parameters(), lr=1e-2), CPU, torch.float32, in_place())
    x, y = batches(1)[0]
    loss_fn(net, (x, y)).backward()
    engine.step()
    before = [t.clone() for t in engine.master_params()]
    state_before = engine.optimizer_state_dict()["state"]
    (net(x).sum() * float("nan")).backward()
    with pytest.warns(RuntimeWarning, match="Non-finite gradients"):
        stats = engine.step()
    assert stats.skipped and engine.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, engine.master_params()))
    state_after = engine.optimizer_state_dict()["state"]
    assert all(torch.equal(state_before[k]["exp_avg_sq"], state_after[k]["exp_avg_sq"]) for k in state_before)
    with warnings.catch_warnings():  # the bad gradients were dropped with the window: the next step is clean
        warnings.simplefilter("error")
        loss_fn(net, (x, y)).backward()
        assert not engine.step().skipped


def test_without_clipping_the_norm_is_summed_inside_the_step_and_a_bad_gradient_is_taken_back():
    net = make_net()
    engine = OffloadEngine(two_groups(net), CPU, torch.float32, in_place())
    data = batches(4)
    loss_fn(net, data[0]).backward()
    assert not engine.grads.sums_pending  # the first window sums as gradients arrive (clipping may follow)
    engine.step()
    assert not engine.grads.eager_sums  # no clipping: from now on the step's kernel sums them
    loss_fn(net, data[1]).backward()
    assert engine.grads.sums_pending
    norm = engine.step().grad_norm
    assert engine.grads.eager_sums is False and norm > 0
    before, state_before = engine.master_params(), engine.optimizer_state_dict()["state"]
    handle = net[4].bias.register_hook(lambda g: g * float("nan"))  # group 1 only: group 0 is updated first
    loss_fn(net, data[2]).backward()
    handle.remove()
    with pytest.warns(RuntimeWarning, match="Non-finite gradients"):
        stats = engine.step()
    assert stats.skipped and stats.grad_norm == float("inf") and engine.skipped_steps == 1
    state_after = engine.optimizer_state_dict()["state"]
    for a, b in zip(before, engine.master_params()):
        # group 0 was updated, then taken back: adam_undo's bound, 1e-5 of the step's change (lr 2e-2)
        torch.testing.assert_close(b, a, rtol=0, atol=2e-7)
    for key, entry in state_before.items():
        assert state_after[key]["step"] == entry["step"]
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state_after[key][name], entry[name], rtol=1e-5, atol=1e-10)
    # and the grad norm it reports is the one a separate pass computes
    loss_fn(net, data[3]).backward()
    summary = engine.grads.local_summary()
    assert not engine.grads.sums_pending
    assert engine.step().grad_norm == pytest.approx(summary[0] ** 0.5, rel=1e-12)


def resume(saved: OffloadEngine, in_place_on_cpu: bool):
    """A new engine on other weights, loaded from ``saved``, trained 4 more steps; returns (engine, losses)."""
    net = make_net(seed=5)
    engine = OffloadEngine(two_groups(net), CPU, torch.float32, options(in_place_on_cpu=in_place_on_cpu))
    engine.load_master_params(saved.master_params())
    engine.load_optimizer_state_dict(saved.optimizer_state_dict())
    engine.load_state_dict(saved.state_dict())
    losses = []
    for batch in batches(8)[4:]:
        loss = loss_fn(net, batch)
        loss.backward()
        losses.append(loss.item())
        engine.step()
    return engine, losses


@pytest.mark.parametrize("saved_in_place", [True, False])
def test_state_moves_between_the_two_paths_and_training_continues_bitwise(saved_in_place):
    saved, _, _ = train(options(in_place_on_cpu=saved_in_place), steps=4)
    moved, moved_losses = resume(saved, in_place_on_cpu=not saved_in_place)
    stayed, stayed_losses = resume(train(options(in_place_on_cpu=False), steps=4)[0], in_place_on_cpu=False)
    assert moved_losses == stayed_losses
    assert_same_state(moved, stayed)


def test_close_hands_back_standalone_parameters():
    net = make_net()
    engine, net, _ = train(in_place(), steps=3, net=net)
    trained = [t.clone() for t in engine.master_params()]
    engine.close()
    engine.master.host.zero_()  # the parameters no longer share it
    assert all(torch.equal(p.detach(), t) for p, t in zip(net.parameters(), trained))
    assert all(p.grad is None for p in net.parameters())


def test_a_gradient_twice_in_one_backward_is_refused():
    net = make_net()
    engine = OffloadEngine(torch.optim.AdamW(net.parameters()), CPU, torch.float32, in_place())
    engine.begin_backward()
    net[0].weight.sum().backward()
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        net[0].weight.sum().backward()
