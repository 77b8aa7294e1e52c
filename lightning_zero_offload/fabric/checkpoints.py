"""Fabric's checkpoints: their freely named entries to and from the Trainer's layout, and restoring
Fabric's state objects (modules, optimizers, other values) from a loaded checkpoint.

A Fabric checkpoint names its entries freely; ``FABRIC_KEY`` says which hold the model and the
optimizer. Its sharded ``meta.pt`` is in the Trainer's layout (``"state_dict"``, ``"optimizer_states"``),
so that ``load_sharded`` and the fp32 export read both alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_zero_offload.checkpoints import FABRIC_KEY, FORMAT_KEY
from lightning_zero_offload.checkpoints.distributed import is_distributed_checkpoint
from lightning_zero_offload.core import ParamOffloadSession


def refuse_sharded_filter(filter: dict[str, Any] | None, keys: dict[str, str | None]) -> None:
    """``fabric.save(..., filter=...)`` cannot filter the model or the optimizer of a sharded checkpoint: each rank
    writes its shard of the weights and moments whole (Lightning's FSDP refuses it too)."""
    filtered = sorted(name for name in filter or {} if name is not None and name in keys.values())
    if filtered:
        raise ValueError(
            f"fabric.save(..., filter=...) filters {filtered}, which checkpoint_format='sharded' writes whole (each "
            "rank its shard of the weights and moments). Save a filtered checkpoint with "
            "ZeroOffloadFabricStrategy(checkpoint_format='full'), or filter other entries only"
        )


def loads_in_place(session: Any, path: Any, state: Any) -> bool:
    """Whether ``fabric.load(path, state)`` reads ``offload_params``' sharded checkpoint in place into the shards and
    moments of ``session``: only where ``state`` names the module it trains. Another module (one set up for
    evaluation) reads it whole, as the full format does: in place, the checkpoint went into the trained module and
    the other stayed as built."""
    if not (isinstance(session, ParamOffloadSession) and session.training and is_distributed_checkpoint(path)):
        return False
    return any(value is session.module for value in (state.values() if isinstance(state, dict) else [state]))


def sharded_from_fabric_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The Fabric checkpoint dict (with its ``FABRIC_KEY`` entry) in the Trainer's layout, in place."""
    keys = checkpoint[FABRIC_KEY]
    checkpoint["state_dict"] = checkpoint.pop(keys["model"])
    if keys["optimizer"] is not None:
        checkpoint["optimizer_states"] = [checkpoint.pop(keys["optimizer"])]
    return checkpoint


def fabric_checkpoint_from_sharded(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A loaded sharded checkpoint of Fabric's back under the names the Fabric run gave its entries, in place."""
    keys = checkpoint.pop(FABRIC_KEY)
    checkpoint.pop(FORMAT_KEY)
    checkpoint[keys["model"]] = checkpoint.pop("state_dict")
    if keys["optimizer"] is not None and "optimizer_states" in checkpoint:  # not read for a model alone
        checkpoint[keys["optimizer"]] = checkpoint.pop("optimizer_states")[0]
    return checkpoint


def restore_objects(
    state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None,
    checkpoint: dict[str, Any],
    load_module: Callable[[nn.Module, dict[str, Any]], None],
    loaded: set[str] = frozenset(),
) -> dict[str, Any]:
    """Restore ``state`` from a loaded ``checkpoint`` and return what is left of it (Fabric's ``load``).

    ``state`` is one module, one optimizer, or a dict of named objects: modules load through
    ``load_module``, objects with a ``state_dict``/``load_state_dict`` load their entry, other values
    are replaced in ``state``. Modules load first, whatever the dict's order: a pending delayed update,
    restored with the optimizer state, puts device parameters over the weights. ``loaded``: the names
    of ``state`` restored already (in place, from a distributed checkpoint), left as they are.
    """
    if not state:
        return checkpoint
    if isinstance(state, nn.Module):
        load_module(state, checkpoint)
        return {}
    if isinstance(state, torch.optim.Optimizer):
        state.load_state_dict(checkpoint)
        return {}
    names = sorted(
        (name for name in state if name in checkpoint and name not in loaded),
        key=lambda n: not isinstance(state[n], nn.Module),
    )
    for name in names:
        obj = state[name]
        if isinstance(obj, nn.Module):
            load_module(obj, checkpoint.pop(name))
        elif hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
            obj.load_state_dict(checkpoint.pop(name))
        else:
            state[name] = checkpoint.pop(name)
    return checkpoint
