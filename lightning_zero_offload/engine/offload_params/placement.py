"""Putting a module on FSDP2 for the parameter-offload mode: each repeated block, then the root, sharded
across the ranks with its shards on the host."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard


def find_units(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the children of each outermost ModuleList/Sequential of >= 2 modules of one class."""
    units: list[nn.Module] = []
    inside: set[int] = set()
    for sub in module.modules():
        if id(sub) in inside or not isinstance(sub, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(sub.children())
        if len(children) >= 2 and len({type(child) for child in children}) == 1:
            units.extend(children)
            inside.update(id(m) for child in children for m in child.modules())
    return units


def shard_model(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    pin_memory: bool = True,
) -> None:
    """``fully_shard`` each unit of :func:`find_units`, then the root, with the shards on the host (page-locked
    with ``pin_memory`` where the device is an accelerator: pinning needs one)."""
    policy = CPUOffloadPolicy(pin_memory=pin_memory and mesh.device_type != "cpu")
    # Inputs keep their dtype (a step's targets too), as under AMP: the front ends' autocast casts per operation.
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    if not any(isinstance(sub, FSDPModule) for sub in module.modules()):
        for unit in find_units(module):
            fully_shard(unit, mesh=mesh, offload_policy=policy, mp_policy=mixed)
    if not isinstance(module, FSDPModule):
        fully_shard(module, mesh=mesh, offload_policy=policy, mp_policy=mixed)
