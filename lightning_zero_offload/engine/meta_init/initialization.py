"""Initializing a model built on the meta device one unit at a time, for both modes (engine/meta_init/blockwise.py,
engine/offload_params/materialize.py): which modules to initialize and with what (``init_plan``: each
module's ``reset_parameters()``, a Hugging Face model's ``_init_weights``, or ``init_fn``), in runs of one
unit (``unit_of``, ``by_unit``), each parameter initialized whole in a scratch tensor standing in for it
(``initialized``), and every tensor an init must set checked afterwards (still NaN, or an integer tensor's
smallest value: refused).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_zero_offload.engine.meta_init.peft_adapters import adapter_layers, adapter_modules, adapter_plan

InitFn = Callable[[nn.Module], None]


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


def with_data(param: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter of ``param``'s class, ``requires_grad`` and attributes (a no-weight-decay tag that
    configure_optimizers reads) holding ``data``."""
    new = nn.Parameter.__new__(type(param), data, param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new


def allocate(param: nn.Parameter, device: torch.device | str) -> nn.Parameter:
    """Memory on ``device`` for a parameter on the meta device, in place (``torch.utils.swap_tensors``: every
    module holding it, a tied weight, and an optimizer built over it see it) and returned; where a weak
    reference to it forbids that, a new parameter, for the caller to put in its slots."""
    real = with_data(param, torch.empty_like(param, device=device))
    try:
        torch.utils.swap_tensors(param, real)
    except RuntimeError:
        return real
    return param


def is_blank(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.is_meta


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
    # PEFT's adapters are left out of the model's plan and initialized after it, as PEFT does (peft_adapters.py)
    adapters = adapter_layers(module)
    theirs = {id(m) for layer, _ in adapters for m in adapter_modules(layer)}
    for m, owner in _in_init_order(module):
        if id(m) in theirs:
            continue
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
    if initialize and not buffers_only:
        plan += adapter_plan(adapters, pending)
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
    # Buffers that have their values (loaded with the weights, kept from __init__): an init must not reset them.
    kept = [
        (owner, name, b, b.clone())
        for owner, _ in group
        for name, b in owner._buffers.items()
        if b is not None and not b.is_meta and (id(owner), name) not in blank_buffers
    ]
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
        for owner, name, b, value in kept:
            b.copy_(value)
            owner._buffers[name] = b
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
