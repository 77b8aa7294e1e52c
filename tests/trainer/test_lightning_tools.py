"""Lightning's own tools that drive fit, against ``strategy="auto"``: the tuner (``lr_find`` and
``scale_batch_size`` save a checkpoint, train on, and restore it before the real fit), callbacks that change the
loop as it runs (``GradientAccumulationScheduler``), a scheduler stepped on a monitored metric and a module's own
``lr_scheduler_step``.

Tolerance: the engine's fp32 step is torch's AdamW to within rounding (observed <= 2.2e-7 on these runs); a step
taken with the wrong learning rate or accumulation, or a tuner run left in the weights, is >= 1e-3 off.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import QUIET, assert_same_weights
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from user_code_helpers import BlockBackbone

from lightning_zero_offload import ZeroOffloadStrategy

ATOL = 1e-6

pytestmark = [
    pytest.mark.slow,  # Trainer runs of the tuner (10 s in all): the fast tier stays within its 3 minutes
    pytest.mark.usefixtures("own_process_group"),  # conftest.py: offload_params' group ends with the test
]

MODES = [
    pytest.param(dict(in_place_on_cpu=False, cpu_step="speculative"), id="offload-speculative"),
    pytest.param(dict(offload_params=True, checkpoint_format="sharded"), id="params-sharded"),
]


def rows() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 16, generator=generator), torch.randint(0, 4, (64,), generator=generator))


class Tunable(BlockBackbone):
    """A learning rate and a batch size the tuner sets, its own data, a validation loss to monitor."""

    def __init__(self, lr: float = 1e-2, batch_size: int = 8) -> None:
        super().__init__()
        self.lr, self.batch_size = lr, batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(rows(), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(rows(), batch_size=32)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class OnPlateau(Tunable):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.3)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


class HalveEvery:
    """A scheduler not of torch's (as timm's): Lightning steps it through the module's ``lr_scheduler_step``."""

    def __init__(self, optimizer: torch.optim.Optimizer, steps: int) -> None:
        self.optimizer, self.steps = optimizer, steps

    def step(self, global_step: int) -> None:
        if global_step % self.steps == 0:
            for group in self.optimizer.param_groups:
                group["lr"] /= 2

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]


class OwnSchedulerStep(Tunable):
    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": HalveEvery(optimizer, 5), "interval": "step"}}

    def lr_scheduler_step(self, scheduler, metric):
        scheduler.step(self.global_step)


def found_lr_then_fit(strategy) -> tuple[L.LightningModule, float]:
    model = Tunable()
    trainer = L.Trainer(strategy=strategy, max_epochs=2, **QUIET)
    found = Tuner(trainer).lr_find(model, min_lr=1e-4, max_lr=1e-1, num_training=20).suggestion(skip_begin=2)
    model.lr = found
    trainer.fit(model)
    return model, found


def found_batch_size_then_fit(strategy) -> tuple[L.LightningModule, int]:
    model = Tunable(batch_size=2)
    trainer = L.Trainer(strategy=strategy, max_epochs=2, **QUIET)
    found = Tuner(trainer).scale_batch_size(model, mode="power", max_trials=2, steps_per_trial=2)
    trainer.fit(model)
    return model, found


def fit(model_class, **trainer_kwargs):
    def run(strategy) -> tuple[L.LightningModule, int]:
        model = model_class()
        trainer = L.Trainer(strategy=strategy, **{**QUIET, **trainer_kwargs})
        trainer.fit(model)
        return model, trainer.global_step

    return run


CASES = {
    "lr-find": found_lr_then_fit,
    "scale-batch-size": found_batch_size_then_fit,
    "accumulation-scheduler": fit(Tunable, max_epochs=3, callbacks=[GradientAccumulationScheduler({0: 1, 1: 3, 2: 2})]),
    "reduce-on-plateau": fit(OnPlateau, max_epochs=4),
    "own-lr-scheduler-step": fit(OwnSchedulerStep, max_epochs=2),
}


@pytest.mark.parametrize("options", MODES)
@pytest.mark.parametrize("case", CASES)
def test_lightnings_tuner_and_loop_callbacks_train_as_under_auto(case, options, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the tuner writes its checkpoint to the working directory
    reference, found = CASES[case]("auto")
    ours, ours_found = CASES[case](ZeroOffloadStrategy(**options))
    assert ours_found == found  # the learning rate or batch size found, or the optimizer steps taken
    assert_same_weights(ours, reference, ATOL)
    assert list(tmp_path.iterdir()) == []  # the tuner's checkpoint removed, a sharded one's directory too
