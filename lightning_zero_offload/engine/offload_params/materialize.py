"""Giving a model built on the meta device its memory and its values, one unit at a time, never whole.

``materialize`` serves both modes. A model wrapped with ``fully_shard`` (the parameter-offload mode) gets
only this rank's shards, on the host (``CPUOffloadPolicy``), and its buffers on the mesh's device; a plain
module gets its tensors on ``device``, whole. The ZeRO-2 engine takes a model built on the meta device in two
steps instead (:class:`BlockwiseInit`): placeholders first, so the optimizer can be built over the parameters
the engine will hold, then the values unit by unit (its repeated blocks), each handed to the engine's master
weights as it is initialized: the host never holds more than one block whole, nor the device more than its
low-precision copy.

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
    sharded = any(isinstance(p, DTensor) for p in params)
    if sharded and not isinstance(module, FSDPModule):
        raise ValueError("materialize a sharded model from its root: call fully_shard on the root first.")
    plan = _init_plan(module, initialize, init_fn)
    blank_buffers = {(id(m), n) for m in module.modules() for n, b in m._buffers.items() if _blank(b)}
    kept_buffers = [(owner, name, b) for owner in module.modules() for name, b in owner._buffers.items() if _real(b)]
    ties = _ties(module)
    # FSDPModule.to_empty re-points FSDP2's padded shard storage: only this rank's shards are allocated
    module.to_empty(device="cpu" if sharded else device)
    for (first, first_name), *others in ties:  # to_empty gives each holder of a tied parameter its own copy
        for owner, name in others:
            owner._parameters[name] = first._parameters[first_name]
    with torch.no_grad():
        groups = _by_unit(plan, _unit_of(module, None))
        for scratch in _initialized(groups, blank_buffers, initialize, _dtype_if_sharded):
            for param, whole in scratch:
                _keep_own_rows(param, whole)
        for owner, name, buffer in kept_buffers:
            owner._buffers[name] = buffer
        if sharded:
            mesh = next(p for p in params if isinstance(p, DTensor)).device_mesh
            for owner in module.modules():
                for name, buffer in owner._buffers.items():
                    if buffer is not None:
                        owner._buffers[name] = _from_rank0(buffer.to(device), mesh)


Keep = Callable[[nn.Parameter, torch.Tensor], bool]


class BlockwiseInit:
    """A plain module built on the meta device, materialized for the ZeRO-2 engine in two steps.

    Constructing it gives every parameter a placeholder of its shape and dtype that holds no memory (a zero
    broadcast to its shape, on the host; the same object in every slot of a tied parameter), so an optimizer
    can be built over the parameters the engine will hold; ``optimizers`` built over the meta parameters
    before are given the placeholders in their place. Buffers get their memory on ``device``. What nothing
    can initialize (a module without ``reset_parameters()``) is refused now, before anything is allocated.

    :meth:`fill` then gives the values, unit by unit (``units``: the repeated blocks; what is outside them is
    the root's unit): each parameter initialized whole in a scratch tensor on the host, made rank 0's by
    ``rank0`` where several ranks train, and handed to ``keep(param, value)``, which returns True where the
    engine took it (into its master weights); any other parameter gets its own memory on ``device``.
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device | str,
        units: Collection[nn.Module] = (),
        optimizers: Iterable[torch.optim.Optimizer] = (),
    ) -> None:
        if not on_meta(module):
            raise ValueError("BlockwiseInit takes a model built on the meta device; this one has no meta tensor")
        self.module, self.device = module, torch.device(device)
        self._plan = _init_plan(module, True, None)
        self._units = _unit_of(module, units)
        self._blank_buffers = {(id(m), n) for m in module.modules() for n, b in m._buffers.items() if _blank(b)}
        self._placeholders: dict[int, nn.Parameter] = {}  # id of the meta parameter -> its placeholder
        for owner in module.modules():
            for name, p in list(owner._parameters.items()):
                if p is not None:
                    if id(p) not in self._placeholders:
                        empty = torch.zeros((), dtype=p.dtype).expand(p.shape)
                        self._placeholders[id(p)] = nn.Parameter(empty, requires_grad=p.requires_grad)
                    owner._parameters[name] = self._placeholders[id(p)]
            for name, b in list(owner._buffers.items()):
                if _blank(b):
                    owner._buffers[name] = torch.empty_like(b, device=self.device)
        self._built_dtypes = {id(p): p.dtype for p in self._placeholders.values()}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [self._placeholders.get(id(p), p) for p in group["params"]]

    @property
    def placeholder_ids(self) -> frozenset[int]:
        """The ids of the placeholders: expanded zeros, not tied elements (core/model_rules.py asks)."""
        return frozenset(self._built_dtypes)

    def fill(self, keep: Keep, rank0: Callable[[list[torch.Tensor]], None] | None = None) -> None:
        """Initialize the model unit by unit, each value to ``keep`` (see the class); then every buffer is rank
        0's (``rank0``: overwrite tensors with rank 0's values; None for one rank)."""
        groups = _by_unit(self._plan, self._units)
        with torch.no_grad():
            # In the dtype the model was built in: the engine has made its parameters low-precision views since.
            for scratch in _initialized(groups, self._blank_buffers, True, lambda p: self._built_dtypes.get(id(p))):
                if rank0 is not None:
                    rank0([whole for _, whole in scratch])
                for param, whole in scratch:
                    if not keep(param, whole):
                        param.data = whole.to(self.device)
            if rank0 is not None:
                rank0([b for m in self.module.modules() for b in m._buffers.values() if b is not None])


def on_meta(module: nn.Module) -> bool:
    """Whether ``module`` has tensors on the meta device; refuses a model whose parameters are partly there."""
    params = list(module.parameters())
    if any(p.is_meta for p in params) and not all(p.is_meta for p in params):
        names = [name for name, p in module.named_parameters() if p.is_meta]
        raise ValueError(
            f"{len(names)} of the model's {len(params)} parameters are on the meta device ({', '.join(names[:3])}"
            ", ...) and the others are not: build the whole model under init_module(empty_init=True) (or "
            "torch.device('meta'), or in configure_model), or none of it."
        )
    return any(t.is_meta for t in (*params, *module.buffers()))


def _blank(tensor: torch.Tensor | None) -> bool:
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


def _init_plan(module: nn.Module, initialize: bool, init_fn: InitFn | None) -> list[tuple[nn.Module, InitFn]]:
    """Which submodules to initialize, in order, and with what; refuses a module that owns tensors on
    the meta device and that nothing can initialize."""
    plan, refused = [], []
    for m, owner in _in_init_order(module):
        on_meta = {n for n, t in (*m._parameters.items(), *m._buffers.items()) if t is not None and t.is_meta}
        # A Hugging Face model's init visits every module, as its own initialize_weights does.
        wanted = (on_meta or owner is not None) if initialize else on_meta & m._non_persistent_buffers_set
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


def _unit_of(module: nn.Module, units: Collection[nn.Module] | None) -> dict[int, nn.Module]:
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


def _by_unit(
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


def _initialized(
    groups: Iterable[list[tuple[nn.Module, InitFn]]],
    blank_buffers: set[tuple[int, str]],
    initialize: bool,
    stands_in: Callable[[nn.Parameter], torch.dtype | None],
) -> Iterator[list[tuple[nn.Parameter, torch.Tensor]]]:
    """Run each group's initialization on whole scratch tensors standing in for the parameters that
    ``stands_in`` gives a dtype (the scratch's: the parameter's as built; None: initialized in place); yields
    each group's (parameter, scratch) pairs, for the caller to keep what it needs before the next group's
    scratch is made."""
    done: set[int] = set()
    for group in groups:
        with _whole(group, done, blank_buffers, initialize, stands_in) as scratch:
            for owner, init in group:
                init(owner)
        yield scratch


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
    back. What the group must
    initialize (its parameters, or with ``initialize=False`` its non-persistent buffers; ``blank_buffers``:
    the buffers ``to_empty`` allocated) starts as NaN, and a floating-point tensor still NaN afterwards is
    refused: an init that forgets a tensor would otherwise leave the garbage of ``to_empty`` in it."""
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
                stand_in = torch.empty(p.shape, dtype=dtype or p.dtype)
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
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
        yield list(scratch.values())
        done.update(scratch)
    finally:
        for owner, name, p in swapped:
            owner._parameters[name] = p
    # A buffer the init replaced (litgpt's reset_parameters assigns a new rope cache) is checked as it is now.
    now = [(o, n, o._buffers.get(n, t)) for o, n, t in fresh]
    if forgotten := [f"{type(o).__name__}.{n}" for o, n, t in now if _has_nan(t)]:
        raise ValueError(
            f"the initialization left {', '.join(forgotten)} unset (still NaN): reset_parameters() (or init_fn, or "
            "the Hugging Face model's _init_weights) must initialize every parameter of its module and recompute "
            "every buffer. Fix that function, or pass init_fn."
        )


def _has_nan(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds a NaN (max propagates NaN; no tensor of flags is made)."""
    return tensor.is_floating_point() and tensor.numel() > 0 and bool(tensor.max().isnan())


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
