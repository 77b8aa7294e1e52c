"""Users' own code during fit, against ``strategy="auto"``: what it writes into the parameters, which
parameters it makes trainable, is honoured, or refused with an error that names the fix.

32-true runs the offload data path (``in_place_on_cpu=False``: what an accelerator runs, real copies)
and in place; bf16-mixed always runs the offload path. Tolerances: the engine's fp32 step is torch's
AdamW to within rounding (observed <= 3e-7 on these runs), so fp32 comparisons use atol 2e-6
(about 7x margin); a lost write would differ by the size of the write (>= 1e-2 here).
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging, WeightAveraging
from torch import nn

from lightning_zero_offload import ZeroOffloadStrategy
from tests.helpers import QUIET, Classifier, loader

ATOL = 2e-6
CLAMP = 0.05


def fit(strategy, precision="32-true", model=None, callbacks=(), max_steps=12, **kwargs):
    model = model or Classifier(scheduler=False, lr=3e-2)
    trainer = L.Trainer(
        strategy=strategy, precision=precision, max_steps=max_steps, callbacks=list(callbacks), **{**QUIET, **kwargs}
    )
    trainer.fit(model, loader())
    return model, trainer


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in model.parameters()]


def assert_same_model(ours: nn.Module, reference: nn.Module, atol: float = ATOL) -> None:
    for (name, a), b in zip(ours.named_parameters(), params(reference)):
        torch.testing.assert_close(a.detach().float(), b, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


OFFLOAD_32 = [
    pytest.param(dict(in_place_on_cpu=False), id="offload-sync"),
    pytest.param(dict(in_place_on_cpu=False, cpu_step="speculative"), id="offload-speculative"),
    pytest.param(dict(), id="in-place"),
]


class ClampWeights(L.Callback):
    """Max-norm / WGAN-style weight clipping after every step, the classic way (``p.data.clamp_``)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        for p in pl_module.parameters():
            p.data.clamp_(-CLAMP, CLAMP)


class ClampThroughParameter(L.Callback):
    """The same, written through the parameter itself under no_grad."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            for p in pl_module.parameters():
                p.clamp_(-CLAMP, CLAMP)


class ReassignData(L.Callback):
    """Replaces ``p.data`` with a new tensor (a reset of one layer at step 5)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 5:
            weight = pl_module.net[0].weight
            weight.data = torch.full_like(weight, 0.01)


class LoadStateMidFit(L.Callback):
    """Restores the weights saved at step 3 once, at step 7 (as a "rewind on spike" callback would)."""

    def __init__(self) -> None:
        self.saved = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 3:
            self.saved = copy.deepcopy({k: v.float() for k, v in pl_module.state_dict().items()})
        if trainer.global_step == 7:
            pl_module.load_state_dict(self.saved)


@pytest.mark.parametrize("options", OFFLOAD_32)
@pytest.mark.parametrize("callback", [ClampWeights, ClampThroughParameter, ReassignData, LoadStateMidFit])
def test_parameter_writes_between_steps_match_auto_in_32_true(options, callback):
    reference, _ = fit("auto", callbacks=[callback()])
    ours, trainer = fit(ZeroOffloadStrategy(**options), callbacks=[callback()])
    assert trainer.strategy.engine.in_place == (options == {})
    assert_same_model(ours, reference)


def test_parameter_writes_between_steps_are_kept_in_bf16_mixed():
    ours, _ = fit(ZeroOffloadStrategy(), precision="bf16-mixed", callbacks=[ClampWeights()])
    unclamped, _ = fit(ZeroOffloadStrategy(), precision="bf16-mixed")
    assert max(float(p.detach().abs().max()) for p in unclamped.parameters()) > 2 * CLAMP  # the clamp has work to do
    # The last write survives teardown. A write that leaves an element's bf16 bits as they were cannot be
    # seen, so that element keeps its fp32 master value, within one bf16 ulp of the written one.
    assert max(float(p.detach().abs().max()) for p in ours.parameters()) <= CLAMP * (1 + 2**-7)


class LossesAtWeights(L.Callback):
    """The training loss of each step: equal runs see equal weights at every forward."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_bf16_clamped_run_trains_from_the_written_weights():
    """Each forward after a write sees the written (clamped) bf16 weights, not the master's."""
    a, b = LossesAtWeights(), LossesAtWeights()
    fit(ZeroOffloadStrategy(), precision="bf16-mixed", callbacks=[ClampWeights(), a])
    fit(ZeroOffloadStrategy(), precision="bf16-mixed", callbacks=[b])
    assert a.losses[0] == b.losses[0]  # same start
    assert max(abs(x - y) for x, y in zip(a.losses[1:], b.losses[1:])) > 1e-3  # the clamp changed training


@pytest.mark.parametrize("options", OFFLOAD_32)
def test_weight_averaging_ends_with_the_average_as_under_auto(options):
    def averaging():
        return WeightAveraging(avg_fn=torch.optim.swa_utils.get_ema_avg_fn(0.8))

    reference, _ = fit("auto", callbacks=[averaging()])
    ours, _ = fit(ZeroOffloadStrategy(**options), callbacks=[averaging()])
    plain, _ = fit("auto")
    assert max(float((a - b).abs().max()) for a, b in zip(params(reference), params(plain))) > 1e-3
    assert_same_model(ours, reference)


@pytest.mark.parametrize("options", OFFLOAD_32)
def test_stochastic_weight_averaging_ends_with_the_average_as_under_auto(options):
    def swa():
        return StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)

    kwargs = dict(max_steps=-1, max_epochs=3)
    reference, _ = fit("auto", callbacks=[swa()], **kwargs)
    ours, _ = fit(ZeroOffloadStrategy(**options), callbacks=[swa()], **kwargs)
    assert_same_model(ours, reference)


def test_delayed_update_refuses_writes_it_cannot_merge():
    strategy = ZeroOffloadStrategy(cpu_step="delayed", dpu_warmup_steps=2, in_place_on_cpu=False)
    with pytest.raises(RuntimeError, match="cpu_step='sync' or 'speculative'"):
        fit(strategy, callbacks=[ClampWeights()])


def test_delayed_update_merges_writes_during_its_warmup():
    class ClampOnce(ClampWeights):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    reference, _ = fit("auto", callbacks=[ClampOnce()], max_steps=4)
    ours, _ = fit(
        ZeroOffloadStrategy(cpu_step="delayed", dpu_warmup_steps=10, in_place_on_cpu=False),
        callbacks=[ClampOnce()],
        max_steps=4,
    )
    assert_same_model(ours, reference)
