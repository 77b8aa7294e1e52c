"""The speculative schedule publishes speculated buckets during backward: results stay those of sync.

A speculated bucket goes to the device while backward still runs. These tests drive the engine as the
strategy does (``expect_step`` before the window's last backward) and compare with ``cpu_step="sync"``:
bitwise without rollback, with clipping that triggers (rolled back and published again), with a skipped
step (the device gets the master back), with tied weights, activation checkpointing and writes to the
parameters. In every model a barrier in backward waits for the gradient worker, so the buckets that are
final by then are on the device before the rest of backward runs: a node that still read them would
compute with the new weights and the comparison with sync would fail.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch
from engine_helpers import CPU, batches, options
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero_offload.engine import OffloadEngine, StepStats
from lightning_zero_offload.engine.schedules import SpeculativeSchedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _WaitForWorker(torch.autograd.Function):
    """Identity; its backward waits until the gradient worker has speculated and published what it has."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, engine: OffloadEngine) -> torch.Tensor:
        ctx.engine = engine
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.engine.grads.wait()
        return grad, None


class TiedLM(nn.Module):
    """An embedding tied to the output head, layers in between (optionally checkpointed without
    reentrancy), one weight shared by the first and the last layer, and barriers between the layers."""

    def __init__(self, checkpointed: bool = False, detached_alias: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(24, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.shared = nn.Linear(16, 16, bias=False)
        self.norm = nn.LayerNorm(16)
        self.checkpointed = checkpointed
        # The first layer reads the last layer's weight outside autograd (no gradient flows to it there).
        self.detached_alias = detached_alias
        self.engine: OffloadEngine | None = None

    def _barrier(self, h: torch.Tensor) -> torch.Tensor:
        return _WaitForWorker.apply(h, self.engine) if self.engine is not None else h

    def _block(self, index: int, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[index](h))
        if index in (0, len(self.layers) - 1):
            h = h + self.shared(h)  # used in two blocks, far apart in backward
        if index == 0 and self.detached_alias:
            h = h @ self.layers[-1].weight.detach()
        return h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for index in range(len(self.layers)):
            h = self._barrier(h)
            block = self._block
            if self.checkpointed:
                block = functools.partial(checkpoint, self._block, use_reentrant=False)
            h = block(index, h)
        h = self._barrier(self.norm(h))
        return nn.functional.linear(h, self.embed.weight)  # the head is the embedding

    def optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


def train(
    cpu_step: str,
    dtype: torch.dtype = torch.bfloat16,
    steps: int = 6,
    clip_norm: float | None = None,
    inf_at: int | None = None,
    write_at: int | None = None,
    checkpointed: bool = False,
    detached_alias: bool = False,
    publish: bool = True,
    publish_early: bool = True,
    halve_at: int | None = None,
    **kwargs,
) -> tuple[OffloadEngine, TiedLM, list[StepStats]]:
    net = TiedLM(checkpointed, detached_alias)
    element = torch.empty(0, dtype=dtype).element_size()
    kwargs.setdefault("bucket_size_mb", 290 * element / 2**20)  # a bucket per layer
    engine = OffloadEngine(net.optimizer(), CPU, dtype, options(cpu_step=cpu_step, **kwargs))
    net.engine = engine
    data = [(x.abs().mul(7).long().clamp(max=23)[:, :6], y) for x, y in batches(2 * steps, seed=5)]
    history = []
    # The class's own knob, as its docstring tells users to set it (models that read aliases of the weights).
    with mock.patch.object(SpeculativeSchedule, "publish_during_backward", publish):
        for step in range(steps):
            for micro in range(2):
                tokens, _ = data[2 * step + micro]
                if micro == 1:
                    engine.expect_step(publish_early=publish_early)
                engine.begin_backward()
                with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                    logits = net(tokens).float()
                loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 24), tokens[:, 1:].reshape(-1)) / 2
                if step == inf_at and micro == 1:
                    loss = loss * float("inf")
                engine.scale_loss(loss).backward()
                engine.finish_backward()
            if step == write_at:  # a write between backward and step, into buckets that may be on the device already
                with torch.no_grad():  # values no weight has: a write of the value the device shows is no write
                    net.layers[-1].weight[0, :3] = 3.0
                    net.shared.weight[1, 1] = -5.0
            if step == halve_at:  # a read-modify-write there: it must see the weights from before the step
                with torch.no_grad():
                    for p in net.parameters():
                        p.mul_(0.5)
            history.append(engine.step(clip_norm=clip_norm))
    return engine, net, history


def state(engine: OffloadEngine, net: TiedLM) -> list[torch.Tensor]:
    device = [p.detach().clone() for p in net.parameters()]  # before anything settles
    engine.sync()
    moments = [t for entry in engine.optimizer_state_dict()["state"].values() for t in entry.values() if t.dim()]
    return [*device, *engine.master_params(), *moments]


def assert_equal(ours: list[torch.Tensor], ref: list[torch.Tensor], bitwise: bool = True) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        if bitwise:
            assert torch.equal(a, b)
        else:  # the undo inverts the step up to one fp32 rounding per value
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-6, atol=1e-7)


def published_early(engine: OffloadEngine) -> int:
    return engine.schedule.early_published


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_publishing_during_backward_is_bitwise_sync(dtype, checkpointed):
    sync, sync_net, _ = train("sync", dtype, checkpointed=checkpointed)
    spec, spec_net, history = train("speculative", dtype, checkpointed=checkpointed)
    buckets = len(spec.layout.buckets)
    assert buckets >= 4
    # Most buckets reached the device during backward, in every step; the embedding's (its gradient is
    # final only at the end) and the shared weight's (first layer) at the earliest at the end of it.
    assert published_early(spec) >= len(history) * (buckets // 2)
    assert all(s.speculated_fraction == 1.0 and not s.rolled_back for s in history)
    assert_equal(state(spec, spec_net), state(sync, sync_net))


def test_publishing_only_after_validation_gives_the_same_result():
    on, on_net, _ = train("speculative")
    off, off_net, _ = train("speculative", publish=False)
    assert published_early(off) == 0 < published_early(on)
    assert_equal(state(on, on_net), state(off, off_net))


@pytest.mark.parametrize("rollback", ["snapshot", "undo"])
def test_clipping_that_triggers_publishes_the_corrected_buckets_again(rollback):
    _, _, history = train("sync")
    norms = sorted(s.grad_norm for s in history)
    clip = norms[len(norms) // 2]  # triggers on about half of the steps
    sync, sync_net, _ = train("sync", clip_norm=clip)
    spec, spec_net, history = train("speculative", clip_norm=clip, speculation_rollback=rollback)
    assert any(s.rolled_back for s in history) and not all(s.rolled_back for s in history)
    assert published_early(spec) > 0
    assert_equal(state(spec, spec_net), state(sync, sync_net), bitwise=rollback == "snapshot")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_skipped_step_gives_the_device_the_master_back(dtype):
    with pytest.warns(RuntimeWarning, match="Non-finite gradients"):
        sync, sync_net, sync_history = train("sync", dtype, inf_at=3)
    with pytest.warns(RuntimeWarning, match="Non-finite gradients"):
        spec, spec_net, history = train("speculative", dtype, inf_at=3, speculation_rollback="snapshot")
    assert history[3].skipped and sync_history[3].skipped
    assert not history[3].rolled_back or spec.schedule.rollbacks == 1
    assert published_early(spec) > 0
    assert_equal(state(spec, spec_net), state(sync, sync_net))


def test_a_skipped_step_after_early_publish_restores_the_device_bitwise():
    """The inf enters at the first layer only: the buckets finalised before it were speculated and are
    on the device when the overflow is found; the skip must put the master's rounding back."""
    engine, net, _ = train("speculative", steps=2, speculation_rollback="snapshot")
    before = [p.detach().clone() for p in net.parameters()]
    early = published_early(engine)
    tokens = torch.zeros(2, 6, dtype=torch.long)
    engine.expect_step(publish_early=True)
    engine.begin_backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = net.embed(tokens)
        h.register_hook(lambda g: g * float("inf"))  # only the embedding's gradient is non-finite
        for index in range(len(net.layers)):
            h = net._block(index, net._barrier(h))
        logits = nn.functional.linear(net._barrier(net.norm(h)), net.embed.weight).float()
    logits.sum().backward()
    engine.finish_backward()
    assert published_early(engine) > early  # the device changed during backward
    assert any(not torch.equal(p, b) for p, b in zip(net.parameters(), before))
    with pytest.warns(RuntimeWarning, match="Non-finite gradients"):
        stats = engine.step()
    assert stats.skipped and stats.rolled_back
    assert_equal([p.detach() for p in net.parameters()], before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_writes_between_backward_and_step_are_merged_as_in_sync(dtype):
    sync, sync_net, _ = train("sync", dtype, write_at=2)
    spec, spec_net, _ = train("speculative", dtype, write_at=2, speculation_rollback="snapshot")
    assert spec.schedule.rollbacks >= 1  # the written buckets were taken back and updated from the writes
    assert_equal(state(spec, spec_net), state(sync, sync_net))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_without_publish_early_the_parameters_keep_their_values_until_step(dtype):
    """``expect_step()`` alone: code between backward and step() may read the parameters, so nothing is
    published during backward and a write that reads them (halving every weight) trains as under sync."""
    sync, sync_net, _ = train("sync", dtype, halve_at=2)
    # the written buckets are rolled back (bitwise: a snapshot) and updated from the written values
    spec, spec_net, history = train(
        "speculative", dtype, halve_at=2, publish_early=False, speculation_rollback="snapshot"
    )
    assert published_early(spec) == 0 and max(s.speculated_fraction for s in history) > 0  # still speculated
    assert_equal(state(spec, spec_net), state(sync, sync_net))
    early, early_net, _ = train("speculative", dtype, halve_at=2, speculation_rollback="snapshot")  # published early
    assert published_early(early) > 0
    assert not all(torch.equal(a, b) for a, b in zip(state(early, early_net), state(sync, sync_net)))


def test_an_optimizer_pre_hook_sees_the_parameters_from_before_the_step():
    """A step pre-hook reads the parameters when step() starts: the engine publishes no bucket early then."""
    seen: list[torch.Tensor] = []

    def pre_hook(optimizer, args, kwargs):
        seen.append(optimizer.param_groups[0]["params"][1].detach().clone())

    net = TiedLM()
    engine = OffloadEngine(net.optimizer(), CPU, torch.float32, options(cpu_step="speculative"))
    engine.optimizer.register_step_pre_hook(pre_hook)
    before = net.layers[0].weight.detach().clone()
    engine.expect_step(publish_early=True)
    engine.begin_backward()
    net(torch.arange(6).view(1, 6)).float().square().mean().backward()
    engine.finish_backward()
    engine.step()
    assert published_early(engine) == 0 and engine.last.speculated_fraction > 0
    assert torch.equal(seen[0], before) and not torch.equal(net.layers[0].weight, before)


def test_a_saved_alias_read_after_its_bucket_was_published_raises_instead_of_using_new_weights():
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        train("speculative", detached_alias=True)
    # without publishing during backward the same model trains as sync does
    sync, sync_net, _ = train("sync", detached_alias=True)
    spec, spec_net, _ = train("speculative", detached_alias=True, publish=False)
    assert_equal(state(spec, spec_net), state(sync, sync_net))


def test_an_announced_step_that_never_comes_puts_the_master_back_on_the_device():
    engine, net, _ = train("speculative", steps=2, speculation_rollback="snapshot")
    before = [p.detach().clone() for p in net.parameters()]
    tokens = torch.zeros(2, 6, dtype=torch.long)
    for _ in range(2):  # announced both times, stepped after the second only
        engine.expect_step(publish_early=True)
        engine.begin_backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(tokens).float().sum().backward()
        engine.finish_backward()
    assert engine.schedule.rollbacks == 1  # the first backward's speculation, published and taken back
    engine.step()
    # the same two backward passes with sync: the first one's gradient counted once, in the one step
    sync, sync_net, _ = train("sync", steps=2)
    for _ in range(2):
        sync.begin_backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sync_net(tokens).float().sum().backward()
        sync.finish_backward()
    sync.step()
    assert not all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert_equal(state(engine, net), state(sync, sync_net))
