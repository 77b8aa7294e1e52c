"""Which user optimizers the engine can run, and their hyperparameters read live from ``param_groups``.

The engine never calls the user's optimizer: it keeps it for its ``param_groups`` (which LR
schedulers and LearningRateMonitor use) and runs the same Adam math on the CPU shard instead. So an
optimizer is accepted only if that math is what its own ``step()`` would do: torch's Adam/AdamW or
CPUAdam, or a subclass of them that leaves the update alone (a subclass that overrides ``step`` would
silently train as its base class).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.optim import Optimizer

from lightning_zero_offload import kernels
from lightning_zero_offload.optim import CPUAdam

__all__ = [
    "SUPPORTED",
    "adam_args",
    "check_optimizer",
    "optimizer_params",
    "overridden_update_methods",
    "read_hyperparams",
]


def optimizer_params(optimizer: Optimizer) -> list[torch.nn.Parameter]:
    """Every parameter of ``optimizer``, frozen ones too, in param-group order: numbered so in its state dict."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def adam_args(group: Mapping[str, Any], adamw_mode: bool) -> kernels.AdamArgs:
    """The kernels' checked hyperparameter record of a torch Adam/AdamW/CPUAdam param group (``lr``,
    ``betas``, ``eps``, ...): one per group and step, passed to the kernel call of every bucket the
    group's parameters lie in.

    ``adamw_mode`` comes from the caller, who knows which optimizer owns the group. ``float()`` first,
    so a tensor learning rate (which torch allows) is read as its value.
    """
    beta1, beta2 = group["betas"]
    return kernels.AdamArgs(
        lr=float(group["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        adamw_mode=adamw_mode,
        maximize=group.get("maximize", False),
    )


SUPPORTED = "torch.optim.AdamW, torch.optim.Adam or lightning_zero_offload.CPUAdam"

# The methods each base's step() runs; a subclass overriding one of them changes the update, which the
# CPU kernel would not reproduce.
_UPDATE_METHODS: dict[type, tuple[str, ...]] = {
    CPUAdam: ("step", "_gather"),
    torch.optim.AdamW: ("step", "_init_group"),
    torch.optim.Adam: ("step", "_init_group"),
}

# Param-group keys that change the math in ways the kernel does not implement, and why. Other torch keys
# ("foreach", "fused", "capturable") only choose torch's implementation of the same update: the kernel
# is an implementation of its own, so they are harmless. "maximize" and "decoupled_weight_decay" are
# implemented; keys torch does not know (a group "name" for logging) are left alone.
_UNSUPPORTED_KEYS = {
    "amsgrad": (
        "zero_offload's CPU Adam kernel keeps no running maximum of the second moments (AMSGrad's "
        "max_exp_avg_sq). Set amsgrad=False, or train with strategy='auto'"
    ),
    "differentiable": (
        "zero_offload's CPU step runs outside autograd, so no gradient can flow through the update. "
        "Set differentiable=False, or train with strategy='auto'"
    ),
}


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
            f"{type(optimizer).__name__}. Use {SUPPORTED} (what configure_optimizers returns, or what you give "
            "fabric.setup)."
        )
    overridden = overridden_update_methods(optimizer)
    if overridden:
        cls = type(optimizer)
        base = _base_of(cls)
        methods = " and ".join(f"{name}()" for name in overridden)
        raise TypeError(
            f"zero_offload cannot run {cls.__module__}.{cls.__qualname__}: it overrides {methods} of "
            f"{base.__module__}.{base.__qualname__}. zero_offload never calls the optimizer's step(): its CPU "
            f"kernel runs {base.__name__}'s own Adam math on the offloaded fp32 master weights, so "
            f"{cls.__name__}'s step() would never run and the model would silently train as a plain "
            f"{base.__name__}. Use {SUPPORTED} (from configure_optimizers, or given to fabric.setup; move the extra "
            "logic into the model or a callback), or train with strategy='auto' (or 'deepspeed'), which call the "
            "optimizer's step()."
        )
    for index, group in enumerate(optimizer.param_groups):
        read_hyperparams(optimizer, group, index)


def overridden_update_methods(optimizer: torch.optim.Optimizer) -> list[str]:
    """The methods of the update (``step`` and what it runs) that ``optimizer``'s class overrides.

    Not a plain ``"step" in vars(cls)``: torch wraps ``step`` to fire its hooks when the first instance of
    a class is made (``Optimizer._patch_step_function``), and may store that wrapper on a subclass that
    defines no ``step`` of its own. So the function each name resolves to is unwrapped layer by layer
    (``__wrapped__``), and it counts as the base's own only if every layer is the base's own code or
    torch's hook wrapper; a user's decorator around the base's step is an override too.
    """
    cls = type(optimizer)
    base = _base_of(cls)
    return [
        name
        for name in _UPDATE_METHODS[base]
        if not _layers(_resolve(cls, name)) <= _layers(_resolve(base, name)) | _TORCH_WRAPPERS
    ]


def _base_of(cls: type) -> type:
    return next(klass for klass in cls.__mro__ if klass in _UPDATE_METHODS)


def _resolve(cls: type, name: str) -> object:
    """What ``cls.name`` is defined as, without the descriptor protocol (a staticmethod stays one)."""
    return next((vars(klass)[name] for klass in cls.__mro__ if name in vars(klass)), None)


def _layers(fn: object) -> set[object]:
    """The code of every layer of a (decorated) function; an object without code stands for itself."""
    layers: set[object] = set()
    for _ in range(64):  # a __wrapped__ cycle would otherwise never end
        if fn is None:
            break
        layers.add(getattr(fn, "__code__", fn))
        fn = getattr(fn, "__wrapped__", None)
    return layers


def _torch_wrappers() -> frozenset[object]:
    """The code of the wrapper torch puts around ``step`` to fire the step hooks (one code object for all)."""
    wrap: Callable[[Callable[[], None]], object] | None = getattr(Optimizer, "profile_hook_step", None)

    def probe() -> None:
        pass

    return frozenset() if wrap is None else frozenset(_layers(wrap(probe)) - _layers(probe))


_TORCH_WRAPPERS = _torch_wrappers()


def read_hyperparams(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], index: int | None = None
) -> kernels.AdamArgs:
    """The validated hyperparameters of one of the optimizer's param groups, as they are now.

    Called at setup and at every step (a callback or scheduler may change a group between steps), so a
    key the kernel does not implement is refused at the step where it appears. ``index``: the group's
    position in ``param_groups``, which every error then names.
    """
    try:
        for key, why in _UNSUPPORTED_KEYS.items():
            if group.get(key, False):
                raise ValueError(f"{key}={group[key]!r} is not supported: {why}.")
        if isinstance(optimizer, CPUAdam):
            adamw_mode = bool(group["adamw_mode"])
        else:
            # AdamW subclasses Adam in recent torch: the group flag, not isinstance, says which decay runs.
            adamw_mode = bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
        return adam_args(group, adamw_mode)
    except (TypeError, ValueError) as err:
        if index is None:
            raise
        raise type(err)(f"param_groups[{index}]: {err}") from None
