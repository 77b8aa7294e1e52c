"""Small models and data shared by the Trainer-level tests. Imports no lightning_zero_offload code, so a
checkpoint can be loaded with it in a process where the package was never imported."""

from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path
from types import ModuleType

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# Lightning 2.6 added `weights_only` to Trainer.fit and load_from_checkpoint; 2.5 (make test-oldest) has neither
# and loads with torch's default, which is weights_only=True on torch >= 2.6.
WEIGHTS_ONLY = {"weights_only": True} if "weights_only" in inspect.signature(L.Trainer.fit).parameters else {}

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (the directory is scripts, not a package), registered under its name
    (a dataclass looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def assert_same_weights(ours: nn.Module, reference: nn.Module, atol: float) -> None:
    """Parameter by parameter (compared in fp32, whole: a DTensor of offload_params gathered), naming the first that
    differs by more than ``atol``."""
    for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
        a, b = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (a, b))
        torch.testing.assert_close(
            a.detach().float(), b.detach().float(), rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


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


class GradNorms(L.Callback):
    """Each optimizer step's global gradient norm before clipping, and its largest gradient element.

    Under zero_offload the gradients never stay on the parameters: the norm is the one the engine
    computed and clipped with (``strategy.last_step_stats.grad_norm``; no element maximum). Under plain strategies
    (``"auto"``, ``"ddp"``) it is computed from ``p.grad`` in ``on_before_optimizer_step``, which runs
    after the gradients are unscaled and averaged and before Lightning clips them (automatic
    optimization only: in manual optimization the user clips before ``opt.step()``).
    """

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.max_abs: list[float] = []
        self._step_calls = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        session = getattr(trainer.strategy, "session", None)
        self._step_calls = session.step_calls if session is not None else 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if getattr(trainer.strategy, "session", None) is not None:
            return
        grads = [p.grad.detach().double() for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.cat([g.flatten() for g in grads]).norm()))
        self.max_abs.append(float(max(g.abs().max() for g in grads)))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        session = getattr(trainer.strategy, "session", None)
        if session is None or session.step_calls == self._step_calls:
            return  # a plain strategy, or no optimizer step in this batch (gradient accumulation)
        self._step_calls = session.step_calls
        self.norms.append(trainer.strategy.last_step_stats.grad_norm)


def assert_clipping_triggered(norms: list[float], clip: float, at_least: int = 3) -> None:
    """The clip must both act and not act: some steps above it, some below (else the test is no test)."""
    above = sum(n > clip for n in norms)
    assert at_least <= above <= len(norms) - at_least, f"{above} of {len(norms)} norms above {clip}: {norms}"


def loader(n: int = 160, batch_size: int = 8, seed: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].argmax(-1) + (x[:, 4] > 1).long()) % 4  # learnable labels
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


# Multi-process Trainer runs (tests/trainer/test_distributed.py, test_offload_params_distributed.py).
TRAIN_SCENARIO = Path(__file__).parent / "workers" / "train.py"


def train_in_ranks(tmp: Path, devices: int, runs: dict[str, dict]) -> dict[str, dict]:
    """Train ``runs`` (name: options, as tests/workers/train.py takes them) one after another in one launch
    of ``devices`` ranks; what rank 0 wrote for each, by name."""
    specs = [
        {**{k: str(v) if isinstance(v, Path) else v for k, v in run.items()}, "out": str(tmp / f"{name}.pt")}
        for name, run in runs.items()
    ]
    # Imported here: tests/checkpoints/test_save_memory.py imports this module with the package stubbed out.
    from lightning_zero_offload.testing.ranks import launch

    listing = tmp / f"{next(iter(runs))}.runs.json"
    listing.write_text(json.dumps(specs))
    launch(
        [sys.executable, str(TRAIN_SCENARIO), "--devices", str(devices), "--runs", str(listing)], 300 + 60 * len(runs)
    )
    return {name: torch.load(tmp / f"{name}.pt", weights_only=True) for name in runs}


class CausalLM(L.LightningModule):
    """A Hugging Face causal LM in ``self.model`` (the subclass builds it), trained on its batches' tokens with
    AdamW: the Llamas the meta-device, parameter-offload and device-share Trainer tests fit."""

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class BlockRegression(L.LightningModule):
    """Residual MLP blocks regressing a random target, two param groups and a step scheduler: the models the
    meta-device and parameter-offload Trainer tests compare with their eager twin."""

    def __init__(self) -> None:
        from offload_params_helpers import Blocks  # here: helpers is imported where the package must not be

        super().__init__()
        torch.manual_seed(0)
        self.model = Blocks()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.model(x).float() - y) ** 2).mean()

    def configure_optimizers(self):
        from offload_params_helpers import two_groups

        optimizer = torch.optim.AdamW(two_groups(self.model))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class BlockRegressionInConfigureModel(BlockRegression):
    """The same model built in configure_model (on the meta device under zero_offload), with the random numbers
    the eager build draws."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.model = None

    def configure_model(self) -> None:
        from offload_params_helpers import Blocks

        if self.model is None:
            torch.manual_seed(0)
            self.model = Blocks()


def block_data(samples: int) -> DataLoader:
    """BlockRegression's batches of 8: ``samples`` inputs of width 8 and targets, from seed 1."""
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(samples, 8, generator=generator), torch.randn(samples, 1, generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=8)
