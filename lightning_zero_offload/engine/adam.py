"""Which user optimizers the engine can run, and their hyperparameters read live from ``param_groups``.

The engine never calls the user's optimizer: it keeps it for its ``param_groups`` (which LR
schedulers and LearningRateMonitor use) and runs the same Adam math on the CPU shard instead.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero_offload.kernels import AdamHyperparams
from lightning_zero_offload.optim import CPUAdam

__all__ = ["SUPPORTED", "AdamHyperparams", "check_optimizer", "read_hyperparams"]

SUPPORTED = "torch.optim.AdamW, torch.optim.Adam or lightning_zero_offload.CPUAdam"


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
        try:
            read_hyperparams(optimizer, group)
        except ValueError as err:
            raise ValueError(f"param_groups[{index}]: {err}") from None


def read_hyperparams(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> AdamHyperparams:
    """The validated hyperparameters of one of the optimizer's param groups, as they are now."""
    if isinstance(optimizer, CPUAdam):
        adamw_mode = bool(group["adamw_mode"])
    else:
        # AdamW subclasses Adam in recent torch: the group flag, not isinstance, says which decay runs.
        adamw_mode = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
    return AdamHyperparams.from_param_group(group, adamw_mode)
