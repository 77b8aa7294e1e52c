"""When the root and the holders gather their parameters beyond FSDP2's own hooks, and when those copies are freed.

FSDP2 keeps the root's gathered parameters from forward to backward (it would gather them again at once), and
``placement.shard_model`` wraps the holders (submodels) the same way. These hooks gather the holders with the root,
for a step that calls a holder's layers and never the holder, free every gathered copy where no backward will come
to free it, and gather each frozen parameter in its own dtype, not the compute dtype FSDP2 gives every parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves


def gather_children(module: nn.Module, _args: object, names: tuple[str, ...]) -> None:
    """The root's forward pre-hook, after FSDP2's: gather the holders, since a step may call a holder's layers and
    never the holder itself."""
    for name in names:
        child = getattr(module, name)
        if isinstance(child, FSDPModule):
            for group in child._get_fsdp_state()._fsdp_param_groups:  # not unshard(): it resets each dtype
                group.unshard()
                group.wait_for_unshard()


def reshard_all(module: nn.Module) -> None:
    """Free every gathered copy of ``module``'s units. Backward reshards the units it ran through; a forward without
    backward (a training step that returned None, evaluation) leaves the root and the holders gathered, and a
    step writing the shards under them would leave the next forward the old weights."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class ReshardAfterInference:
    """Frees what the root and the holders gathered once a call into them (``forward``, ``generate``) that no
    backward can follow returns: FSDP2 keeps those copies until backward, so after a forward under ``no_grad``
    (evaluation, a callback's sample) the module's parameters would stay gathered copies, not the shards the
    optimizer holds (``BaseFinetuning`` maps one to the other), and the device would keep them. Only the
    outermost call reshards: a step may call a holder, then its layers."""

    def __init__(self) -> None:
        self.depth = 0

    def attach(self, unit: nn.Module) -> None:
        unit.register_forward_pre_hook(self._enter, prepend=True)  # before FSDP2's: counted even if that raises
        unit.register_forward_hook(self._leave_forward, always_call=True)
        generate = getattr(unit, "generate", None)
        if callable(generate):

            @functools.wraps(generate)
            def generate_then_reshard(*args: Any, **kwargs: Any) -> Any:
                return self._generate(generate, unit, *args, **kwargs)

            unit.generate = generate_then_reshard  # type: ignore[method-assign]

    def _enter(self, _module: nn.Module, _args: object) -> None:
        self.depth += 1

    def _leave_forward(self, module: nn.Module, _args: object, _output: object) -> None:
        self.depth -= 1
        if not self.depth and not torch.is_grad_enabled():
            reshard_all(module)

    def _generate(self, generate: Callable[..., Any], unit: nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.depth += 1
        try:
            output = generate(*args, **kwargs)
        finally:
            self.depth -= 1
        if not self.depth and not any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output)):
            reshard_all(unit)
        return output


def frozen_in_their_dtype(module: nn.Module, _args: object) -> None:
    """The root's forward pre-hook, before FSDP2's: each frozen parameter is gathered in its own dtype, a trainable
    one in the compute dtype. FSDP2's ``MixedPrecisionPolicy`` casts every parameter of a unit alike, so a frozen
    fp32 weight reached forward rounded to bf16 (or, under fp16, inf beyond its range), where AMP and the ZeRO-2 mode
    use it as it is. FSDP2 also fixes a unit's gradient dtypes at its first forward from the parameters trainable
    then, so a unit frozen there and unfrozen later (``BaseFinetuning``) failed to take its bf16 gradients. Read
    again at every forward, as a finetuning callback freezes and unfreezes between steps."""
    module._get_fsdp_state()._lazy_init()  # FSDP2 sets the dtypes there once: this hook keeps them up to date
    for group in _param_groups(module):
        params = group.fsdp_params
        wanted = [_gathered_dtype(p, group.mp_policy.param_dtype) for p in params]
        now = [p.param_dtype for p in params]
        trainable = {p.orig_dtype for p in params if p.sharded_param.requires_grad}
        if now == wanted and group._orig_dtype in (trainable or {None}):
            continue
        group.reshard()  # no gathered copy in the old dtype may outlive the change
        group._init_mp_dtypes()  # the gradients' dtypes, for the parameters trainable now
        for param, before, dtype in zip(params, now, wanted):
            param.param_dtype = dtype
            if before != dtype:
                param.all_gather_outputs = []  # allocated again, in the new dtype, at the next gather
                if hasattr(param, "_unsharded_param"):
                    del param._unsharded_param


def gather_for_calls(module: nn.Module) -> None:
    """Outside the Trainer's stages and a Fabric run, gather the trainable parameters of ``module`` (the root) in
    fp32, as a module computes under auto after fit: in the compute dtype, a call with fp32 inputs and no autocast
    met bf16 weights ("mat1 and mat2 must have the same dtype"). Frozen ones keep their own dtype. Each unit's
    ``MixedPrecisionPolicy`` is kept for :func:`gather_for_training` (FSDP2 derives the gathered dtypes from it:
    ``frozen_in_their_dtype`` and ``unshard()``)."""
    for group in _param_groups(module):
        if group not in _TRAINING_POLICIES:
            _TRAINING_POLICIES[group] = group.mp_policy
            group.mp_policy = dataclasses.replace(group.mp_policy, param_dtype=torch.float32)
    frozen_in_their_dtype(module, ())


def gather_for_training(module: nn.Module) -> None:
    """Each unit's own ``MixedPrecisionPolicy`` back (the compute dtype, the reduce dtype), after
    :func:`gather_for_calls`: for a fit or an evaluation stage."""
    for group in _param_groups(module):
        if (policy := _TRAINING_POLICIES.pop(group, None)) is not None:
            group.mp_policy = policy
    frozen_in_their_dtype(module, ())


def _param_groups(module: nn.Module) -> list[Any]:
    units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
    return [group for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups]


# FSDP2's parameter groups whose policy gather_for_calls replaced, with the policy to give back.
_TRAINING_POLICIES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _gathered_dtype(param: Any, compute: torch.dtype | None) -> torch.dtype | None:
    """FSDP2's ``param_dtype`` for one of its parameters: the compute dtype for a trainable floating-point one
    stored in another, else None (gathered as stored)."""
    trainable = param.sharded_param.requires_grad and param.orig_dtype.is_floating_point
    return compute if trainable and compute not in (None, param.orig_dtype) else None
