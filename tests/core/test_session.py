"""The shared core driven directly, without a Trainer or Fabric: options, the session, its optimizer and
checkpoints, on a tiny CPU model (the offload data path in fp32, so results compare exactly)."""

import contextlib
import inspect
import threading
import warnings
from datetime import timedelta

import pytest
import torch
from engine_helpers import CPU, batches, loss_fn, make_net, options, two_groups
from torch import nn

from lightning_zero_offload import ZeroOffloadFabricStrategy, ZeroOffloadStrategy
from lightning_zero_offload.checkpoints import FABRIC_KEY, FORMAT_KEY, load_sharded
from lightning_zero_offload.core import (
    ENGINE_STATE_KEY,
    OPTION_NAMES,
    OffloadedOptimizer,
    OffloadSession,
    collective_timeout,
    make_offload_options,
    release_after_failure,
    resolve_precision,
    training_session,
)
from lightning_zero_offload.engine import LossScalerConfig, OffloadOptions
from lightning_zero_offload.fabric.checkpoints import (
    fabric_checkpoint_from_sharded,
    restore_objects,
    sharded_from_fabric_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def start():
    """Start sessions on the CPU (closed at the end of the test, so no worker thread outlives it)."""
    sessions = []

    def start(net: nn.Module, optimizer=None, **option_values) -> OffloadSession:
        optimizer = optimizer if optimizer is not None else two_groups(net)
        session = OffloadSession.start(net, [optimizer], CPU, "32-true", options(**option_values), 1, 1)
        sessions.append(session)
        return session

    yield start
    for session in sessions:
        session.close()


def train(session: OffloadSession, steps: list, clip: float | None = None) -> None:
    """What both front ends do per step: replan, zero_grad, backward between begin/finish, the recorded
    clip, step."""
    for batch in steps:
        session.before_training_forward()
        loss = loss_fn(session.module, batch)
        session.zero_grad()
        session.begin_backward()
        session.scale_loss(loss).backward()
        session.finish_backward()
        if clip is not None:
            session.clip_norm(clip)
        session.step()


def backward(session: OffloadSession, batch) -> None:
    session.begin_backward()
    loss_fn(session.module, batch).backward()
    session.finish_backward()


def mse(model: nn.Module, batch) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def weights(session: OffloadSession) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in session.master_state_dict().items()}


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- options, precision, timeout ------------------------------------------------------------------


def test_offload_options_from_keywords_validate_once_with_the_engine_defaults():
    assert make_offload_options() == OffloadOptions()
    options = make_offload_options(bucket_size_mb=2, loss_scale_init=8.0, loss_scale_min=2.0)
    assert options.bucket_size_mb == 2
    assert options.loss_scaler == LossScalerConfig(init_scale=8.0, min_scale=2.0)
    with pytest.raises(ValueError, match="loss_scale_min"):
        make_offload_options(loss_scale_init=1.0, loss_scale_min=2.0)
    with pytest.raises(TypeError, match="no option metric, nonsense"):
        make_offload_options(metric=True, nonsense=1)
    with pytest.raises(TypeError, match="no option loss_scaler"):  # the scaler is set through loss_scale_*
        make_offload_options(loss_scaler=LossScalerConfig())


def test_the_trainer_strategy_forwards_every_option_by_name():
    parameters = inspect.signature(ZeroOffloadStrategy.__init__).parameters
    assert set(OPTION_NAMES) <= set(parameters)
    assert ZeroOffloadStrategy().options == OffloadOptions()  # its signature's defaults are the engine's
    given = {"cpu_step": "sync", "loss_scale_hysteresis": 5, "checkpoint_format": "sharded"}
    assert ZeroOffloadStrategy(**given).options == make_offload_options(**given)


def test_precision_names_and_refusals():
    assert resolve_precision("bf16") == ("bf16-mixed", torch.bfloat16)
    assert resolve_precision("16-mixed") == ("16-mixed", torch.float16)
    assert resolve_precision(32) == ("32-true", torch.float32)
    with pytest.raises(ValueError, match="use precision='bf16-mixed'"):
        resolve_precision("bf16-true")


def test_collective_timeout_takes_seconds_or_a_timedelta():
    assert collective_timeout(1.5) == timedelta(seconds=1.5)
    assert collective_timeout(timedelta(minutes=2)) == timedelta(minutes=2)
    assert collective_timeout(None) is None
    with pytest.raises(ValueError, match="timeout"):
        collective_timeout(0)


# -- the session: setup and training ----------------------------------------------------------------


def test_start_refuses_what_it_cannot_train(start):
    net = make_net()
    with pytest.raises(ValueError, match="exactly one optimizer, got 2"):
        OffloadSession.start(net, [two_groups(net), two_groups(net)], CPU, "32-true", options(), 1, 1)
    with pytest.raises(ValueError, match="not parameters of the module it trains"):
        start(make_net(), two_groups(net))
    with pytest.raises(ValueError, match="does not support precision"):
        OffloadSession.start(net, [two_groups(net)], CPU, "64-true", options(), 1, 1)


def test_steps_match_torch_adamw_with_the_recorded_clip(start):
    reference = make_net()
    reference_optimizer = two_groups(reference)
    session = start(make_net())
    for batch in batches(6):
        loss_fn(reference, batch).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        train(session, [batch], clip=0.5)
    for key, weight in session.master_state_dict().items():
        torch.testing.assert_close(weight, reference.state_dict()[key], rtol=1e-5, atol=1e-6)
        assert torch.equal(weight, session.module.state_dict()[key])  # fp32: the device copy is the master


def test_grad_norm_is_the_steps_norm_and_its_summary_is_computed_once(start, monkeypatch):
    session = start(make_net())
    grads = session.engine.grads
    calls = []
    summary = grads.local_summary
    monkeypatch.setattr(grads, "local_summary", lambda: calls.append(1) or summary())
    backward(session, batches(1)[0])
    norm = session.grad_norm()
    session.clip_norm(norm / 2)
    stats = session.step()
    assert stats.grad_norm == norm and len(calls) == 1  # one summary (one all-reduce with several ranks)


def test_zero_grad_drops_the_window_and_skip_step_drops_the_clip(start):
    data = batches(3)
    once, twice = start(make_net()), start(make_net())
    train(once, [data[1]])
    backward(twice, data[0])  # accumulated, then dropped with its clip
    twice.clip_norm(1e-6)
    twice.zero_grad()
    train(twice, [data[1]])
    assert_equal(weights(once), weights(twice))

    skipped = start(make_net())
    backward(skipped, data[0])
    skipped.clip_value(1e-6)
    skipped.skip_step()
    skipped.zero_grad()
    train(skipped, [data[2]])
    reference = start(make_net())
    train(reference, [data[2]])
    assert_equal(weights(reference), weights(skipped))


def test_a_second_clip_or_a_backward_after_a_clip_is_refused_before_anything_changes(start):
    """torch applies clips in turn and clips only the gradients accumulated when it is called; the step's fused clip
    can do neither, and applied them otherwise (the last of a kind, or the whole window: 1e-2 to 7e-2 off torch)."""
    data = batches(3)
    session = start(make_net())
    backward(session, data[0])
    session.clip_value(0.02)
    with pytest.raises(ValueError, match=r"clip by value \(clip_val\)=0.02, then a clip by norm \(max_norm\)=0.05"):
        session.clip_norm(0.05)
    session.step()  # with the first clip, as recorded
    backward(session, data[1])
    session.clip_norm(0.05)
    with pytest.raises(ValueError, match="recorded before this backward.*just before optimizer.step"):
        backward(session, data[2])
    reference = start(make_net())
    backward(reference, data[0])
    reference.clip_value(0.02)
    reference.step()
    reference.zero_grad()
    assert_equal(weights(reference), weights(session))  # the refused calls changed nothing


def test_what_the_engine_did_is_read_through_the_session(start):
    net = make_net()
    session = start(net)
    assert training_session(session) is session and training_session(None) is None
    train(session, batches(2))
    stats = session.last_step
    assert session.step_calls == 2 and session.skipped_steps == 0 and session.rollbacks == 0
    assert stats.grad_norm > 0 and not stats.skipped
    assert session.loss_scale is None and session.world_size == 1  # fp32: no loss scaling
    assert session.memory_report()["params"] == sum(p.numel() for p in net.parameters())
    session.close()
    assert training_session(session) is None and session.step_calls == 2  # the counts stay after the close


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_the_strategies_user_api_before_setup_says_what_is_missing(front_end):
    strategy = ZeroOffloadStrategy() if front_end == "trainer" else ZeroOffloadFabricStrategy()
    assert strategy.session is None and strategy.engine is None and strategy.last_step_stats is None
    with pytest.raises(RuntimeError, match="not training"):
        strategy.expect_step()
    with pytest.raises(RuntimeError, match="not set up yet"):
        strategy.memory_report()


def test_param_keys_follow_the_engine_when_a_frozen_layer_becomes_trainable(start):
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))  # equal shapes: a shifted key shows
    net[1].requires_grad_(False)
    session = start(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    for _ in range(2):
        session.begin_backward()
        mse(session.module, batch).backward()
        session.step()
    assert [keys[0] for keys in session.param_keys] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    net[1].requires_grad_(True)
    session.before_training_forward()  # the engine re-plans: the middle layer joins the flat buffer
    session.begin_backward()
    mse(session.module, batch).backward()
    session.step()
    assert [keys[0] for keys in session.param_keys] == [f"{i}.{n}" for i in range(3) for n in ("weight", "bias")]
    assert_equal(session.master_state_dict(), session.module.state_dict())


def test_tied_weights_appear_under_every_key(start):
    net = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    net[1].weight = net[0].weight
    session = start(net, torch.optim.AdamW(net.parameters()))
    state = session.master_state_dict()
    assert session.param_keys == [["0.weight", "1.weight"]]
    assert torch.equal(state["0.weight"], state["1.weight"])


# -- checkpoints ------------------------------------------------------------------------------------


def test_full_save_and_load_round_trip_resumes_bitwise(start, tmp_path):
    data = batches(8)
    straight = start(make_net())
    train(straight, data)

    first = start(make_net())
    train(first, data[:4])
    optimizer = OffloadedOptimizer(first)
    with first.shared_buffers():  # views of the engine's buffers, written at once
        torch.save({"model": first.module_state_to_save(), "optimizer": optimizer.state_dict()}, tmp_path / "c.pt")
    checkpoint = torch.load(tmp_path / "c.pt", weights_only=True)
    assert ENGINE_STATE_KEY in checkpoint["optimizer"] and checkpoint["optimizer"]["state"]

    resumed = start(make_net(seed=7))
    resumed.module.load_state_dict(checkpoint["model"])
    resumed.load_master_weights(checkpoint["model"])
    OffloadedOptimizer(resumed).load_state_dict(checkpoint["optimizer"])
    assert resumed.step_calls == 4
    train(resumed, data[4:])
    assert_equal(weights(straight), weights(resumed))


def test_sharded_save_and_load_round_trip_resumes_bitwise(start, tmp_path):
    data = batches(8)
    straight = start(make_net(), checkpoint_format="sharded")
    train(straight, data)

    first = start(make_net(), checkpoint_format="sharded")
    train(first, data[:4])
    module_state = first.module_state_to_save()
    assert not any(key in module_state for keys in first.param_keys for key in keys)  # the shards hold them
    meta = {"state_dict": module_state, "optimizer_states": [first.optimizer_state_to_save()]}
    meta[ENGINE_STATE_KEY] = first.engine_state_dict()
    first.save_sharded(meta, tmp_path / "s.ckpt", 0, broadcast=lambda obj: obj)
    checkpoint = load_sharded(tmp_path / "s.ckpt")

    resumed = start(make_net(seed=7), checkpoint_format="sharded")
    resumed.load_master_weights(checkpoint["state_dict"])
    resumed.load_optimizer_state(checkpoint["optimizer_states"][0])
    resumed.load_engine_state(checkpoint[ENGINE_STATE_KEY])
    train(resumed, data[4:])
    assert_equal(weights(straight), weights(resumed))


def test_loading_weights_a_state_dict_lacks(start):
    session = start(make_net())
    before = weights(session)
    partial = {k: torch.zeros_like(v) for k, v in before.items() if not k.startswith("4.")}
    with pytest.raises(KeyError, match="4.weight"):
        session.load_master_weights(partial)
    session.load_master_weights(partial, strict=False)
    after = weights(session)
    assert all(torch.equal(after[k], torch.zeros_like(v) if k in partial else v) for k, v in before.items())


def test_fabric_checkpoints_in_the_sharded_layout_and_back():
    checkpoint = {"net": {"w": 1}, "opt": {"state": {}}, "step": 3, FABRIC_KEY: {"model": "net", "optimizer": "opt"}}
    meta = sharded_from_fabric_checkpoint(dict(checkpoint))
    assert meta["state_dict"] == {"w": 1} and meta["optimizer_states"] == [{"state": {}}] and "net" not in meta
    meta[FORMAT_KEY] = {"format": "sharded"}  # what save_sharded adds
    assert fabric_checkpoint_from_sharded(meta) == {"net": {"w": 1}, "opt": {"state": {}}, "step": 3}


def test_restore_objects_loads_modules_first_and_returns_the_rest():
    order = []

    class Stateful:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            order.append(("stateful", state))

    module = nn.Linear(2, 2)
    state = {"scheduler": Stateful(), "step": 0, "model": module}
    left = restore_objects(
        state,
        {"scheduler": 1, "step": 5, "model": {"w": 2}, "extra": 9},
        lambda m, weights: order.append(("module", weights)),
    )
    assert order == [("module", {"w": 2}), ("stateful", 1)]
    assert state["step"] == 5 and left == {"extra": 9}
    assert restore_objects(None, {"a": 1}, lambda m, w: None) == {"a": 1}


def test_release_after_failure_never_raises(start, monkeypatch):
    session = start(make_net())

    def fails(after_failure: bool = False) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(session, "close", fails)  # undone before the fixture closes the session
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        release_after_failure(session, distributed=False)
    assert any("cleaning up after the failure also failed" in str(w.message) for w in caught)


# -- a model built on the meta device ------------------------------------------------------------------------


class Stack(nn.Module):
    """Repeated blocks (the units of a blockwise fill), a frozen layer, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.full((16,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(torch.tanh(self.blocks(x))) * self.scale)

    def reset_parameters(self) -> None:  # the buffer's own (a module that owns one recomputes it)
        self.scale.fill_(0.5)


def stack_optimizer(model: Stack) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [{"params": model.blocks.parameters(), "lr": 2e-2}, {"params": model.head.parameters(), "weight_decay": 0.0}],
        lr=1e-2,
    )


@pytest.mark.parametrize(
    ("precision", "option_values"),
    [
        ("32-true", {"in_place_on_cpu": True}),
        ("bf16-mixed", {}),
        ("bf16-mixed", {"cpu_state": "bf16"}),
        ("32-true", {"cpu_state": "bf16"}),
        ("16-mixed", {"cpu_step": "speculative"}),
        ("bf16-mixed", {"cpu_step": "delayed"}),
    ],
)
def test_a_model_built_on_the_meta_device_trains_bitwise_as_the_eager_build(precision, option_values):
    """Placeholders, the optimizer over them, the engine filled block by block: the master weights, the device
    copy, the frozen layer and the buffer as an eager build's with the same seed, and the same steps after."""
    data = [(torch.randn(8, 16, generator=torch.Generator().manual_seed(i)), torch.randn(8, 4)) for i in range(3)]
    runs = {}
    for built in ("eager", "meta"):
        torch.manual_seed(0)
        with torch.device("meta") if built == "meta" else contextlib.nullcontext():
            model = Stack()
        blockwise = OffloadSession.placeholders(model, CPU) if built == "meta" else None
        assert (blockwise is None) == (built == "eager")
        session = OffloadSession.start(
            model, [stack_optimizer(model)], CPU, precision, options(**option_values), 1, 1, blockwise=blockwise
        )
        device_copy = [p.detach().clone() for p in model.parameters()]
        for batch in data:
            session.before_training_forward()
            session.zero_grad()
            session.begin_backward()
            low = session.param_dtype != torch.float32
            with torch.autocast("cpu", dtype=session.param_dtype, enabled=low):
                loss = mse(model, batch)
            session.scale_loss(loss).backward()
            session.finish_backward()
            session.step()
        session.sync()
        runs[built] = (weights(session), device_copy, {k: v.clone() for k, v in model.state_dict().items()})
        session.close()
    for eager, meta in zip(runs["eager"], runs["meta"]):
        if isinstance(eager, dict):
            assert_equal(eager, meta)
        else:
            assert all(torch.equal(a, b) for a, b in zip(eager, meta))


def test_a_failed_fill_closes_the_engine_it_started():
    class Forgets(nn.Linear):
        def reset_parameters(self) -> None:
            nn.init.zeros_(self.weight)  # not the bias: left NaN

    with torch.device("meta"):
        model = nn.Sequential(Forgets(4, 4), Forgets(4, 4))
    blockwise = OffloadSession.placeholders(model, CPU)
    optimizer = torch.optim.AdamW(model.parameters())
    before = set(threading.enumerate())  # other tests' engines may still be open
    with pytest.raises(ValueError, match=r"left Forgets\.bias unset"):
        OffloadSession.start(model, [optimizer], CPU, "32-true", options(), 1, 1, blockwise=blockwise)
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("zero-offload-step")]


def test_a_pretrained_load_that_fails_part_way_leaves_the_device_copy_showing_the_master(tmp_path, monkeypatch):
    """load_pretrained into the ZeRO-2 engine writes the master weights; a read failing after some of them
    still refreshes the device copy from the master as it then is."""
    from lightning_zero_offload.engine.offload_params import pretrained

    torch.manual_seed(0)
    model = Stack()
    session = OffloadSession.start(model, [stack_optimizer(model)], CPU, "bf16-mixed", options(), 1, 1)
    torch.manual_seed(5)
    torch.save(Stack().state_dict(), tmp_path / "weights.pt")
    reads = []
    real_read = pretrained.Checkpoint.read

    def failing_read(self, key, start, stop):
        reads.append(key)
        if len(reads) == 3:
            raise OSError("the disk went away")
        return real_read(self, key, start, stop)

    monkeypatch.setattr(pretrained.Checkpoint, "read", failing_read)
    with pytest.raises(OSError, match="went away"):
        pretrained.load_pretrained(model, tmp_path / "weights.pt")
    masters = session.engine.master_params()
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(session.engine.params, masters))
    assert not torch.equal(masters[0], masters[0].new_zeros(())) and len(reads) == 3
    session.close()


def test_a_load_before_setup_gives_memory_to_what_it_holds_only():
    from lightning_zero_offload.core import built_on_meta

    torch.manual_seed(0)
    weights = Stack().state_dict()
    with built_on_meta():
        copied, assigned = Stack(), Stack()
    copied.blocks.load_state_dict({k.removeprefix("blocks."): v for k, v in weights.items() if k.startswith("blocks.")})
    assert [n for n, p in copied.named_parameters() if not p.is_meta] == [n for n in weights if n.startswith("blocks")]
    assert all(torch.equal(copied.state_dict()[k], weights[k]) for k in weights if k.startswith("blocks."))
    assigned.load_state_dict(weights, assign=True)  # torch puts the tensors in place itself
    assert all(assigned.state_dict()[k].data_ptr() == weights[k].data_ptr() for k in weights)
