"""ZeroOffloadStrategy through the unchanged Trainer loop, against plain Lightning runs."""

import copy
import os
import subprocess
import sys
from contextlib import nullcontext

import lightning as L
import pytest
import torch
from helpers import QUIET, WEIGHTS_ONLY, Classifier, GradNorms, assert_clipping_triggered, loader
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import lightning_zero_offload  # noqa: F401  (registers "zero_offload")
from lightning_zero_offload import ZeroOffloadPrecision, ZeroOffloadStrategy, kernels
from lightning_zero_offload.demo.data import ResumableLoader
from lightning_zero_offload.trainer.precision import ENGINE_STATE_KEY


def fit(strategy="zero_offload", precision="32-true", model=None, data=None, **trainer_kwargs):
    model = model or Classifier()
    kwargs = {**QUIET, "max_steps": 32, **trainer_kwargs}
    trainer = L.Trainer(strategy=strategy, precision=precision, **kwargs)
    trainer.fit(model, data or loader())
    return model, trainer


def assert_params_close(a, b, rtol, atol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=rtol, atol=atol, msg=name)


@pytest.mark.slow  # Trainer runs of several epochs
@pytest.mark.parametrize("in_place", [None, False], ids=["in-place", "offload-path"])
def test_32_true_matches_plain_lightning_with_groups_scheduler_clipping_accumulation(in_place):
    """On a CPU device 32-true runs in place by default; in_place_on_cpu=False forces the offload path
    (buckets, fp32 gradient buffer, copy-back) through the same comparison."""
    clip = 0.4  # the norms run 0.25-0.7 here: the clip acts on some steps and not on others
    common = {"gradient_clip_val": clip, "accumulate_grad_batches": 2, "max_steps": 32}
    ref_norms, norms = GradNorms(), GradNorms()
    ref, _ = fit("auto", callbacks=[ref_norms], **common)
    strategy = ZeroOffloadStrategy() if in_place is None else ZeroOffloadStrategy(in_place_on_cpu=in_place)
    ours, trainer = fit(strategy, callbacks=[norms], **common)
    assert trainer.global_step == 32
    assert trainer.strategy.session.resolved.in_place == (in_place is None)
    assert_clipping_triggered(ref_norms.norms, clip)
    # The engine's global norm (what it clipped with) is torch's, step by step: observed 5e-8 relative
    # (fp32 sums in another order), margin 20x; a norm from part of the gradients is off by >10%.
    assert norms.norms == pytest.approx(ref_norms.norms, rel=1e-6)
    # fp32 end to end; the fused kernel differs from torch only by fp32 rounding (see tests/engine):
    # observed 7.5e-8 absolute on the weights and 1.1e-7 relative on the losses, margins 13x and 18x.
    assert_params_close(ref, ours, rtol=0, atol=1e-6)
    assert ours.losses == pytest.approx(ref.losses, rel=2e-6)


def test_clip_by_value_matches_plain_lightning():
    clip = 0.05
    common = {"gradient_clip_val": clip, "gradient_clip_algorithm": "value", "max_steps": 12}
    ref_norms = GradNorms()
    ref, _ = fit("auto", callbacks=[ref_norms], **common)
    ours, _ = fit("zero_offload", **common)
    assert min(ref_norms.max_abs) > clip  # the clamp acts on every step (the trajectories are the same)
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)


def test_bf16_mixed_matches_plain_bf16_autocast_and_learns():
    # Plain bf16-mixed keeps fp32 weights and runs forward/backward in bf16 under autocast: the same math
    # as fp32 master on the CPU + bf16 weights on the device.
    ref, _ = fit("auto", precision="bf16-mixed", model=Classifier(scheduler=False), max_steps=40)
    seen = {}

    class Probe(Classifier):
        def on_train_batch_start(self, batch, batch_idx):
            seen["dtypes"] = {p.dtype for p in self.parameters()}

    ours, _ = fit("zero_offload", precision="bf16-mixed", model=Probe(scheduler=False), max_steps=40)
    assert seen["dtypes"] == {torch.bfloat16}  # low-precision params on the device while training
    assert {p.dtype for p in ours.parameters()} == {torch.float32}  # master weights handed back
    # The avx2 and torch backends round as torch's fused AdamW on this model: observed 6e-8 (fp32
    # rounding of the master), identical losses; margin 16x. The scalar backend (and any not measured,
    # avx512 among them) differs from torch by 1 ulp somewhere, which flips a bf16 weight rounding and
    # moves later gradients by ~2^-8 relative: observed 3.3e-4 with scalar, margin 9x.
    atol = 1e-6 if kernels.backend() in ("avx2", "torch") else 3e-3
    assert_params_close(ref, ours, rtol=0, atol=atol)
    assert sum(ours.losses[-8:]) < 0.8 * sum(ours.losses[:8])


def test_fp16_with_loss_scaling_trains_and_saves_scaler_state(tmp_path):
    strategy = ZeroOffloadStrategy(loss_scale_init=2.0**12)
    model, trainer = fit(strategy, precision=None, plugins=[ZeroOffloadPrecision("16-mixed")], max_steps=30)
    assert trainer.precision_plugin.precision == "16-mixed"
    assert sum(model.losses[-8:]) < sum(model.losses[:8])
    trainer.save_checkpoint(tmp_path / "fp16.ckpt")
    ckpt = torch.load(tmp_path / "fp16.ckpt", weights_only=True)
    assert ckpt[ENGINE_STATE_KEY]["loss_scaler"]["scale"] == 2.0**12
    assert "ZeroOffloadPrecision" not in ckpt  # 0.1.0 kept it there; it loads still (test_precision.py)


@pytest.mark.filterwarnings(  # the first steps overflow and are skipped: torch warns as it does under AMP
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`"
)
def test_fp16_scale_lowered_by_natural_overflows_resumes_bitwise(tmp_path):
    """No injected inf: a loss scale of 2^20 overflows fp16 gradients by itself, so the scale is lowered
    before the save (10 steps per epoch), grows back every 4 good steps and overflows again after it."""

    def run(max_epochs, ckpt_path=None):
        model = Classifier()
        trainer = L.Trainer(
            strategy=ZeroOffloadStrategy(loss_scale_init=2.0**20, loss_scale_growth_interval=4),
            plugins=[ZeroOffloadPrecision("16-mixed")],  # on a CPU Lightning turns "16-mixed" into bf16
            max_epochs=max_epochs,
            **{**QUIET, "max_steps": -1},
        )
        trainer.fit(model, loader(n=80), ckpt_path=ckpt_path, **WEIGHTS_ONLY)
        return model, trainer

    full, full_trainer = run(2)
    _, first = run(1)
    first.save_checkpoint(tmp_path / "fp16.ckpt")
    saved = torch.load(tmp_path / "fp16.ckpt", weights_only=True)[ENGINE_STATE_KEY]
    assert saved["loss_scaler"]["scale"] < 2.0**20 and saved["skipped_steps"] > 0
    assert full_trainer.strategy.session.skipped_steps > saved["skipped_steps"]  # and after the save

    class ScaleAtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.scaler = trainer.strategy.session.engine_state_dict()["loss_scaler"]

    probe = ScaleAtStart()
    resumed = Classifier()
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(loss_scale_init=2.0**20, loss_scale_growth_interval=4),
        plugins=[ZeroOffloadPrecision("16-mixed")],
        max_epochs=2,
        callbacks=[probe],
        **{**QUIET, "max_steps": -1},
    )
    trainer.fit(resumed, loader(n=80), ckpt_path=tmp_path / "fp16.ckpt", **WEIGHTS_ONLY)
    assert probe.scaler == saved["loss_scaler"]
    assert resumed.losses == full.losses[10:]
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))
    assert trainer.strategy.session.loss_scale == full_trainer.strategy.session.loss_scale


@pytest.mark.slow  # a fresh interpreter loads the checkpoint
def test_resume_is_bitwise_identical_and_checkpoint_is_portable(tmp_path):
    clip = 0.5  # the norms run 0.3-0.8 here: clipped steps on both sides of the save
    common = {"precision": "bf16-mixed", "gradient_clip_val": clip, "max_steps": -1}
    norms = GradNorms()
    full, _ = fit(max_epochs=2, callbacks=[norms], **common)  # 20 steps per epoch
    assert_clipping_triggered(norms.norms[:20], clip)
    assert_clipping_triggered(norms.norms[20:], clip)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1)
    first, _ = fit(max_epochs=1, enable_checkpointing=True, callbacks=[ckpt_cb], **common)
    path = tmp_path / "epoch=0.ckpt"
    resumed = Classifier()
    # Lightning's own note: the resumed run has no ModelCheckpoint, whose state the checkpoint holds
    with pytest.warns(UserWarning, match="callbacks used to create the checkpoint need to be provided"):
        L.Trainer(
            strategy="zero_offload", max_epochs=2, **{**QUIET, "precision": "bf16-mixed"}, gradient_clip_val=clip
        ).fit(resumed, loader(), ckpt_path=path, **WEIGHTS_ONLY)
    assert resumed.losses == full.losses[20:]  # bitwise: the continuation is the uninterrupted run
    for p, q in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p, q)

    ckpt = torch.load(path, weights_only=True)
    assert all(v.dtype == torch.float32 for v in ckpt["state_dict"].values())
    masters = dict(first.named_parameters())
    assert all(torch.equal(ckpt["state_dict"][k], masters[k]) for k in masters)  # fp32 master, not bf16 copy
    opt = torch.optim.AdamW(Classifier().parameters())
    opt_state = ckpt["optimizer_states"][0]
    assert len(opt_state["param_groups"]) == 2 and float(opt_state["state"][0]["step"]) == 20
    torch.optim.AdamW(
        [{"params": list(Classifier().parameters())[::2]}, {"params": list(Classifier().parameters())[1::2]}]
    ).load_state_dict(opt_state)
    del opt

    # LightningModule.load_from_checkpoint in a process that never imports lightning_zero_offload
    code = (
        "import sys, torch; from helpers import Classifier; "
        f"m = Classifier.load_from_checkpoint({str(path)!r}{', weights_only=True' if WEIGHTS_ONLY else ''}); "
        "assert 'lightning_zero_offload' not in sys.modules; "
        "print(float(sum(p.double().sum() for p in m.parameters())))"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}  # tests/: helpers
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = float(sum(p.detach().double().sum() for p in first.parameters()))
    assert float(out.stdout.strip().splitlines()[-1]) == pytest.approx(expected, rel=1e-12)


def test_manual_optimization_matches_plain_lightning():
    class Manual(Classifier):
        def __init__(self):
            super().__init__(scheduler=False)
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x).float(), y)
            self.losses.append(loss.item())
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.4, gradient_clip_algorithm="norm")
            opt.step()

    norms = GradNorms()  # the engine's norms (the plain run's .grad is clipped by then)
    ref, _ = fit("auto", model=Manual(), max_steps=15)
    ours, _ = fit("zero_offload", model=Manual(), max_steps=15, callbacks=[norms])
    assert_clipping_triggered(norms.norms, 0.4, at_least=2)
    assert_params_close(ref, ours, rtol=1e-5, atol=1e-6)


def test_validate_test_predict_after_fit_and_fit_again():
    model = Classifier()
    trainer = L.Trainer(strategy="zero_offload", precision="bf16-mixed", max_steps=10, **QUIET)
    trainer.fit(model, loader(), loader(32))
    trained = [p.detach().clone() for p in model.parameters()]
    val = trainer.validate(model, loader(32), verbose=False)[0]["val_loss"]
    test = trainer.test(model, loader(32), verbose=False)[0]["test_loss"]
    assert val == pytest.approx(test)
    preds = trainer.predict(model, loader(32))
    assert torch.cat(preds).shape == (32,)
    assert all(torch.equal(a, p) for a, p in zip(trained, model.parameters()))  # evaluation changed nothing
    trainer2 = L.Trainer(strategy="zero_offload", precision="bf16-mixed", max_steps=10, **QUIET)
    trainer2.fit(model, loader())  # no stale engine, hooks or flat buffers from the first fit
    assert not all(torch.equal(a, p) for a, p in zip(trained, model.parameters()))
    assert len(model.losses) == 20


def test_learning_rate_monitor_sees_the_scheduler():
    monitor_ref, monitor = LearningRateMonitor(), LearningRateMonitor()
    log = {"logger": CSVLogger("/tmp/unused-lzo-logs"), "log_every_n_steps": 1}
    fit("auto", max_steps=12, callbacks=[monitor_ref], **log)
    fit("zero_offload", max_steps=12, callbacks=[monitor], **log)
    assert monitor.lrs == monitor_ref.lrs
    assert monitor.lrs["lr-AdamW/pg1"][-1] == pytest.approx(1e-2 * 0.7**2)


def test_frozen_params_stay_on_device_untouched():
    model = Classifier()
    model.net[0].requires_grad_(False)
    frozen = [p.detach().clone() for p in model.net[0].parameters()]
    fit(model=model, precision="bf16-mixed", max_steps=5)
    assert all(torch.equal(a, p) and p.dtype == torch.float32 for a, p in zip(frozen, model.net[0].parameters()))


def test_strategy_string_coerces_the_precision_plugin():
    trainer = L.Trainer(strategy="zero_offload", precision="bf16-mixed", **QUIET)
    assert isinstance(trainer.precision_plugin, ZeroOffloadPrecision)
    assert trainer.precision_plugin.param_dtype == torch.bfloat16
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(bucket_size_mb=1), precision="32-true", **QUIET)
    assert trainer.strategy.options.bucket_size_mb == 1
    assert trainer.precision_plugin.param_dtype == torch.float32


@pytest.mark.parametrize(
    ("precision", "alternative"), [("bf16-true", "bf16-mixed"), ("16-true", "16-mixed"), ("64-true", "32-true")]
)
def test_unsupported_precision_names_the_alternative(precision, alternative):
    with pytest.raises(ValueError, match=f"precision='{alternative}'"):
        L.Trainer(strategy="zero_offload", precision=precision, **QUIET)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_size_mb": 0}, "bucket_size_mb"),
        ({"cpu_threads": 0}, "cpu_threads"),
        ({"dpu_warmup_steps": -1}, "dpu_warmup_steps"),
        ({"checkpoint_format": "zip"}, "checkpoint_format"),
        ({"loss_scale_backoff_factor": 2.0}, "loss_scale_backoff_factor"),
    ],
)
def test_invalid_strategy_options_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ZeroOffloadStrategy(**kwargs)


class _SGD(Classifier):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _TwoOptimizers(Classifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net[0].parameters()), torch.optim.AdamW(self.net[2].parameters())


@pytest.mark.parametrize(
    ("model", "error", "message"),
    [
        (_SGD, TypeError, "cannot run SGD. Use torch.optim.AdamW"),
        (_TwoOptimizers, ValueError, "exactly one optimizer"),
    ],
)
def test_unsupported_optimizer_setups_fail_clearly(model, error, message):
    with pytest.raises(error, match=message):
        fit(model=model(), max_steps=1)


@pytest.mark.slow  # Trainer runs of several epochs
@pytest.mark.parametrize("prediction", [False, True], ids=["stale", "predicted"])
def test_delayed_param_update_resumes_bitwise(tmp_path, prediction):
    def dpu():
        return ZeroOffloadStrategy(cpu_step="delayed", dpu_warmup_steps=5, dpu_weight_prediction=prediction)

    clip = 0.5  # the norms run 0.3-0.8 here: clipped steps on both sides of the save
    common = {"precision": "bf16-mixed", "gradient_clip_val": clip, "max_steps": -1}
    norms = GradNorms()
    full, _ = fit(dpu(), max_epochs=2, callbacks=[norms], **common)
    assert_clipping_triggered(norms.norms[:20], clip)
    assert_clipping_triggered(norms.norms[20:], clip)
    sync, _ = fit("zero_offload", max_epochs=2, **common)
    assert full.losses[:6] == sync.losses[:6]  # warm-up steps (and the first delayed one) are synchronous
    assert full.losses[6:] != sync.losses[6:]  # afterwards the forward pass uses one-step-stale weights

    _, trainer = fit(dpu(), max_epochs=1, **common)
    trainer.save_checkpoint(tmp_path / "dpu.ckpt")  # an update is pending here: its stale weights are saved
    state = torch.load(tmp_path / "dpu.ckpt", weights_only=True)[ENGINE_STATE_KEY]
    assert state["step_calls"] == 20 and "pending" in state["schedule"]
    assert ("next_params" in state["schedule"]["pending"]) == prediction
    resumed = Classifier()
    L.Trainer(strategy=dpu(), max_epochs=2, gradient_clip_val=clip, **{**QUIET, "precision": "bf16-mixed"}).fit(
        resumed, loader(), ckpt_path=tmp_path / "dpu.ckpt", **WEIGHTS_ONLY
    )
    assert resumed.losses == full.losses[20:]
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))


def _resumable_loader(n: int = 160) -> ResumableLoader:
    """loader()'s batches from a loader Lightning resumes mid-epoch (a plain one restarts the epoch)."""
    return ResumableLoader(loader(n).dataset, batch_size=8)


# Each: the precision, weight prediction, the checkpoint, Trainer arguments, the step it is written at.
VALIDATION_CHECKPOINTS = {
    # The last batch of an epoch (20 batches), then the epoch-end validation: the case filed.
    "epoch-end-32-true": ("32-true", False, {"every_n_train_steps": 20}, {}, 20),
    "epoch-end-bf16": ("bf16-mixed", False, {"every_n_train_steps": 20}, {}, 20),
    # Written at the end of the validation, monitoring its metric.
    "validation-end-predicted": (
        "bf16-mixed",
        True,
        {"monitor": "val_loss", "save_on_train_epoch_end": False},
        {},
        20,
    ),
    # Mid-epoch, right before a validation that runs between the two micro-batches of step 6.
    "accumulating-predicted": (
        "bf16-mixed",
        True,
        {"every_n_train_steps": 5},
        {"accumulate_grad_batches": 2, "val_check_interval": 11},
        5,
    ),
}


@pytest.mark.slow  # Trainer runs of several epochs
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")  # Lightning's own use of torch's pytree
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty")  # the resumed run saves there
@pytest.mark.parametrize("case", VALIDATION_CHECKPOINTS)
def test_delayed_update_resumes_bitwise_from_checkpoints_next_to_validation(tmp_path, case):
    """Validation inside fit sees the latest weights and changes nothing in training, so a run resumed from
    a checkpoint written before, during or after a validation (which the resumed run does not repeat)
    trains as the uninterrupted run and as a run without validation (it used to differ)."""
    precision, prediction, checkpoint, trainer_kwargs, saved_at = VALIDATION_CHECKPOINTS[case]
    max_steps = 30

    def run(steps, callbacks=(), ckpt_path=None, validate=True):
        strategy = ZeroOffloadStrategy(
            cpu_step="delayed", dpu_warmup_steps=2, dpu_weight_prediction=prediction, in_place_on_cpu=False
        )
        model = Classifier()
        kwargs = {**QUIET, **trainer_kwargs, "enable_checkpointing": bool(callbacks), "max_steps": steps}
        trainer = L.Trainer(
            strategy=strategy,
            precision=precision,
            callbacks=list(callbacks),
            limit_val_batches=1.0 if validate else 0,
            num_sanity_val_steps=0,
            default_root_dir=tmp_path,
            **kwargs,
        )
        extra = {"ckpt_path": ckpt_path, **WEIGHTS_ONLY} if ckpt_path else {}
        # The offload path in 32-true is what the issue ran; it warns that bf16-mixed would save device memory.
        fp32 = pytest.warns(UserWarning, match="training in '32-true'") if precision == "32-true" else nullcontext()
        with fp32:
            trainer.fit(model, _resumable_loader(), loader(32, seed=2), **extra)
        return model

    def checkpoints():  # the resumed run gets the callback too (Lightning asks for it) and saves again
        return [ModelCheckpoint(dirpath=tmp_path, filename="saved", **checkpoint)]

    full = run(max_steps)
    run(saved_at, checkpoints())
    state = torch.load(tmp_path / "saved.ckpt", weights_only=True)
    assert state["global_step"] == saved_at and "pending" in state[ENGINE_STATE_KEY]["schedule"]
    resumed = run(max_steps, checkpoints(), ckpt_path=tmp_path / "saved.ckpt")
    assert resumed.losses == full.losses[len(full.losses) - len(resumed.losses) :]
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))
    without_validation = run(max_steps, validate=False)
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), without_validation.parameters()))


class _Sparse(Classifier):
    def __init__(self):
        super().__init__(scheduler=False)
        self.emb = torch.nn.Embedding(10, 16, sparse=True)

    def forward(self, x):
        return self.net(x + self.emb(torch.zeros(len(x), dtype=torch.long)))


class _ForeignParams(Classifier):
    def configure_optimizers(self):
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])


@pytest.mark.parametrize(
    ("model", "trainer_kwargs", "error", "message"),
    [
        (_Sparse, {}, RuntimeError, r"sparse gradients \(nn.Embedding\(sparse=True\)\)"),
        (_ForeignParams, {}, ValueError, r"build the optimizer from .*self\.parameters\(\)"),
        (Classifier, {"sync_batchnorm": True}, ValueError, "sync_batchnorm"),
    ],
)
def test_unsupported_model_setups_fail_clearly(model, trainer_kwargs, error, message):
    with pytest.raises(error, match=message):
        fit(model=model(), max_steps=1, **trainer_kwargs)


def test_optimizer_step_outside_fit_and_mismatched_optimizer_state_fail_clearly():
    plugin = ZeroOffloadPrecision("bf16-mixed")
    with pytest.raises(RuntimeError, match="only possible during fit"):
        plugin.optimizer_step(None, Classifier(), lambda: None)
    model, trainer = fit(max_steps=2)
    state = trainer.strategy.session.optimizer_state_to_save()
    state["param_groups"] = state["param_groups"][:1]
    with pytest.raises(ValueError, match="different number of param groups"):
        trainer.strategy.session.load_optimizer_state(state)


@pytest.mark.slow  # Trainer runs of several epochs
def test_dpu_through_the_trainer_matches_the_delayed_reference():
    """Two param groups, a step LR scheduler and clipping, against a hand-written one-step-delayed loop."""
    warmup, steps, clip = 4, 20, 0.5  # the norms run 0.3-0.8 here
    reference = Classifier()
    device_copy = copy.deepcopy(reference)
    config = reference.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    pending, ref_norms = None, []
    for t, (x, y) in enumerate(loader(), start=1):
        if t > steps:
            break
        torch.nn.functional.cross_entropy(device_copy(x), y).backward()
        for p_master, p_dev in zip(reference.parameters(), device_copy.parameters()):
            p_master.grad, p_dev.grad = p_dev.grad, None
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
        if t <= warmup:
            opt.step()
            device_copy.load_state_dict(reference.state_dict())
        else:
            if pending is not None:
                device_copy.load_state_dict(pending)
            opt.step()
            pending = copy.deepcopy(reference.state_dict())
        opt.zero_grad()
        sched.step()

    strategy = ZeroOffloadStrategy(cpu_step="delayed", dpu_warmup_steps=warmup)
    norms = GradNorms()
    ours, _ = fit(strategy, max_steps=steps, gradient_clip_val=clip, callbacks=[norms])
    assert_clipping_triggered(ref_norms[warmup:], clip)  # clipped and unclipped delayed steps
    # observed 5e-8 relative (fp32 sums in another order), margin 20x
    assert norms.norms == pytest.approx(ref_norms, rel=1e-6)
    assert_params_close(reference, ours, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # Trainer runs of several epochs
@pytest.mark.parametrize("clip", [100.0, 0.3], ids=["clip-not-triggered", "clip-triggers-sometimes"])
def test_speculative_step_through_the_trainer_is_bitwise_sync(clip):
    """The precision plugin announces the window-ending backward; accumulation, groups, scheduler, clipping."""
    common = {"precision": "bf16-mixed", "gradient_clip_val": clip, "accumulate_grad_batches": 2, "max_steps": 10}
    sync, _ = fit(ZeroOffloadStrategy(cpu_step="sync", bucket_size_mb=0.002), **common)
    strategy = ZeroOffloadStrategy(
        cpu_step="speculative", speculation_rollback="snapshot", overlap=True, bucket_size_mb=0.002
    )
    spec, trainer = fit(strategy, **common)
    assert spec.losses == sync.losses
    assert all(torch.equal(p, q) for p, q in zip(sync.parameters(), spec.parameters()))
    assert (trainer.strategy.session.rollbacks > 0) == (clip < 1)  # the triggered steps were rolled back and redone
    assert clip < 1 or trainer.strategy.last_step_stats.speculated_fraction > 0  # else they ran during backward


@pytest.mark.slow  # Trainer runs of several epochs
def test_32_true_on_a_cpu_runs_in_place_bitwise_the_offload_path():
    """The CPU device's default skips the offload copies; forcing them back changes no bit."""
    clip = 0.4  # the norms run 0.25-0.6 here: clipped and unclipped steps
    common = {"gradient_clip_val": clip, "accumulate_grad_batches": 2, "max_steps": 12}
    norms = GradNorms()
    in_place, trainer = fit("zero_offload", callbacks=[norms], **common)
    assert_clipping_triggered(norms.norms, clip, at_least=2)
    offload, offload_trainer = fit(ZeroOffloadStrategy(in_place_on_cpu=False), **common)
    assert trainer.strategy.session.resolved.in_place and not offload_trainer.strategy.session.resolved.in_place
    assert in_place.losses == offload.losses
    for p, q in zip(in_place.parameters(), offload.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="in_place_on_cpu=True needs.*bfloat16"):
        fit(ZeroOffloadStrategy(in_place_on_cpu=True), precision="bf16-mixed", max_steps=1)
