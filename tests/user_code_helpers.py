"""Users' code during fit (callbacks that write the weights, unfreezing, a backbone, a two-loss module) and
users' optimizers (a subclass, step hooks): the cases tests/trainer/test_user_code.py and
test_user_optimizers.py run at one rank and tests/workers/user_code.py at two."""

from __future__ import annotations

import copy
from collections.abc import Callable

import lightning as L
import torch
from helpers import Classifier
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_zero_offload  # noqa: F401  (registers "zero_offload")

CLAMP = 0.05


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


class Backbone(L.LightningModule):
    """A backbone and a head; the backbone starts frozen (BackboneFinetuning's setting)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).float(), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)


class BlockBackbone(Backbone):
    """:class:`Backbone` with a backbone of identical blocks, which offload_params=True shards one by one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(16, 32)
        self.backbone = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)])

    def forward(self, x):
        return self.head(self.backbone(self.stem(x)))


class UnfreezeAt(L.Callback):
    """``requires_grad_(True)`` on the frozen backbone at a step; with ``add_group`` also a param group for it."""

    def __init__(self, step: int, add_group: bool) -> None:
        self.step, self.add_group = step, add_group

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        pl_module.backbone.requires_grad_(True)
        if self.add_group:
            trainer.optimizers[0].add_param_group({"params": list(pl_module.backbone.parameters()), "lr": 3e-3})


def frozen_backbone() -> Backbone:
    model = Backbone()
    model.backbone.requires_grad_(False)
    return model


class UnusedAndTwoLosses(Classifier):
    """A layer that never gets a gradient, and two backward calls per step in manual optimization."""

    def __init__(self, manual: bool) -> None:
        super().__init__(scheduler=False, lr=3e-2)
        self.unused = nn.Linear(4, 4)
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        self.manual_backward(nn.functional.cross_entropy(self(x[:4]).float(), y[:4]))
        self.manual_backward(nn.functional.cross_entropy(self(x[4:]).float(), y[4:]))
        opt.step()


class AdamWWithDefaults(torch.optim.AdamW):
    """Overrides only __init__: the update is AdamW's own."""

    def __init__(self, params) -> None:
        super().__init__(params, lr=2e-2, weight_decay=0.05)


class Tiny(L.LightningModule):
    """An MLP regressor; ``extra`` adds one parameter of the kind under test, used by ``forward``."""

    def __init__(self, optimizer: Callable = lambda ps: torch.optim.AdamW(ps, lr=1e-2), extra: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.make_optimizer = optimizer
        self.extra = extra
        if extra == "complex":
            self.z = nn.Parameter(torch.randn(4, dtype=torch.cfloat))
        elif extra == "real-view":  # the parameterisation the complex refusal recommends
            self.z = nn.Parameter(torch.view_as_real(torch.randn(4, dtype=torch.cfloat)).clone())
        elif extra == "float64":
            self.head = nn.Linear(8, 1).double()
        elif extra == "expanded":
            self.rows = nn.Parameter(torch.randn(1, 8).expand(3, 8))

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x).float()[:, 0]
        if self.extra in ("complex", "real-view"):
            z = self.z if self.extra == "complex" else torch.complex(self.z[..., 0].float(), self.z[..., 1].float())
            pred = pred + (x[:, :4] * z).real.sum(-1)
        elif self.extra == "float64":
            pred = pred + self.head(x.double())[:, 0].float()
        elif self.extra == "expanded":
            pred = pred + (x @ self.rows.t()).sum(-1)
        return nn.functional.mse_loss(pred, y)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def data(n: int = 40) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :3].sum(-1)), batch_size=8)


class HookedTiny(Tiny):
    """Registers per-optimizer step hooks in configure_optimizers; the pre-hook also warms the LR up."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.hook_optimizers: list[torch.optim.Optimizer] = []

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        self.optimizer_made = optimizer

        def pre(opt, args, kwargs):
            self.calls.append("pre")
            self.hook_optimizers.append(opt)
            opt.param_groups[0]["lr"] = 5e-3 * (1 + len(self.hook_optimizers))

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self.calls.append("post"))
        return optimizer
