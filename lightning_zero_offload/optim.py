"""CPUAdam: the native Adam/AdamW kernel as a drop-in ``torch.optim.Optimizer``.

Why it exists: the offload engine calls :mod:`lightning_zero_offload.kernels` directly on its flat
fp32 master buffers and never steps an optimizer object. CPUAdam is the user-facing face of the same
kernel: a replacement for ``torch.optim.AdamW``/``Adam`` on CPU fp32 params (CPU training, or the
optimizer returned from ``configure_optimizers`` whose hyperparameters the engine reads), with the
same update, the same ``param_groups`` semantics (LR schedulers work) and the same state_dict
format, so checkpoints move between CPUAdam and torch in both directions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero_offload import kernels

__all__ = ["CPUAdam"]

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


class CPUAdam(Optimizer):
    """Adam (``adamw_mode=False``: L2 penalty added to the gradient) or AdamW (decoupled weight decay).

    Matches ``torch.optim.AdamW``/``Adam`` (without amsgrad) to fp32 rounding: params whose ``.grad``
    is None are skipped entirely, hyperparameters are read from ``param_groups`` at every step, each
    param keeps its own ``step`` count, and ``state_dict()`` is torch's Adam format (``step`` as a
    float32 0-dim tensor, ``exp_avg``, ``exp_avg_sq``). Each param group is updated by ONE native
    call over all its tensors, so many small tensors cost little. Params must be contiguous fp32 CPU
    tensors with fp32 gradients. Threads: :func:`lightning_zero_offload.kernels.set_num_threads`.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        maximize: bool = False,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("CPUAdam does not implement AMSGrad; use torch.optim.AdamW(amsgrad=True) instead")
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "adamw_mode": adamw_mode,
            "maximize": maximize,
        }
        _kernel_args(defaults)  # bad values fail here, not at the first step
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Also accepts torch Adam/AdamW state: their ``decoupled_weight_decay`` becomes ``adamw_mode``."""
        super().__setstate__(state)
        for index, group in enumerate(self.param_groups):
            if group.get("amsgrad", False):
                raise ValueError(
                    f"param_groups[{index}] was saved with amsgrad=True, which CPUAdam does not implement; "
                    "load it into torch.optim.AdamW(amsgrad=True)"
                )
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))
            group.setdefault("maximize", False)
        for param_state in self.state.values():
            step = param_state.get("step")
            # torch < 1.12 saved Python numbers; capturable/fused optimizers may leave other devices
            if step is not None and not (torch.is_tensor(step) and step.is_cpu and step.dtype is torch.float32):
                param_state["step"] = torch.tensor(float(step), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One update of every param that has a gradient; ``closure`` (re)computes the loss, as in torch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            if group.get("amsgrad", False):  # switched on after construction, where __init__ refuses it
                raise ValueError(
                    f"param_groups[{index}] sets amsgrad=True, which CPUAdam does not implement; set it back to "
                    "False or use torch.optim.AdamW(amsgrad=True)"
                )
            params, grads, exp_avgs, exp_avg_sqs, steps = self._gather(index, group)
            if not params:
                continue
            # also increments the step counters
            kernels.adam_step_multi(params, grads, exp_avgs, exp_avg_sqs, steps, hparams=_kernel_args(group))
            # The kernel writes through raw pointers: tell autograd the params changed, as an
            # in-place torch op would, so stale saved tensors are detected instead of reused.
            torch.autograd.graph.increment_version(params)
        return loss

    def _gather(
        self, index: int, group: dict[str, Any]
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
        """The group's params that have a gradient, with their state (created lazily, like torch)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if param.dtype is not torch.float32 or grad.dtype is not torch.float32:
                raise TypeError(
                    "CPUAdam updates float32 params with float32 gradients; "
                    f"param_groups[{index}] has a {param.dtype} param with a {grad.dtype} gradient. "
                    "Keep fp32 weights (mixed precision keeps fp32 masters) or use a torch optimizer"
                )
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
            params.append(param)
            grads.append(grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        return params, grads, exp_avgs, exp_avg_sqs, steps


def _kernel_args(group: dict[str, Any]) -> kernels.AdamArgs:
    """The kernel's record of one of CPUAdam's param groups, read as it is now (LR schedulers change it).

    ``float()`` first, so a tensor learning rate (which torch allows) is read as its value.
    """
    beta1, beta2 = group["betas"]
    numbers = (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))
    return kernels.AdamArgs(*numbers, adamw_mode=bool(group["adamw_mode"]), maximize=group.get("maximize", False))
