"""Giving a model built on the meta device its memory and its values, one unit at a time, never whole.

``materialize`` serves both modes. A model wrapped with ``fully_shard`` (the parameter-offload mode) gets
only this rank's shards, on the host (``CPUOffloadPolicy``; the device share's units: on the device), and its
buffers on the mesh's device; a plain module gets its tensors on ``device``, whole (a module partly on the meta
device: what is there). The ZeRO-2
engine takes a model built on the meta device in two steps instead (engine/meta_init/blockwise.py). Both plan and
initialize with engine/meta_init/initialization.py.

Values, module by module in module order (``module.modules()``, parents first; for a Hugging Face model
the order of its own ``initialize_weights``: children first). Each module that owns tensors on the meta
device is initialized by ``init_fn(module)`` when given, else by its Hugging Face model's
``_init_weights(module)``, else by its own ``reset_parameters()`` (torch's convention, which Lightning's
meta-device path and torchtitan rely on too); a module that has none is refused before anything is
allocated. A sharded parameter is initialized whole on the host, in a scratch tensor that stands in for it
while the modules of its FSDP unit are initialized (the host holds one unit whole at a time), then rank
0's values are scattered (``distribute_tensor``) and each rank keeps its own rows. Initializing on plain
tensors gives the values of an eager build with the same seed (DTensor random init on a CPU mesh would
give every rank the same values for its own rows), and bitwise the same for a model whose ``__init__``
initializes its layers in module order.

A parameter shared by several modules (tied embeddings) takes the values of the first module in that order
that owns it; the later owners initialize a scratch tensor that is thrown away, so the random stream
advances as in an eager build that ties the weights after constructing both modules.

Buffers. No checkpoint holds a non-persistent buffer (rotary ``inv_freq``), and ``to_empty`` leaves garbage
in it, so it is computed by the same initialization as the parameters, with ``initialize=False`` too (then
only the modules that own one are initialized): Hugging Face's ``_init_weights`` recomputes rotary
embeddings (transformers 5); a torch module must recompute its buffers in ``reset_parameters()``
(litgpt's and torchtitan's models do). A buffer that is not on the meta device (made with an explicit
``device="cpu"`` under the meta context) keeps the value ``__init__`` gave it. Every buffer of a sharded
model ends on the mesh's device with rank 0's values.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from lightning_zero_offload.engine.meta_init.initialization import (
    InitFn,
    allocate,
    by_unit,
    init_plan,
    initialized,
    is_blank,
    on_meta,
    unit_of,
)


def materialize(
    module: nn.Module, device: torch.device | str, *, initialize: bool = True, init_fn: InitFn | None = None
) -> None:
    """Allocate and initialize every tensor of ``module`` that is on the meta device (nothing to do when
    none is). ``device``: where a plain module's tensors and a sharded model's buffers go (the mesh's
    device); sharded parameters stay on the host. ``initialize=False`` leaves parameters and persistent
    buffers uninitialized, for pretrained weights to be loaded next (``pretrained.load_pretrained``); the
    non-persistent buffers, which no checkpoint holds, are computed either way."""
    device = torch.device(device)
    params = list(module.parameters())
    sharded = any(isinstance(p, DTensor) for p in params)
    if not on_meta(module, partly=not sharded):
        return
    if not any(p.is_meta for p in params):
        _compute_meta_buffers(module, device)
        return
    if not sharded:
        _materialize_in_place(module, device, initialize, init_fn)
        return
    if not isinstance(module, FSDPModule):
        raise ValueError("materialize a sharded model from its root: call fully_shard on the root first.")
    plan = init_plan(module, initialize, init_fn)
    blank_buffers = {(id(m), n) for m in module.modules() for n, b in m._buffers.items() if is_blank(b)}
    kept_buffers = [(owner, name, b) for owner in module.modules() for name, b in owner._buffers.items() if _real(b)]
    ties = _ties(module)
    _allocate_shards(module, device)
    for (first, first_name), *others in ties:  # to_empty gives each holder of a tied parameter its own copy
        for owner, name in others:
            owner._parameters[name] = first._parameters[first_name]
    with torch.no_grad():
        groups = by_unit(plan, unit_of(module, None))
        for scratch in initialized(groups, blank_buffers, initialize, _dtype_if_sharded):
            for param, whole in scratch:
                _keep_own_rows(param, whole)
            scratch = param = whole = None  # freed before the next unit's scratch is made
        for owner, name, buffer in kept_buffers:
            owner._buffers[name] = buffer
        mesh = next(p for p in params if isinstance(p, DTensor)).device_mesh
        for owner in module.modules():
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    owner._buffers[name] = _from_rank0(buffer.to(device), mesh)


def keeps_shards_on_host(unit: FSDPModule) -> bool:
    """Whether ``fully_shard`` put this unit's own parameters on the host (``CPUOffloadPolicy``); the units of
    the device share keep theirs on the device. FSDP2 2.13 has no getter: read from its parameter groups."""
    groups = unit._get_fsdp_state()._fsdp_param_groups
    return all(isinstance(group.offload_policy, CPUOffloadPolicy) for group in groups)


def _shard_side(unit: FSDPModule, device: torch.device) -> torch.device:
    return torch.device("cpu") if keeps_shards_on_host(unit) else device


def _allocate_shards(module: nn.Module, device: torch.device) -> None:
    """Memory for this rank's shards only, each module's on its unit's side (the host, or the device for the
    device share), one module at a time: a recursive ``to_empty`` from the root would allocate every unit's
    shards on the root's side first. FSDP2 re-points its padded shard storage when a unit's own ``_apply``
    runs, which a non-recursive call leaves to the unit's submodules: so each unit's parameters are reset once
    all of them have memory, as ``FSDPModule._apply`` does."""

    def allocate(m: nn.Module, side: torch.device) -> None:
        if isinstance(m, FSDPModule):
            side = _shard_side(m, device)
        m.to_empty(device=side, recurse=False)
        for child in m.children():
            allocate(child, side)

    allocate(module, _shard_side(module, device))  # type: ignore[arg-type]
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    fsdp_param.reset_sharded_param()


def _materialize_in_place(module: nn.Module, device: torch.device, initialize: bool, init_fn: InitFn | None) -> None:
    """A plain module wholly or partly on the meta device (built partly in ``__init__``, or a load before setup
    filled part of it): its tensors on the meta device get memory on ``device`` in place (``allocate``: ties,
    classes and attributes stay) and their modules' init, the parameters that have their values stood in by
    throwaway tensors."""
    plan = init_plan(module, initialize, init_fn)
    real = {id(p) for p in module.parameters() if not p.is_meta}
    blank = {(id(m), n) for m in module.modules() for n, b in m._buffers.items() if is_blank(b)}
    allocated = {id(p): allocate(p, device) for p in module.parameters() if p.is_meta}
    for m in module.modules():  # where a weak reference kept a parameter from being allocated in place
        for name, p in list(m._parameters.items()):
            if p is not None and id(p) in allocated:
                m._parameters[name] = allocated[id(p)]
    for m in module.modules():
        for name, b in list(m._buffers.items()):
            if is_blank(b):
                m._buffers[name] = torch.empty_like(b, device=device)
    with torch.no_grad():
        for scratch in initialized(by_unit(plan, unit_of(module, None)), blank, initialize, lambda p: None, real):
            del scratch


def _compute_meta_buffers(module: nn.Module, device: torch.device) -> None:
    """Parameters real and some buffers on the meta device (weights loaded with ``load_state_dict(...,
    assign=True)`` into a model built there, which leaves its non-persistent buffers behind, a rotary cache):
    each owner's init computes its buffers on ``device``, its parameters stood in by throwaway tensors so
    that the weights are not touched."""
    plan = init_plan(module, True, None, buffers_only=True)
    blank = {(id(m), n) for m in module.modules() for n, b in m._buffers.items() if is_blank(b)}
    for m in module.modules():
        for name, b in list(m._buffers.items()):
            if is_blank(b):
                m._buffers[name] = torch.empty_like(b, device=device)
    with torch.no_grad():
        for scratch in initialized(([entry] for entry in plan), blank, True, lambda p: p.dtype):
            del scratch


def _ties(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter held by several (module, name) slots: those slots, for each."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for name, p in owner._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((owner, name))
    return [slots for slots in holders.values() if len(slots) > 1]


def _real(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and not tensor.is_meta


def _dtype_if_sharded(param: nn.Parameter) -> torch.dtype | None:
    return param.dtype if isinstance(param, DTensor) else None


def _keep_own_rows(param: DTensor, whole: torch.Tensor) -> None:
    """Rank 0's ``whole`` scattered over the parameter's mesh; this rank's rows copied into its shard."""
    local = param.to_local()
    if param.device_mesh.size() == 1:  # the shard is the whole tensor: no scattered copy
        local.copy_(whole)
        return
    mine = distribute_tensor(whole, param.device_mesh, param.placements).to_local()
    if mine.shape != local.shape:
        raise AssertionError(f"a shard of {tuple(local.shape)} where distribute_tensor gives {tuple(mine.shape)}")
    local.copy_(mine)


def _from_rank0(buffer: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if mesh.size() == 1:
        return buffer
    return distribute_tensor(buffer, mesh, [Replicate()] * mesh.ndim).to_local()
