"""engine.optimizer_hooks: torch's optimizer step hooks fire around the engine's update as
``Optimizer.step`` fires them (order, arguments, once per step taken, none on a skipped step)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from engine_helpers import CPU, batches, loss_fn, make_net, options, two_groups
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.optimizer_hooks import has_step_hooks, step_hooks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (name, engine options, param dtype): every data path and schedule the engine can take on a CPU device
PATHS = [
    ("offload-sync", {"cpu_step": "sync"}, torch.float32),
    ("offload-speculative", {"cpu_step": "speculative"}, torch.float32),
    ("offload-delayed", {"cpu_step": "delayed", "dpu_warmup_steps": 2}, torch.float32),
    ("offload-bf16", {}, torch.bfloat16),
    ("in-place", {"in_place_on_cpu": True}, torch.float32),
]


class Recorder:
    """Registers one hook of each kind (global pre/post, the optimizer's pre/post) and records the calls."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls: list[tuple[str, torch.optim.Optimizer, tuple, dict]] = []
        self.handles = [
            register_optimizer_step_pre_hook(self._hook("global pre")),
            optimizer.register_step_pre_hook(self._hook("pre")),
            optimizer.register_step_post_hook(self._hook("post")),
            register_optimizer_step_post_hook(self._hook("global post")),
        ]

    def _hook(self, name: str):
        def hook(optimizer, args, kwargs):
            self.calls.append((name, optimizer, args, dict(kwargs)))

        return hook

    def names(self) -> list[str]:
        return [name for name, *_ in self.calls]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.fixture
def recorder_for() -> Iterator:
    made: list[Recorder] = []

    def make(optimizer: torch.optim.Optimizer) -> Recorder:
        made.append(Recorder(optimizer))
        return made[-1]

    yield make
    for recorder in made:  # global hooks outlive the test otherwise
        recorder.remove()


ORDER = ["global pre", "pre", "post", "global post"]


def test_step_hooks_fire_in_torchs_order_with_torchs_arguments(recorder_for):
    """The helper against torch itself: the same calls, in the same order, with the same arguments as
    ``optimizer.step()`` without a closure."""
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([p])
    recorder = recorder_for(optimizer)
    p.grad = torch.ones(2)
    optimizer.step()
    by_torch, recorder.calls = recorder.calls, []
    with step_hooks(optimizer):
        recorder.calls.append(("update", optimizer, (), {}))
    assert recorder.names() == ["global pre", "pre", "update", "post", "global post"]
    assert [c for c in recorder.calls if c[0] != "update"] == by_torch
    assert by_torch[0][1:] == (optimizer, (optimizer,), {})


def test_has_step_hooks_sees_global_and_own_hooks():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    assert not has_step_hooks(optimizer)
    handle = optimizer.register_step_post_hook(lambda *args: None)
    assert has_step_hooks(optimizer)
    handle.remove()
    handle = register_optimizer_step_pre_hook(lambda *args: None)
    try:
        assert has_step_hooks(optimizer)
    finally:
        handle.remove()


def drive(engine: OffloadEngine, net, batch, speculative: bool) -> None:
    """One step as the strategy drives it (the speculative schedule needs the step announced)."""
    if speculative:
        engine.expect_step(publish_early=True)
    engine.begin_backward()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=engine.param_dtype == torch.bfloat16):
        loss = loss_fn(net, batch)
    loss.backward()
    engine.finish_backward()
    engine.step()


@pytest.mark.parametrize("path", PATHS, ids=[name for name, *_ in PATHS])
def test_the_engine_fires_every_hook_once_per_step_around_the_update(path, recorder_for):
    name, engine_options, dtype = path
    net = make_net()
    engine = OffloadEngine(two_groups(net), CPU, dtype, options(**engine_options))
    recorder = recorder_for(engine.optimizer)
    seen: list[tuple[str, torch.Tensor]] = []  # the master weights each hook saw
    engine.optimizer.register_step_pre_hook(lambda *args: seen.append(("pre", engine.master.host.clone())))
    engine.optimizer.register_step_post_hook(lambda *args: seen.append(("post", engine.master.host.clone())))
    for batch in batches(4):
        drive(engine, net, batch, speculative=name == "offload-speculative")
    engine.sync()
    assert recorder.names() == ORDER * 4
    assert all(call[1:] == (engine.optimizer, (engine.optimizer,), {}) for call in recorder.calls)
    if name in ("offload-sync", "offload-bf16", "in-place"):  # the update runs between the two hooks
        pre, post = seen[-2][1], seen[-1][1]
        assert seen[-2][0] == "pre" and not torch.equal(pre, post)
        assert not torch.equal(seen[0][1], seen[2][1])  # and the second pre-hook sees the first update
    engine.close()


@pytest.mark.parametrize("in_place", [False, True], ids=["offload", "in-place"])
def test_a_step_skipped_for_non_finite_gradients_fires_no_hook(in_place, recorder_for):
    """As GradScaler skips optimizer.step() on inf/nan: in place too, where without hooks the skip is
    only known once the update ran (it is then taken back), so with hooks the norm is summed first."""
    net = make_net()
    engine = OffloadEngine(torch.optim.AdamW(net.parameters()), CPU, torch.float32, options(in_place_on_cpu=in_place))
    assert engine.in_place == in_place
    recorder = recorder_for(engine.optimizer)
    x, y = batches(1)[0]
    loss_fn(net, (x, y)).backward()
    engine.step()
    loss_fn(net, (x, y)).backward()
    engine.step()  # without clipping: in place, the checked step would sum the norm inside the update
    before = [t.clone() for t in engine.master_params()]
    (net(x).sum() * float("nan")).backward()
    with pytest.warns(RuntimeWarning, match="Non-finite gradients"):
        assert engine.step().skipped
    assert recorder.names() == ORDER * 2
    assert all(torch.equal(a, b) for a, b in zip(before, engine.master_params()))  # bitwise: never started
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_fn(net, (x, y)).backward()
        engine.step()
    assert recorder.names() == ORDER * 3
    engine.close()


SAME_AS_TORCH = [PATHS[0], PATHS[1], PATHS[4]]  # fp32 with fresh weights every step (not DPU's stale ones)


@pytest.mark.parametrize("path", SAME_AS_TORCH, ids=[name for name, *_ in SAME_AS_TORCH])
def test_param_group_changes_made_in_a_pre_hook_apply_to_that_step_as_in_torch(path):
    """A pre-hook that sets the learning rate (what some warm-up utilities do) trains as under torch: the
    speculative step, which ran during backward with the old rate, is redone."""
    name, engine_options, dtype = path
    ref_net, net = make_net(), make_net()
    ref_opt = two_groups(ref_net)
    engine = OffloadEngine(two_groups(net), CPU, dtype, options(**engine_options))

    def warm_up(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            group["calls"] = group.get("calls", 0) + 1  # a key of the user's own: left alone
            group["lr"] = group["calls"] * 2e-3

    ref_opt.register_step_pre_hook(warm_up)
    engine.optimizer.register_step_pre_hook(warm_up)
    for batch in batches(6):
        loss_fn(ref_net, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        drive(engine, net, batch, speculative=name == "offload-speculative")
    assert [g["calls"] for g in engine.optimizer.param_groups] == [6, 6]
    # fp32 rounding of the fused kernel only (test_engine.py's bound); ignoring the hook's rate is >1e-3 off
    for p_ref, master in zip(ref_net.parameters(), engine.master_params()):
        torch.testing.assert_close(master, p_ref.detach(), rtol=1e-5, atol=1e-6)
    engine.close()


@pytest.mark.parametrize(
    "returned,match",
    [
        (
            lambda opt, args, kwargs: ((opt, 0.5), {}),
            r"asks for new step arguments \(args after the optimizer: \(0.5,\)",
        ),
        (lambda opt, args, kwargs: (args, {"closure": None}), r"kwargs: \{'closure': None\}"),
        (lambda opt, args, kwargs: kwargs.update(closure=None), r"kwargs: \{'closure': None\}"),
        (lambda opt, args, kwargs: "yes", r"must return None or a tuple of \(new_args, new_kwargs\), but got yes"),
    ],
    ids=["new-args", "new-kwargs", "kwargs-edited-in-place", "not-a-tuple"],
)
def test_a_pre_hook_asking_for_new_step_arguments_is_refused_before_the_update(returned, match):
    net = make_net()
    engine = OffloadEngine(torch.optim.AdamW(net.parameters()), CPU, torch.float32, options())
    engine.optimizer.register_step_pre_hook(returned)
    before = [t.clone() for t in engine.master_params()]
    loss_fn(net, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=match):
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(before, engine.master_params()))
    engine.close()


def test_a_pre_hook_returning_the_arguments_unchanged_is_accepted():
    net = make_net()
    engine = OffloadEngine(torch.optim.AdamW(net.parameters()), CPU, torch.float32, options())
    returned = []
    engine.optimizer.register_step_pre_hook(lambda opt, args, kwargs: returned.append(1) or (args, kwargs))
    loss_fn(net, batches(1)[0]).backward()
    assert not engine.step().skipped and returned == [1]
    engine.close()
