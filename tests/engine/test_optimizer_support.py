"""engine.adam: which optimizers the engine runs, and their hyperparameters read as the kernels' record."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.optimizer_support import (
    adam_args,
    check_optimizer,
    overridden_update_methods,
    read_hyperparams,
)
from lightning_zero_offload.engine.step.update import read_all_hyperparams
from lightning_zero_offload.optim import CPUAdam


@pytest.mark.parametrize(
    "make,adamw_mode",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1), True),
        (lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1), False),
        (
            lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, decoupled_weight_decay=True),
            True,
        ),
        (lambda ps: CPUAdam(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, adamw_mode=False), False),
    ],
    ids=["AdamW", "Adam", "Adam-decoupled", "CPUAdam-L2"],
)
def test_reads_the_kernels_record_with_the_optimizers_decay_mode(make, adamw_mode: bool) -> None:
    optimizer = make([torch.nn.Parameter(torch.zeros(2))])
    read = read_hyperparams(optimizer, optimizer.param_groups[0])
    assert read == kernels.AdamArgs(lr=0.01, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, adamw_mode=adamw_mode)


def test_the_record_is_checked_once_by_the_kernels_rules_and_converted() -> None:
    hp = kernels.AdamArgs(lr=1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0, adamw_mode=1)
    assert (type(hp.lr), type(hp.weight_decay), hp.adamw_mode, hp.maximize) == (float, float, True, False)
    group = {"lr": torch.tensor(0.01), "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1}  # no "maximize"
    assert adam_args(group, adamw_mode=True) == kernels.AdamArgs(
        lr=float(torch.tensor(0.01)), beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, adamw_mode=True
    )
    with pytest.raises(ValueError, match="lr must be >= 0"):
        adam_args({**group, "lr": -1.0}, adamw_mode=True)
    with pytest.raises(ValueError, match=r"beta1 must be in \[0, 1\)"):
        adam_args({**group, "betas": (1.0, 0.99)}, adamw_mode=True)
    with pytest.raises(TypeError, match="eps must be a real number, got str"):
        kernels.AdamArgs(lr=1e-3, beta1=0.9, beta2=0.99, eps="1e-8", weight_decay=0.0, adamw_mode=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        hp.lr = 2.0


def test_bad_group_is_named_and_rejected_like_the_kernel_would() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": float("nan")})
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr must be finite, got nan"):
        check_optimizer(optimizer)
    with pytest.raises(TypeError, match="cannot run SGD"):
        check_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))


def _param() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2))]


class PlainSubclass(torch.optim.AdamW):
    pass


class InitOnly(torch.optim.AdamW):
    def __init__(self, params, lr: float = 3e-3) -> None:
        super().__init__(params, lr=lr, weight_decay=0.0)


class Rewrapped(torch.optim.AdamW):
    # What torch stores on a subclass when its first instance is made before any AdamW's
    # (Optimizer._patch_step_function): AdamW's own step inside the hook wrapper, in the subclass's dict.
    step = torch.optim.Optimizer.profile_hook_step(torch.optim.AdamW.step)


class Grandchild(PlainSubclass):
    pass


class CPUAdamSubclass(CPUAdam):
    pass


@pytest.mark.parametrize("cls", [PlainSubclass, InitOnly, Rewrapped, Grandchild, CPUAdamSubclass])
def test_subclasses_that_leave_the_update_alone_are_accepted(cls) -> None:
    optimizer = cls(_param())
    check_optimizer(optimizer)
    assert overridden_update_methods(optimizer) == []
    # the reason a plain `"step" in vars(cls)` check would refuse it
    assert cls is not Rewrapped or "step" in vars(cls)


class GradientCentralizedAdamW(torch.optim.AdamW):
    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.dim() > 1:
                    p.grad.sub_(p.grad.mean(dim=tuple(range(1, p.grad.dim())), keepdim=True))
        return super().step(closure)


def _logged(step):
    @functools.wraps(step)
    def wrapper(*args, **kwargs):
        return step(*args, **kwargs)

    return wrapper


class DecoratedStep(torch.optim.AdamW):
    step = _logged(torch.optim.AdamW.step)  # a user's wrapper around AdamW's own step is an override too


class OwnInitGroup(torch.optim.Adam):
    def _init_group(self, *args, **kwargs):
        return super()._init_group(*args, **kwargs)


class CPUAdamOwnStep(CPUAdam):
    def step(self, closure=None):
        return super().step(closure)


@pytest.mark.parametrize(
    "cls,methods,base",
    [
        (GradientCentralizedAdamW, ["step"], "AdamW"),
        (DecoratedStep, ["step"], "AdamW"),
        (OwnInitGroup, ["_init_group"], "Adam"),
        (CPUAdamOwnStep, ["step"], "CPUAdam"),
    ],
)
def test_subclasses_that_override_the_update_are_refused_naming_the_class_and_the_fix(cls, methods, base) -> None:
    optimizer = cls(_param())
    assert overridden_update_methods(optimizer) == methods
    with pytest.raises(TypeError) as info:
        check_optimizer(optimizer)
    message = str(info.value)
    assert f"cannot run {cls.__module__}.{cls.__qualname__}: it overrides {methods[0]}()" in message
    assert f"{cls.__name__}'s step() would never run" in message
    assert f"silently train as a plain {base}" in message
    assert "torch.optim.AdamW" in message and "strategy='auto'" in message


@pytest.mark.parametrize(
    "key,value,why",
    [("amsgrad", True, "no running maximum of the second moments"), ("differentiable", True, "outside autograd")],
)
def test_keys_the_kernel_does_not_implement_are_refused_naming_the_group(key, value, why) -> None:
    optimizer = torch.optim.AdamW(_param())
    optimizer.add_param_group({"params": _param(), key: value})
    with pytest.raises(ValueError, match=rf"param_groups\[1\]: {key}=True is not supported: .*{why}.*{key}=False"):
        check_optimizer(optimizer)


def test_implementation_choices_and_unknown_keys_are_accepted() -> None:
    """foreach/fused/capturable pick torch's implementation of the same update; the kernel is its own."""
    optimizer = torch.optim.AdamW(_param(), foreach=True, maximize=True)
    optimizer.param_groups[0].update(fused=True, capturable=True, name="decay")  # "name": a user's tag
    check_optimizer(optimizer)
    assert read_hyperparams(optimizer, optimizer.param_groups[0]).maximize


def test_every_step_reads_the_groups_with_their_index_in_the_error() -> None:
    """read_all_hyperparams runs at every step: a key switched on mid-run is refused there, and a bad value
    names its group as check_optimizer's does at setup."""
    optimizer = torch.optim.AdamW(_param(), lr=0.01)
    optimizer.add_param_group({"params": _param()})
    assert [hp.lr for hp in read_all_hyperparams(optimizer)] == [0.01, 0.01]
    optimizer.param_groups[1]["amsgrad"] = True  # what a callback may do mid-run
    with pytest.raises(ValueError, match=r"^param_groups\[1\]: amsgrad=True is not supported"):
        read_all_hyperparams(optimizer)
    optimizer.param_groups[1]["amsgrad"] = False
    optimizer.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"^param_groups\[1\]: lr must be finite, got nan"):
        read_all_hyperparams(optimizer)
    optimizer.param_groups[1]["lr"] = None
    with pytest.raises(TypeError, match=r"^param_groups\[1\]: "):
        read_all_hyperparams(optimizer)


def test_cpuadam_refuses_amsgrad_switched_on_after_construction() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    optimizer = CPUAdam([p])
    p.grad = torch.ones(2)
    optimizer.step()
    optimizer.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match=r"param_groups\[0\] sets amsgrad=True, which CPUAdam does not implement"):
        optimizer.step()
