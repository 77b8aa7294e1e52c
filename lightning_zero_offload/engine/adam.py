"""Which user optimizers the engine can run, and their hyperparameters read live from ``param_groups``.

The engine never calls the user's optimizer: it keeps it for its ``param_groups`` (which LR
schedulers and LearningRateMonitor use) and runs the same Adam math on the CPU shard instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lightning_zero_offload.optim import CPUAdam

SUPPORTED = "torch.optim.AdamW, torch.optim.Adam or lightning_zero_offload.CPUAdam"


@dataclass(frozen=True)
class AdamHyperparams:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    maximize: bool


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise a clear error for optimizers the CPU step cannot reproduce exactly."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "zero_offload cannot run LBFGS: it re-evaluates the closure several times per step, while the "
            f"offloaded step runs once on the CPU. Use {SUPPORTED}."
        )
    if not isinstance(optimizer, (torch.optim.Adam, CPUAdam)):
        raise TypeError(
            f"zero_offload runs Adam-family updates in its CPU kernel and cannot run "
            f"{type(optimizer).__name__}. Return {SUPPORTED} from configure_optimizers."
        )
    for index, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad", False):
            raise ValueError(f"param_groups[{index}] sets amsgrad=True, which zero_offload does not support")
        read_hyperparams(optimizer, group)


def read_hyperparams(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> AdamHyperparams:
    if isinstance(optimizer, CPUAdam):
        adamw_mode = bool(group["adamw_mode"])
    else:
        # AdamW subclasses Adam in recent torch: the group flag, not isinstance, says which decay runs.
        adamw_mode = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    beta1, beta2 = (float(b) for b in group["betas"])
    hp = AdamHyperparams(
        lr=float(group["lr"]),
        beta1=beta1,
        beta2=beta2,
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        adamw_mode=adamw_mode,
        maximize=bool(group.get("maximize", False)),
    )
    if not (math.isfinite(hp.lr) and hp.lr >= 0):
        raise ValueError(f"learning rate must be a finite number >= 0, got {hp.lr}")
    if not (0 <= hp.beta1 < 1 and 0 <= hp.beta2 < 1):
        raise ValueError(f"betas must be in [0, 1), got {(hp.beta1, hp.beta2)}")
    if not hp.eps > 0:
        raise ValueError(f"eps must be > 0, got {hp.eps}")
    return hp
