"""The precision plugin: the fp32 warning, the engine state under its own checkpoint key, 0.1.0 checkpoints."""

import warnings

import lightning as L
import pytest
import torch
from helpers import QUIET, WEIGHTS_ONLY, Classifier, loader
from lightning.pytorch.plugins import MixedPrecision

import lightning_zero_offload  # noqa: F401  (registers the strategy)
from lightning_zero_offload import ZeroOffloadPrecision, ZeroOffloadStrategy
from lightning_zero_offload.trainer.precision import ENGINE_STATE_KEY


def _fit_warnings(strategy="zero_offload", **trainer_kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(strategy=strategy, max_steps=2, **QUIET, **trainer_kwargs)
        trainer.fit(Classifier(scheduler=False), loader(n=32))
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(
    ("kwargs", "warned"),
    [
        ({"strategy": ZeroOffloadStrategy(in_place_on_cpu=False)}, True),  # fp32 copies offloaded: worth a word
        ({}, False),  # a CPU device in place: nothing is offloaded (tests/core/test_options.py words it)
        ({"precision": "bf16-mixed"}, False),
        ({"strategy": ZeroOffloadStrategy(in_place_on_cpu=False, cpu_state="bf16")}, True),
    ],
)
def test_fp32_default_precision_warns_and_names_what_to_pass(kwargs, warned):
    messages = [m for m in _fit_warnings(**kwargs) if "zero_offload is training in '32-true'" in m]
    assert bool(messages) == warned
    if warned:
        assert len(messages) == 1 and "precision='bf16-mixed'" in messages[0]
        state = kwargs["strategy"].options.cpu_state
        assert f"with {state} master weights on the CPU" in messages[0]


def as_written_by_0_1_0(checkpoint: dict) -> dict:
    """0.1.0 kept the engine state in the precision plugin's entry: step_calls, loss_scaler, dpu_pending."""
    engine = checkpoint.pop(ENGINE_STATE_KEY)
    old = {"step_calls": engine["step_calls"], "loss_scaler": engine["loss_scaler"]}
    if "pending" in engine["schedule"]:
        old["dpu_pending"] = engine["schedule"]["pending"]
    checkpoint["ZeroOffloadPrecision"] = old
    return checkpoint


@pytest.mark.slow  # Trainer runs of several epochs
def test_a_0_1_0_checkpoint_resumes_bitwise(tmp_path):
    """fp16 (loss scaler state) with a delayed update pending (stale device weights) at the save."""

    def run(max_epochs, ckpt_path=None):
        model = Classifier()
        trainer = L.Trainer(
            strategy=ZeroOffloadStrategy(cpu_step="delayed", dpu_warmup_steps=5, loss_scale_init=2.0**10),
            plugins=[ZeroOffloadPrecision("16-mixed")],
            max_epochs=max_epochs,
            **{**QUIET, "max_steps": -1},
        )
        trainer.fit(model, loader(n=64), ckpt_path=ckpt_path, **WEIGHTS_ONLY)
        return model, trainer

    full, _ = run(2)
    _, first = run(1)
    first.save_checkpoint(tmp_path / "new.ckpt")
    checkpoint = torch.load(tmp_path / "new.ckpt", weights_only=True)
    assert "dpu_pending" in as_written_by_0_1_0(checkpoint)["ZeroOffloadPrecision"]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    resumed, trainer = run(2, tmp_path / "old.ckpt")
    assert trainer.strategy.session.step_calls == 16
    assert resumed.losses == full.losses[8:]
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))


class _ScalerAtStart(L.Callback):
    """The loss scaler's state as the resumed run starts, in torch's GradScaler format under either strategy."""

    def on_train_start(self, trainer, pl_module):
        if isinstance(trainer.strategy, ZeroOffloadStrategy):
            self.state = trainer.strategy.session.grad_scaler_state_dict()
        else:
            self.state = trainer.precision_plugin.scaler.state_dict()


def _fp16_trainer(kind: str, init_scale: float, max_steps: int) -> L.Trainer:
    if kind == "auto":
        strategy = "auto"
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))
    else:
        strategy = ZeroOffloadStrategy(in_place_on_cpu=False, loss_scale_init=init_scale, loss_scale_hysteresis=1)
        plugin = ZeroOffloadPrecision("16-mixed")
    return L.Trainer(strategy=strategy, plugins=[plugin], max_steps=max_steps, callbacks=[_ScalerAtStart()], **QUIET)


@pytest.mark.parametrize(("first", "then"), [("auto", "zero_offload"), ("zero_offload", "auto")])
def test_the_fp16_loss_scale_carries_over_between_auto_and_zero_offload(tmp_path, first, then):
    """Resumed under the other strategy, fp16 goes on with the saved scale and its run of good steps, as a resume
    under the same one does: it used to restart from the new run's initial scale (and skip steps until the scale
    came back down, or grow it late)."""
    saving = _fp16_trainer(first, init_scale=2.0**22, max_steps=8)  # one epoch  # overflows: the scale comes down
    saving.fit(Classifier(scheduler=False), loader(n=64))
    saving.save_checkpoint(tmp_path / "fp16.ckpt")
    if first == "auto":
        saved = saving.precision_plugin.scaler.state_dict()
    else:
        saved = saving.strategy.session.grad_scaler_state_dict()
    assert saved["scale"] < 2.0**22 and saved["_growth_tracker"] > 0

    resuming = _fp16_trainer(then, init_scale=2.0**4, max_steps=9)
    resuming.fit(Classifier(scheduler=False), loader(n=64), ckpt_path=tmp_path / "fp16.ckpt", **WEIGHTS_ONLY)
    at_start = next(c.state for c in resuming.callbacks if isinstance(c, _ScalerAtStart))
    assert (at_start["scale"], at_start["_growth_tracker"]) == (saved["scale"], saved["_growth_tracker"])
