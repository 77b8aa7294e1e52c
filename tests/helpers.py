"""Small models and data shared by the Trainer-level tests. Imports no lightning_zero_offload code, so a
checkpoint can be loaded with it in a process where the package was never imported."""

from __future__ import annotations

import inspect

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# Lightning 2.6 added `weights_only` to Trainer.fit and load_from_checkpoint; 2.5 (make test-oldest) has neither
# and loads with torch's default, which is weights_only=True on torch >= 2.6.
WEIGHTS_ONLY = {"weights_only": True} if "weights_only" in inspect.signature(L.Trainer.fit).parameters else {}

QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "accelerator": "cpu",
    "devices": 1,
}


class Classifier(L.LightningModule):
    """An MLP classifier with two param groups (with/without weight decay) and a step LR scheduler."""

    def __init__(self, width: int = 32, lr: float = 1e-2, scheduler: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4)
        )
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x).float(), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).float().argmax(-1)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": 0.05},
                {"params": no_decay, "weight_decay": 0.0, "lr": self.hparams.lr / 2},
            ],
            lr=self.hparams.lr,
        )
        if not self.hparams.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(n: int = 160, batch_size: int = 8, seed: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(-1) + (x[:, 4] > 1).long()) % 4  # learnable labels
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)
