"""Giving a model built on the meta device its memory and its values, one unit at a time, never whole.

``materialize`` serves both modes. A model wrapped with ``fully_shard`` (the parameter-offload mode) gets
only this rank's shards, on the host (``CPUOffloadPolicy``), and its buffers on the mesh's device; a plain
module gets its tensors on ``device``, whole. The ZeRO-2 engine takes a model built on the meta device in two
steps instead (engine/blockwise.py), with the planning and initialization here (``init_plan``,
``initialized``).

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

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

InitFn = Callable[[nn.Module], None]


def materialize(
    module: nn.Module, device: torch.device | str, *, initialize: bool = True, init_fn: InitFn | None = None
) -> None:
    """Allocate and initialize every tensor of ``module`` that is on the meta device (nothing to do when
    none is). ``device``: where a plain module's tensors and a sharded model's buffers go (the mesh's
    device); sharded parameters stay on the host. ``initialize=False`` leaves parameters and persistent
    buffers uninitialized, for pretrained weights to be loaded next (``pretrained.load_pretrained``); the
    non-persistent buffers, which no checkpoint holds, are computed either way."""
    device = torch.device(device)
    if not on_meta(module):
        return
    params = list(module.parameters())
    if not any(p.is_meta for p in params):
        _compute_meta_buffers(module, device)
        return
    sharded = any(isinstance(p, DTensor) for p in params)
    if sharded and not isinstance(module, FSDPModule):
        raise ValueError("materialize a sharded model from its root: call fully_shard on the root first.")
    plan = init_plan(module, initialize, init_fn)
    blank_buffers = {(id(m), n) for m in module.modules() for n, b in m._buffers.items() if is_blank(b)}
    kept_buffers = [(owner, name, b) for owner in module.modules() for name, b in owner._buffers.items() if _real(b)]
    ties = _ties(module)
    # The class and attributes of parameters (a no-weight-decay tag), which to_empty's new ones do not carry
    tags = {
        (id(m), n): (type(p), dict(p.__dict__))
        for m in module.modules()
        for n, p in m._parameters.items()
        if p is not None
    }
    # FSDPModule.to_empty re-points FSDP2's padded shard storage: only this rank's shards are allocated
    module.to_empty(device="cpu" if sharded else device)
    for (first, first_name), *others in ties:  # to_empty gives each holder of a tied parameter its own copy
        for owner, name in others:
            owner._parameters[name] = first._parameters[first_name]
    if not sharded:  # FSDP2's own parameters are DTensors: left as they are
        _retag(module, tags)
    with torch.no_grad():
        groups = by_unit(plan, unit_of(module, None))
        for scratch in initialized(groups, blank_buffers, initialize, _dtype_if_sharded):
            for param, whole in scratch:
                _keep_own_rows(param, whole)
            scratch = param = whole = None  # freed before the next unit's scratch is made
        for owner, name, buffer in kept_buffers:
            owner._buffers[name] = buffer
        if sharded:
            mesh = next(p for p in params if isinstance(p, DTensor)).device_mesh
            for owner in module.modules():
                for name, buffer in owner._buffers.items():
                    if buffer is not None:
                        owner._buffers[name] = _from_rank0(buffer.to(device), mesh)


def _retag(module: nn.Module, tags: dict[tuple[int, str], tuple[type, dict]]) -> None:
    """Give each parameter slot's parameter the class and attributes it had (the same new object for every
    holder of a tied one)."""
    done: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for n, p in list(m._parameters.items()):
            if p is None or (id(m), n) not in tags:
                continue
            if id(p) not in done:
                cls, attributes = tags[(id(m), n)]
                if type(p) is not cls:
                    p = nn.Parameter.__new__(cls, p.data, p.requires_grad)
                p.__dict__.update(attributes)
                done[id(m._parameters[n])] = p
            m._parameters[n] = done[id(m._parameters[n])]


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


def on_meta(module: nn.Module, partly: bool = False) -> bool:
    """Whether ``module`` has tensors on the meta device; refuses a model whose parameters are partly there
    unless ``partly`` (the ZeRO-2 mode takes such a model)."""
    params = list(module.parameters())
    if not partly and any(p.is_meta for p in params) and not all(p.is_meta for p in params):
        names = [name for name, p in module.named_parameters() if p.is_meta]
        raise ValueError(
            f"{len(names)} of the model's {len(params)} parameters are on the meta device ({', '.join(names[:3])}"
            ", ...) and the others are not: build the whole model under init_module(empty_init=True) (or "
            "torch.device('meta'), or in configure_model), or none of it."
        )
    return any(t.is_meta for t in (*params, *module.buffers()))


def is_blank(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.is_meta


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


def _is_hugging_face(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel``, recognised by its class names (the engine does not import
    transformers)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def _in_init_order(module: nn.Module) -> Iterator[tuple[nn.Module, nn.Module | None]]:
    """Every submodule with the Hugging Face model it belongs to (None outside one), in the order of
    its initialization: parents first, as ``module.modules()``; children first inside a Hugging Face model,
    as its ``smart_apply``."""
    seen: set[int] = set()

    def visit(m: nn.Module, owner: nn.Module | None) -> Iterator[tuple[nn.Module, nn.Module | None]]:
        if id(m) in seen:
            return
        seen.add(id(m))
        owner = m if _is_hugging_face(m) else owner
        if owner is None:
            yield m, None
        for child in m.children():
            yield from visit(child, owner)
        if owner is not None:
            yield m, owner

    yield from visit(module, None)


Pending = Callable[[nn.Module, str, torch.Tensor], bool]


def _is_meta(owner: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    return tensor.is_meta


def init_plan(
    module: nn.Module,
    initialize: bool,
    init_fn: InitFn | None,
    buffers_only: bool = False,
    pending: Pending = _is_meta,
) -> list[tuple[nn.Module, InitFn]]:
    """Which submodules to initialize, in order, and with what (``buffers_only``: the owners of buffers on the
    meta device, nothing else; ``pending``: whether a module's tensor still needs its values, by default
    whether it is on the meta device); refuses a module that owns such tensors and that nothing can
    initialize."""
    plan, refused = [], []
    for m, owner in _in_init_order(module):
        on_meta = {n for n, t in (*m._parameters.items(), *m._buffers.items()) if t is not None and pending(m, n, t)}
        # A Hugging Face model's init visits every module, as its own initialize_weights does.
        wanted = (on_meta or owner is not None) if initialize else on_meta & m._non_persistent_buffers_set
        if buffers_only:
            wanted = any(b is not None and b.is_meta for b in m._buffers.values())
        if not wanted:
            continue
        if init_fn is not None:
            plan.append((m, init_fn))
        elif owner is not None:
            plan.append((m, owner._init_weights))
        elif callable(getattr(m, "reset_parameters", None)):
            plan.append((m, _reset))
        else:
            refused.append(type(m).__name__)
    if refused:
        what = "parameters or buffers" if initialize else "non-persistent buffers (no checkpoint holds them)"
        raise ValueError(
            f"cannot initialize the {what} of {', '.join(sorted(set(refused)))}, built on the meta device: the "
            "module defines no reset_parameters(). Fix: give it a reset_parameters() that initializes its own "
            "parameters and recomputes its buffers (torch's convention for meta-device init), pass init_fn, "
            "create such buffers with an explicit device='cpu', or build the model without empty_init."
        )
    return plan


def _reset(module: nn.Module) -> None:
    module.reset_parameters()


def unit_of(module: nn.Module, units: Collection[nn.Module] | None) -> dict[int, nn.Module]:
    """Each submodule's unit: the nearest of ``units`` at or above it (None: each ``FSDPModule``), else the root."""
    chosen = None if units is None else {id(u) for u in units}
    unit_of: dict[int, nn.Module] = {}

    def visit(m: nn.Module, unit: nn.Module) -> None:
        if isinstance(m, FSDPModule) if chosen is None else id(m) in chosen:
            unit = m
        unit_of.setdefault(id(m), unit)
        for child in m.children():
            visit(child, unit)

    visit(module, module)
    return unit_of


def by_unit(
    plan: list[tuple[nn.Module, InitFn]], units: dict[int, nn.Module]
) -> Iterator[list[tuple[nn.Module, InitFn]]]:
    """The plan in runs of consecutive modules of one unit (the unit whose scratch tensors the host holds at
    once)."""
    run: list[tuple[nn.Module, InitFn]] = []
    for entry in plan:
        if run and units[id(entry[0])] is not units[id(run[0][0])]:
            yield run
            run = []
        run.append(entry)
    if run:
        yield run


def initialized(
    groups: Iterable[list[tuple[nn.Module, InitFn]]],
    blank_buffers: set[tuple[int, str]],
    initialize: bool,
    stands_in: Callable[[nn.Parameter], torch.dtype | None],
    done: Iterable[int] = (),
) -> Iterator[list[tuple[nn.Parameter, torch.Tensor]]]:
    """Run each group's initialization on whole scratch tensors standing in for the parameters that
    ``stands_in`` gives a dtype (the scratch's: the parameter's as built; None: initialized in place); yields
    each group's (parameter, scratch) pairs, for the caller to keep what it needs before the next group's
    scratch is made. ``done``: ids of parameters that have their values already (a throwaway tensor stands
    in for them)."""
    done = set(done)
    for group in groups:
        with _whole(group, done, blank_buffers, initialize, stands_in) as scratch:
            for owner, init in group:
                init(owner)
        yield scratch
        del scratch


@contextlib.contextmanager
def _whole(
    group: list[tuple[nn.Module, InitFn]],
    done: set[int],
    blank_buffers: set[tuple[int, str]],
    initialize: bool,
    stands_in: Callable[[nn.Parameter], torch.dtype | None],
) -> Iterator[list[tuple[nn.Parameter, torch.Tensor]]]:
    """Stand a whole scratch tensor on the host in for each parameter the group's modules own that
    ``stands_in`` gives a dtype, and a throwaway one for a parameter an earlier module initialized already (any
    other parameter is initialized in place); yields the (parameter, scratch) pairs and puts the parameters
    back. What the group must initialize (its parameters, or with ``initialize=False`` its non-persistent
    buffers; ``blank_buffers``: the buffers ``to_empty`` allocated) starts marked unset (NaN; an integer
    tensor its smallest value), and a tensor still so afterwards is refused: an init that forgets a tensor
    would otherwise leave the garbage of ``to_empty`` in it."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    scratch: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
    fresh: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for owner, _ in group:
            for name, p in list(owner._parameters.items()):
                if p is None:
                    continue
                first = id(p) not in done and id(p) not in scratch  # else a later owner of a shared one
                dtype = stands_in(p)
                if first and dtype is None:
                    done.add(id(p))
                    fresh += [(owner, name, p)] if initialize else []
                    continue
                stand_in = torch.empty(p.shape, dtype=dtype or p.dtype, device="cpu")
                if first:
                    scratch[id(p)] = (p, stand_in)
                    fresh += [(owner, name, stand_in)] if initialize else []
                owner._parameters[name] = nn.Parameter(stand_in, requires_grad=p.requires_grad)
                swapped.append((owner, name, p))
            fresh += [
                (owner, name, b)
                for name, b in owner._buffers.items()
                if (id(owner), name) in blank_buffers and (initialize or name in owner._non_persistent_buffers_set)
            ]
        for _, _, tensor in fresh:
            _mark_unset(tensor)
        yield list(scratch.values())
        done.update(scratch)
    finally:
        for owner, name, p in swapped:
            owner._parameters[name] = p
    # A buffer the init replaced (litgpt's reset_parameters assigns a new rope cache) is checked as it is now.
    now = [(o, n, o._buffers.get(n, t)) for o, n, t in fresh]
    if forgotten := [f"{type(o).__name__}.{n}" for o, n, t in now if _unset(t)]:
        raise ValueError(
            f"the initialization left {', '.join(forgotten)} unset (still NaN, or an integer tensor's smallest "
            "value everywhere): reset_parameters() (or init_fn, or "
            "the Hugging Face model's _init_weights) must initialize every parameter of its module and recompute "
            "every buffer. Fix that function, or pass init_fn."
        )


def _mark_unset(tensor: torch.Tensor) -> None:
    """Fill a tensor that the initialization must set with what it would never leave: NaN, or for integers
    their smallest value (a bool tensor starts False: nothing marks it)."""
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool and not tensor.is_complex():
        tensor.fill_(torch.iinfo(tensor.dtype).min)
    else:
        tensor.zero_()


def _unset(tensor: torch.Tensor) -> bool:
    """Whether a tensor marked by :func:`_mark_unset` was left so: a NaN anywhere (max propagates it), or every
    integer still the smallest value."""
    if tensor.numel() == 0:
        return False
    if tensor.is_floating_point():
        return bool(tensor.max().isnan())
    if tensor.dtype != torch.bool and not tensor.is_complex():
        return bool((tensor == torch.iinfo(tensor.dtype).min).all())
    return False


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
