"""Where the model's FSDP2 units go in the parameter-offload mode, and the model wrapped in them.

A unit is one ``fully_shard`` call: its parameters come to the device together (all-gathered) before its
forward and backward and leave together after, so the device holds the units in flight, not the model.
The units are the repeated blocks (the transformer layers) and the modules outside them as large as a
block (embeddings, output head); what is left (norms, small heads, tied embeddings) belongs to the submodel
that holds it (``holders``: a LightningModule's ``self.model``, wrapped after its units) or to the root.

``shard_model`` wraps each unit, then the holders, then the root, with ``CPUOffloadPolicy`` (this rank's shards, their
gradients and the optimizer state live on the host) and materializes a model built on the meta device
shard by shard (``materialize``). A model the user wrapped already (``fully_shard`` in ``configure_model``)
keeps its units; ``check_units`` refuses the settings this mode cannot train with.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from lightning_zero_offload.engine.offload_params.gathering import (
    ReshardAfterInference,
    frozen_in_their_dtype,
    gather_children,
)
from lightning_zero_offload.engine.offload_params.materialize import InitFn, keeps_shards_on_host, materialize
from lightning_zero_offload.engine.step.layout import count_within_share

GIB = 2**30


def find_units(module: nn.Module, *, param_dtype: torch.dtype | None = None) -> list[nn.Module]:
    """The modules to wrap with ``fully_shard`` before the root, in module order: (1) the repeated blocks,
    each child of an ``nn.ModuleList``/``nn.Sequential`` whose children are two or more instances of one
    class (the outermost such container), or for a Hugging Face model the modules whose class it lists in
    ``_no_split_modules``; (2) each other module outside them with at least as many parameters as the
    smallest block, unless it shares a parameter with a module outside it (tied embeddings stay with the
    root). Refuses a model without blocks (``param_dtype``, the compute dtype, sizes the one giant unit in
    the message) and a parameter shared between a block and any module outside that block."""
    blocks = _repeated_blocks(module)
    if not blocks:
        raise ValueError(_no_blocks(module, param_dtype))
    owners = _owners(module)
    for block in blocks:
        if shared := _shared_outside(block, owners):
            raise ValueError(
                f"parameter {shared} of block {type(block).__name__} is also used outside that block: FSDP2 "
                "gathers each block's parameters for that block's forward only, so a weight tied across blocks "
                "would be sharded while the other block runs. Fix: untie it, or call fully_shard yourself in "
                "configure_model on a module that holds every module that uses it (with CPUOffloadPolicy)."
            )
    block_ids = {id(b) for b in blocks}
    threshold = min(_count(b) for b in blocks)
    chosen = set(block_ids)

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if id(child) in chosen:
                continue
            holds_blocks = any(id(inner) in block_ids for inner in child.modules())
            if not holds_blocks and _count(child) >= threshold and not _shared_outside(child, owners):
                chosen.add(id(child))
            else:
                visit(child)

    visit(module)
    return [m for m in module.modules() if id(m) in chosen]


def init_units(module: nn.Module) -> list[nn.Module]:
    """The units a plain model built on the meta device is initialized in for the ZeRO-2 engine, one whole on
    the host at a time: those of :func:`find_units`, or none (the whole model is one) where it finds no blocks
    or a weight tied across blocks (the ZeRO-2 mode trains both)."""
    try:
        return find_units(module)
    except ValueError:
        return []


def shard_model(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype | None = None,
    master_dtype: torch.dtype | None = None,
    device_share: float = 0.0,
    initialize: bool = True,
    init_fn: InitFn | None = None,
    pin_memory: bool = True,
) -> nn.Module:
    """Wrap ``module`` for the parameter-offload mode (in place; returned for convenience): each unit of ``find_units``,
    the children that ``holders`` picks (gathered by the root's forward and kept until backward, as the root's own
    parameters would be, so that a step calling only a holder's layers finds them), then the root,
    with ``fully_shard(mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory and <not a CPU mesh>),
    mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype, cast_forward_inputs=False))``: inputs keep their dtype
    (a step's targets too), as under AMP, where autocast casts per operation (pinning needs an accelerator).
    ``reduce_dtype`` None: fp32 across ranks (the sum's precision), and at one rank the compute dtype: nothing is
    summed there (FSDP2 copies the gradients into its reduce-scatter output), so the gradients are the same bits in
    half the device buffers (the fp32 input and output of a block's reduce, 8 B/param of a block, become 4). The
    units that ``device_units`` picks for ``device_share`` are sharded without ``CPUOffloadPolicy``: their shards
    stay on the device. ``master_dtype``: the dtype of the master weights, which the shards are (``cast_to_master``
    before each unit is wrapped; None: as built). Where the user called ``fully_shard`` already, their units are
    kept and only the root is wrapped if they did not wrap it (``check_units`` first; no device share). A model built
    on the meta device is then materialized unit by unit (``materialize``: ``initialize`` and ``init_fn`` are its
    own), never whole on the host or the device."""
    user_wrapped = any(isinstance(m, FSDPModule) for m in module.modules())
    if user_wrapped:
        check_units(module)
        earlier = _SHARED_AT_SETUP.get(module)
        if earlier is not None and not holds_share(module, device_share):
            raise ValueError(
                f"device_share={device_share:g}, and an earlier setup sharded this model with device_share="
                f"{earlier:g}: FSDP2 keeps a unit's shards where it first put them. Fit it again with "
                f"device_share={earlier:g} (or 'auto', which keeps them), or build the model anew for another share"
            )
        if device_share and not holds_share(module, device_share):
            raise ValueError(
                f"device_share={device_share} chooses the units to keep on the device, and you called fully_shard "
                "yourself: leave the wrapping to the strategy, or set device_share=0 (a unit you wrap without "
                "CPUOffloadPolicy keeps its shards and state on the device)"
            )
    if reduce_dtype is None:
        reduce_dtype = param_dtype if mesh.size() == 1 else torch.float32
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    offload = CPUOffloadPolicy(pin_memory=pin_memory and mesh.device_type != "cpu")
    on_host = {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload}
    on_device = {"mesh": mesh, "mp_policy": mp_policy}
    units = [] if user_wrapped else find_units(module, param_dtype=param_dtype)
    around = [] if user_wrapped else holders(module, units)
    ordered = [*around, *units]  # module order: the holders' own gradients land last
    kept = {id(m) for m in device_units(module, ordered, device_share)}
    if user_wrapped and master_dtype == torch.bfloat16:
        to_keeping_buffers(module, master_dtype)  # FSDP2's module.to casts the shards in place
    for unit in units:
        cast_to_master(unit, master_dtype)
        fully_shard(unit, **(on_device if id(unit) in kept else on_host))  # type: ignore[arg-type]
    for holder in around:  # after the units inside it; gathered from forward to backward, as the root's are
        cast_to_master(holder, master_dtype)
        placement = on_device if id(holder) in kept else on_host
        fully_shard(holder, reshard_after_forward=False, **placement)  # type: ignore[arg-type]
    wrapped = list(around)
    if not isinstance(module, FSDPModule):
        cast_to_master(module, master_dtype)
        fully_shard(module, **(on_device if id(module) in kept else on_host))  # type: ignore[arg-type]
        wrapped.append(module)
    for unit in wrapped:  # Hugging Face's generate runs the encoder, not forward: FSDP2 gathers around it too
        if callable(getattr(unit, "generate", None)):
            register_fsdp_forward_method(unit, "generate")
    after_inference = ReshardAfterInference()
    for unit in [*around, module]:
        after_inference.attach(unit)
    module.register_forward_pre_hook(frozen_in_their_dtype, prepend=True)  # before FSDP2's gathers
    if around:  # by name: the hook holds no module
        names = tuple(name for name, child in module.named_children() if any(child is h for h in around))
        module.register_forward_pre_hook(functools.partial(gather_children, names=names))
    materialize(module, mesh_device(mesh), initialize=initialize, init_fn=init_fn)
    if not user_wrapped:
        _SHARED_AT_SETUP[module] = device_share
    return module


# The share each model this process sharded was given, so that another fit of it is told why its share cannot change.
_SHARED_AT_SETUP: weakref.WeakKeyDictionary[nn.Module, float] = weakref.WeakKeyDictionary()


def cast_to_master(unit: nn.Module, master_dtype: torch.dtype | None) -> None:
    """Give ``unit``'s parameters not sharded yet the dtype of the master weights, which their shards become: bf16
    for every floating-point one (``cpu_state="bf16"``; frozen ones too, gathered in the compute dtype anyway), or
    fp32 for the trainable ones built in bf16/fp16 (the ZeRO-2 mode keeps fp32 masters of them too; frozen ones
    keep their storage, fp64 ones are left for the engine to refuse). One parameter at a time, so a model built in
    bf16 never stands whole in fp32. Buffers keep their dtype, as under AMP: RoPE's frequencies, batch norm's
    statistics."""
    if master_dtype is None:
        return
    for p in unit.parameters():
        if isinstance(p, DTensor) or not p.is_floating_point() or p.dtype == master_dtype:
            continue
        if master_dtype == torch.bfloat16 or (p.requires_grad and p.dtype.itemsize < master_dtype.itemsize):
            p.data = p.data.to(master_dtype)


def to_keeping_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype)`` for its parameters only (FSDP2's ``to`` on a module the user sharded)."""
    buffers = [(owner, name, b) for owner in module.modules() for name, b in owner._buffers.items() if b is not None]
    module.to(dtype)
    for owner, name, b in buffers:
        owner._buffers[name] = b


def device_units(module: nn.Module, units: list[nn.Module], device_share: float) -> list[nn.Module]:
    """The units of the device share: in the order their gradients arrive last in backward (the root, whose
    own parameters FSDP2 reduces at the very end, then the units in forward order), as many as keep the
    device's part within ``device_share`` of the parameters."""
    if not device_share:
        return []
    in_units = {id(p) for unit in units for p in unit.parameters()}
    sizes = [(module, sum(p.numel() for p in module.parameters() if id(p) not in in_units))]
    sizes += [(unit, _own_count(unit, units)) for unit in units]
    chosen = sizes[: count_within_share([size for _, size in sizes], device_share)]
    return [unit for unit, size in chosen if size]  # a root without parameters of its own keeps nothing anywhere


def holds_share(module: nn.Module, device_share: float) -> bool:
    """Whether ``module``, wrapped already (by the user, or at an earlier setup), keeps on the device exactly the
    units ``device_units`` picks for ``device_share``."""
    units = [m for m in module.modules() if isinstance(m, FSDPModule) and m is not module]
    resident = {id(m) for m in module.modules() if isinstance(m, FSDPModule) and not keeps_shards_on_host(m)}
    return {id(m) for m in device_units(module, units, device_share)} == resident


def device_resident(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module``'s FSDP2 units that keep their shards on the device (the device share)."""
    resident = []
    for m in module.modules():
        if isinstance(m, FSDPModule) and not keeps_shards_on_host(m):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                resident += [fsdp_param.sharded_param for fsdp_param in group.fsdp_params]
    return resident


def check_units(module: nn.Module) -> None:
    """Refuse FSDP units this mode cannot train: one with ``reshard_after_backward`` off
    (``set_reshard_after_backward(False)``): its unsharded parameters would outlive the step, which writes the
    shards in place, and the next forward would use the stale copy. ``reshard_after_forward`` (any value) is
    accepted: what it keeps after forward, backward reshards before the step. A unit without
    ``CPUOffloadPolicy`` keeps its shards on the device, as the device share's do, and steps there. FSDP2 2.13
    has no getter for the setting, so it is read from its parameter groups."""
    problems = []
    for name, m in module.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        where = name or "the root"
        for group in m._get_fsdp_state()._fsdp_param_groups:
            if not group.reshard_after_backward:
                problems.append(f"{where}: reshard_after_backward is off (fix: set_reshard_after_backward(True))")
    if problems:
        raise ValueError(
            "offload_params steps each rank's shard in place, so every FSDP unit must reshard after backward; "
            "your fully_shard calls give:\n  " + "\n  ".join(problems)
        )


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device ``fully_shard`` computes on for ``mesh``: the current accelerator of its type."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def _repeated_blocks(module: nn.Module) -> list[nn.Module]:
    no_split = set()
    for m in module.modules():
        no_split |= set(getattr(m, "_no_split_modules", None) or ())
    if no_split:
        named = _outermost(module, lambda m: m is not module and type(m).__name__ in no_split)
        if named:
            return named
    return [block for container in _outermost(module, _is_repeated) for block in container.children()]


def _outermost(module: nn.Module, qualifies) -> list[nn.Module]:
    """The modules that qualify with no qualifying module above them, in module order."""
    found: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if qualifies(m):
            found.append(m)
            return
        for child in m.children():
            visit(child)

    visit(module)
    return found


def _is_repeated(m: nn.Module) -> bool:
    children = list(m.children())
    return (
        isinstance(m, (nn.ModuleList, nn.Sequential))
        and len(children) >= 2
        and len({type(c) for c in children}) == 1
        and _count(children[0]) > 0
    )


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _own_count(unit: nn.Module, units: list[nn.Module]) -> int:
    """The parameters ``unit`` shards itself: those of the units nested in it are theirs."""
    nested = [other for other in units if other is not unit and any(m is other for m in unit.modules())]
    theirs = {id(p) for other in nested for p in other.parameters()}
    return sum(p.numel() for p in unit.parameters() if id(p) not in theirs)


def holders(module: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """The children of ``module`` wrapped as units of their own, so that they gather their parameters when called
    directly (a LightningModule's ``self.model`` or ``self.backbone`` after fit), not only from the root's hooks
    around the Trainer's steps: the child that holds every parameter of a root without parameters of its own, and
    any child that holds a unit (a submodel). Not a unit already, nor a container (never called itself), nor one
    without parameters outside its units, nor one sharing a parameter with a module outside it (a weight tied
    across children stays with the root)."""
    inner = {id(unit) for unit in units}
    holding = [child for child in module.children() if next(child.parameters(), None) is not None]
    sole = len(holding) == 1 and next(module.parameters(recurse=False), None) is None
    owners = _owners(module)
    return [
        child
        for child in holding
        if id(child) not in inner
        and getattr(child.forward, "__func__", None) is not nn.Module.forward  # torch.compile's is the instance's
        and (sole or any(id(m) in inner for m in child.modules()))
        and _own_count(child, units)
        and _shared_outside(child, owners) is None
    ]


def _owners(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Each parameter (by id) -> every (module, qualified name) that holds it, tied ones included."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, f"{path}.{name}" if path else name))
    return owners


def _shared_outside(unit: nn.Module, owners: dict[int, list[tuple[nn.Module, str]]]) -> str | None:
    """The name of a parameter of ``unit`` that a module outside it holds too, or None."""
    inside = {id(m) for m in unit.modules()}
    for p in unit.parameters():
        holders = owners[id(p)]
        if any(id(m) not in inside for m, _ in holders):
            return " = ".join(name for _, name in holders)
    return None


def _no_blocks(module: nn.Module, param_dtype: torch.dtype | None) -> str:
    count = _count(module)
    own = max((p.element_size() for p in module.parameters()), default=4)
    itemsize = param_dtype.itemsize if param_dtype is not None else own
    gathered, grads = count * itemsize / GIB, count * 4 / GIB
    return (
        f"found no repeated blocks in {type(module).__name__} (an nn.ModuleList or nn.Sequential of two or more "
        "modules of one class, or a Hugging Face model's _no_split_modules): its parameters would be one FSDP "
        f"unit, gathered whole on the device for forward and for backward: {gathered:.2f} GiB for its "
        f"{count:,} parameters in the compute dtype plus {grads:.2f} GiB of fp32 gradients, "
        f"{gathered + grads:.2f} GiB before any activation. Fix: put the layers in an nn.ModuleList, or call "
        "fully_shard yourself in configure_model on the modules to bring to the device one at a time (with "
        "CPUOffloadPolicy), or train with offload_params=False if the model fits the device."
    )
