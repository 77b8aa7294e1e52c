"""The parameter-offload engine's state in the full checkpoint format: the ZeRO-2 engine's layout (the
module's full state dict, the optimizer state in torch AdamW's format, the engine's counters), so the two
modes resume from each other's full checkpoints and ``zero-offload-convert`` reads them.

Everything is gathered whole on rank 0's host (collectives: every rank calls them): the full format costs
the model's weights and moments whole in memory there. Loading takes each rank's rows of every tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from lightning_zero_offload.engine.offload_params.engine import ParamOffloadEngine
from lightning_zero_offload.engine.offload_params.shards import ShardSlot
from lightning_zero_offload.engine.optimizer_support import optimizer_params
from lightning_zero_offload.engine.state_dicts import note_state_conversion

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every sharded tensor whole, on rank 0 (other ranks get ``{}``)."""
    return get_model_state_dict(module, options=_FULL)


def load_full_model_state(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """A full state dict into ``module``'s shards (each rank keeps its rows), in place."""
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(module, dict(state), options=options)  # a copy: it puts DTensors in the dict it gets


def _whole(slot: ShardSlot, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's shard, on the host. Gathered on the mesh's device, as
    the model's full state dict is: a host tensor cannot go through NCCL."""
    param = slot.param
    if not isinstance(param, DTensor):
        return local.clone()
    device = param.device_mesh.device_type
    spread = DTensor.from_local(
        local.to(device), param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
    return spread.full_tensor().cpu()


def _torch_indices(engine: ParamOffloadEngine) -> dict[int, int]:
    """Each parameter's number in ``torch.optim.Optimizer.state_dict`` (param groups in order, frozen ones too)."""
    return {id(p): index for index, p in enumerate(optimizer_params(engine.optimizer))}


def param_groups_state(engine: ParamOffloadEngine) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters, numbered as in ``torch.optim.Optimizer.state_dict``."""
    groups, counter = [], 0
    for group in engine.optimizer.param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = list(range(counter, counter + len(group["params"])))
        counter += len(group["params"])
        groups.append(saved)
    return groups


def full_optimizer_state(engine: ParamOffloadEngine) -> dict[str, Any]:
    """The optimizer state in torch AdamW's format with whole moments on rank 0 (a collective, one tensor at a
    time; the other ranks get the param groups and no moments, as :func:`full_model_state` gives them ``{}``)."""
    index = _torch_indices(engine)
    keeps = not dist.is_initialized() or dist.get_rank() == 0
    state: dict[int, dict[str, torch.Tensor]] = {}
    for slot in engine.slots:
        exp_avg, exp_avg_sq = _whole(slot, slot.exp_avg), _whole(slot, slot.exp_avg_sq)
        if slot.step > 0 and keeps:
            state[index[id(slot.param)]] = {
                "step": torch.tensor(float(slot.step)),
                "exp_avg": exp_avg,
                "exp_avg_sq": exp_avg_sq,
            }
    return {"state": state, "param_groups": param_groups_state(engine)}


def load_full_optimizer_state(engine: ParamOffloadEngine, state_dict: dict[str, Any]) -> None:
    """An optimizer state in torch Adam/AdamW's format (whole moments) into each rank's moments and steps."""
    saved_groups = state_dict["param_groups"]
    groups = engine.optimizer.param_groups
    if len(saved_groups) != len(groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, groups)
    ):
        raise ValueError(
            "the optimizer state's param groups do not match the optimizer's (number of groups or of parameters "
            "in a group): it was saved for another model or another configure_optimizers"
        )
    for group, saved in zip(groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
    index = _torch_indices(engine)
    state = {int(k): v for k, v in state_dict["state"].items()}
    note_state_conversion(engine.state_dtype, [entry["exp_avg"].dtype for entry in state.values()], stacklevel=3)
    for group in groups:  # a frozen parameter's state is kept for its unfreezing, as torch's AdamW keeps it
        for param in group["params"]:
            if index[id(param)] in state:
                engine.slot_of(param)
    for slot in engine.slots:
        entry = state.get(index[id(slot.param)])
        if entry is None:
            slot.reset()
            continue
        slot.step = int(entry["step"])
        for local, whole in ((slot.exp_avg, entry["exp_avg"]), (slot.exp_avg_sq, entry["exp_avg_sq"])):
            slot.load_rows(local, whole.reshape(slot.param.shape))
