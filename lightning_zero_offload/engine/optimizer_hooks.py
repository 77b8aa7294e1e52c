"""torch's optimizer step hooks, fired around the engine's update as ``Optimizer.step`` fires them.

torch fires them from a wrapper it puts around ``step`` (``Optimizer.profile_hook_step``); the engine never
calls ``step``, so without this a ``register_step_pre_hook``/``register_step_post_hook`` hook (or a global
one, ``torch.optim.optimizer.register_optimizer_step_pre_hook``/``_post_hook``) would never run. The
engine's step is the one place both front ends (Trainer and Fabric) go through, so it fires them:

- in torch's order: global pre-hooks, the optimizer's pre-hooks, the update, the optimizer's post-hooks,
  global post-hooks, inside the profiler range torch opens (``Optimizer.step#<class>.step``);
- with torch's arguments for ``optimizer.step()`` called without a closure: ``(optimizer, (optimizer,), {})``.
  The gradients exist already (hooks fire after backward, as under AMP's ``GradScaler.step``), but they are
  in the engine's CPU buffers, not on ``p.grad``;
- once per optimizer step that updates the parameters: a step skipped for inf/nan gradients fires none,
  as ``GradScaler`` skips ``optimizer.step()`` entirely then.

A torch pre-hook may return new ``(args, kwargs)`` for ``step``. The engine's step has no arguments to
replace (the closure has run, the update is the CPU kernel's), so returning them unchanged is accepted and
anything else is refused: silently ignoring them would train differently from strategy="auto".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

__all__ = ["has_step_hooks", "step_hooks"]


def _global_hooks(kind: str) -> dict[int, Any]:
    # torch's registries, looked up at each call: register_optimizer_step_*_hook adds to these dicts.
    return getattr(torch_optimizer, f"_global_optimizer_{kind}_hooks", {})


def _own_hooks(optimizer: torch.optim.Optimizer, kind: str) -> dict[int, Any]:
    return getattr(optimizer, f"_optimizer_step_{kind}_hooks", {})


def has_step_hooks(optimizer: torch.optim.Optimizer, kinds: tuple[str, ...] = ("pre", "post")) -> bool:
    """Whether any step hook (global or this optimizer's) of these kinds is registered now."""
    return any(_global_hooks(kind) or _own_hooks(optimizer, kind) for kind in kinds)


@contextmanager
def step_hooks(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Fire the pre-hooks, run the body (the update), then the post-hooks; an exception skips the post-hooks,
    as in torch."""
    args: tuple[Any, ...] = (optimizer,)
    kwargs: dict[str, Any] = {}
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        for hook in chain(_global_hooks("pre").values(), _own_hooks(optimizer, "pre").values()):
            _check_pre_hook_result(hook, hook(optimizer, args, kwargs), optimizer, kwargs)
        yield
        step_code = getattr(optimizer, "_optimizer_step_code", None)
        if step_code is not None:  # torch calls it after every step (an entry point for its profiler)
            step_code()
        for hook in chain(_own_hooks(optimizer, "post").values(), _global_hooks("post").values()):
            hook(optimizer, args, kwargs)


def _check_pre_hook_result(hook: Any, result: Any, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> None:
    """Accept None (or the arguments unchanged); refuse new step arguments, returned or added to ``kwargs``."""
    if result is None and not kwargs:
        return
    if result is not None and not (isinstance(result, tuple) and len(result) == 2):
        # torch's own error for this case
        raise RuntimeError(f"{hook} must return None or a tuple of (new_args, new_kwargs), but got {result}.")
    new_args, new_kwargs = result if result is not None else ((optimizer,), kwargs)
    unchanged = (
        isinstance(new_args, (tuple, list))
        and len(new_args) == 1
        and new_args[0] is optimizer
        and isinstance(new_kwargs, dict)
        and not new_kwargs
    )
    if not unchanged:
        extra_args = tuple(new_args)[1:] if isinstance(new_args, (tuple, list)) else new_args
        raise RuntimeError(
            f"The optimizer step pre-hook {hook!r} asks for new step arguments (args after the optimizer: "
            f"{extra_args!r}, kwargs: {new_kwargs!r}). zero_offload's optimizer step takes none: the "
            "closure (forward and backward) has already run and the update is its CPU Adam kernel, so they could "
            "not be honoured. Return None from the hook (changes it makes to optimizer.param_groups do apply to "
            "this step), or train with strategy='auto'."
        )
