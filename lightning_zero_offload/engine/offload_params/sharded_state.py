"""The parameter-offload engine's state in the sharded checkpoint format: what ``torch.distributed.checkpoint``
saves from each rank's shards and fills back in place, at any world size. Plain torch; the files (versions,
integrity, the export) are checkpoints/distributed.py's, the full format full_state.py's.

::

    model       get_model_state_dict(module): each sharded parameter is a DTensor whose local shard is the
                master weight, the buffers as the module holds them
    optimizer   {name: {"exp_avg", "exp_avg_sq": DTensor views of the slot's moments with the parameter's
                spec, "step": int64}}, one entry per parameter with state (trainable, or frozen after
                training; a tied one under its first name)

Beside it, plain Python: the param groups with their parameters by name (:func:`param_groups_by_name`) and the
engine's ``state_dict`` (its counters).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_zero_offload.engine.offload_params.engine import ParamOffloadEngine
from lightning_zero_offload.engine.optimizer_support import optimizer_params

__all__ = [
    "keep_saved_state",
    "load_param_groups_by_name",
    "load_sharded_state",
    "param_groups_by_name",
    "param_names",
    "as_dtensor",
    "sharded_state",
]


def param_names(module: nn.Module, engine: ParamOffloadEngine) -> list[str]:
    """The name in ``module`` of each parameter the engine holds state for (trainable, or frozen after training; a
    tied one's first name), in slot order."""
    names = _names(module)
    missing = [tuple(slot.param.shape) for slot in engine.slots if id(slot.param) not in names]
    if missing:
        raise ValueError(
            f"the optimizer trains parameters of shape {missing[:3]} that are not parameters of the module saved "
            "with it: build the optimizer from the sharded module's parameters (after fully_shard)"
        )
    return [names[id(slot.param)] for slot in engine.slots]


def _names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}  # a tied parameter under its first name


def sharded_state(
    module: nn.Module,
    engine: ParamOffloadEngine,
    with_optimizer: bool = True,
    with_model: bool = True,
    saved: Collection[str] | None = None,
    model_keys: Collection[str] | None = None,
) -> dict[str, Any]:
    """The dict ``torch.distributed.checkpoint`` saves, or fills in place on load: views of the live shards and
    moments, nothing copied; ``saved``: only the optimizer state of these parameters (those a checkpoint has);
    ``model_keys``: only these entries of the module (those a checkpoint has). Call it between steps (no
    speculated step pending)."""
    state: dict[str, Any] = {}
    if with_model:
        model = get_model_state_dict(module)
        state["model"] = model if model_keys is None else {k: v for k, v in model.items() if k in model_keys}
    if with_optimizer:
        state["optimizer"] = {
            name: {
                "exp_avg": as_dtensor(slot.exp_avg, slot.param),
                "exp_avg_sq": as_dtensor(slot.exp_avg_sq, slot.param),
                "step": torch.tensor(slot.step, dtype=torch.int64),
            }
            for name, slot in zip(param_names(module, engine), engine.slots)
            if saved is None or name in saved
        }
    return state


def keep_saved_state(module: nn.Module, engine: ParamOffloadEngine, saved: Collection[str]) -> None:
    """Slots for the optimizer's frozen parameters whose state a checkpoint has (``saved``: their names), so that
    it loads into them: torch's AdamW keeps a frozen parameter's state for its unfreezing."""
    in_optimizer = {id(p) for p in optimizer_params(engine.optimizer)}
    for name, param in module.named_parameters():
        if name in saved and id(param) in in_optimizer:
            engine.slot_of(param)


def load_sharded_state(module: nn.Module, engine: ParamOffloadEngine, state: dict[str, Any]) -> None:
    """After ``torch.distributed.checkpoint.load(state)`` filled :func:`sharded_state`'s dict: the model's
    entries into the module (the shards were filled in place already; buffers may be copies; entries the
    checkpoint lacks, checked by the caller, keep their values), the step counts into the slots (the moments were
    filled in place; a slot the checkpoint has no state for starts afresh)."""
    if "model" in state:
        set_model_state_dict(module, state["model"], options=StateDictOptions(strict=False))
    if "optimizer" in state:
        for name, slot in zip(param_names(module, engine), engine.slots):
            entry = state["optimizer"].get(name)
            if entry is None:
                slot.reset()
            else:
                slot.step = int(entry["step"])


def as_dtensor(local: Tensor, param: nn.Parameter) -> Tensor:
    """``local`` (shaped like the parameter's shard) as a DTensor with the parameter's spec: a view, no copy.

    The global shape and stride are given, as a rank's shard of an unevenly split parameter does not tell them.
    """
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def param_groups_by_name(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups' hyperparameters, each group's parameters by name (frozen ones too, as torch lists them)."""
    names = _names(module)
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


def load_param_groups_by_name(
    module: nn.Module, optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]
) -> None:
    """:func:`param_groups_by_name`'s hyperparameters back into the optimizer, whose groups must hold the same
    parameters."""
    saved = [group["params"] for group in groups]
    held = [group["params"] for group in param_groups_by_name(module, optimizer)]
    if saved != held:
        first = next((i for i, (a, b) in enumerate(zip(saved, held)) if a != b), min(len(saved), len(held)))
        raise ValueError(
            f"the checkpoint has {len(saved)} param groups, the optimizer {len(held)}, and group {first} differs: "
            f"the checkpoint's holds {saved[first][:4] if first < len(saved) else 'nothing'}, the optimizer's "
            f"{held[first][:4] if first < len(held) else 'nothing'}. Build the optimizer with the same param groups "
            "as when it was saved"
        )
    for group, entry in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in entry.items() if k != "params"})
