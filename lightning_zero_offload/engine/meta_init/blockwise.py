"""A plain module built on the meta device, for the ZeRO-2 engine: placeholders first, so that an optimizer can
be built over the parameters the engine will hold, then the values unit by unit (its repeated blocks), each
handed to the engine's master weights as it is initialized: the host never holds more than one block whole,
nor the device more than its low-precision copy. The planning and the initialization are
engine/meta_init/initialization.py's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterable

import torch
from torch import nn

from lightning_zero_offload.engine.meta_init.initialization import (
    by_unit,
    init_plan,
    initialized,
    is_blank,
    on_meta,
    unit_of,
    with_data,
)

__all__ = ["BlockwiseInit"]

Keep = Callable[[nn.Parameter, torch.Tensor], bool]


class BlockwiseInit:
    """A plain module built on the meta device, materialized for the ZeRO-2 engine in two steps.

    Constructing it gives every parameter on the meta device a placeholder of its shape, dtype, class and
    attributes that holds no memory (a zero broadcast to its shape, on the host; the same object in every slot
    of a tied parameter), so an optimizer can be built over the parameters the engine will hold; ``optimizers``
    built over the meta parameters before are given the placeholders in their place. Parameters built
    elsewhere (layers made in ``__init__``) keep their values. Buffers on the meta device get their memory on
    ``device``. What nothing can initialize (a module without ``reset_parameters()``) is refused now, before
    anything is allocated.

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
        if not on_meta(module, partly=True):
            raise ValueError("BlockwiseInit takes a model built on the meta device; this one has no meta tensor")
        # Weakly: a front end may keep this beside the module, in a mapping that must not keep the module alive.
        self._module, self.device = weakref.ref(module), torch.device(device)
        init_plan(module, True, None)  # refuses now what nothing can initialize; planned again in fill
        self._units = list(units)
        self._blank_buffers = {(id(m), n) for m in module.modules() for n, b in m._buffers.items() if is_blank(b)}
        self._placeholders: dict[int, nn.Parameter] = {}  # id of the meta parameter -> its placeholder
        self._meta_and_placeholder: list[tuple[nn.Parameter, nn.Parameter]] = []  # for undo
        # Parameters built outside the meta device (layers made in __init__, the rest in configure_model) keep
        # their values: the engine takes them as they are.
        self._real = {id(p) for p in module.parameters() if not p.is_meta}
        for owner in module.modules():
            for name, p in list(owner._parameters.items()):
                if p is not None and p.is_meta:
                    if id(p) not in self._placeholders:
                        self._placeholders[id(p)] = _placeholder(p)
                        self._meta_and_placeholder.append((p, self._placeholders[id(p)]))
                    owner._parameters[name] = self._placeholders[id(p)]
            for name, b in list(owner._buffers.items()):
                if is_blank(b):
                    owner._buffers[name] = torch.empty_like(b, device=self.device)
        self._built_dtypes = {id(p): p.dtype for p in self._placeholders.values()}
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [self._placeholders.get(id(p), p) for p in group["params"]]

    def undo(self) -> None:
        """Put the meta parameters and buffers back (setup failed before the engine took the model): a later
        use of the module sees a model on the meta device again, not the placeholders' zeros."""
        module = self._module()
        if module is None:
            return
        originals = {id(placeholder): meta for meta, placeholder in self._meta_and_placeholder}
        for owner in module.modules():
            for name, p in list(owner._parameters.items()):
                if p is not None and id(p) in originals:
                    owner._parameters[name] = originals[id(p)]
            for name, b in list(owner._buffers.items()):
                if (id(owner), name) in self._blank_buffers and b is not None:
                    owner._buffers[name] = torch.empty_like(b, device="meta")

    def real_tensors(self) -> list[torch.Tensor]:
        """The parameters built outside the meta device and the buffers not waiting for their values, each once
        and in module order: made rank 0's before the engine takes them."""
        module = self._module()
        assert module is not None
        found: dict[int, torch.Tensor] = {}
        for owner in module.modules():
            for p in owner._parameters.values():
                if p is not None and id(p) in self._real:
                    found.setdefault(id(p), p)
            for name, b in owner._buffers.items():
                if b is not None and (id(owner), name) not in self._blank_buffers:
                    found.setdefault(id(b), b)
        return list(found.values())

    @property
    def placeholder_ids(self) -> frozenset[int]:
        """The ids of the placeholders: expanded zeros, not tied elements (core/model_rules.py asks)."""
        return frozenset(self._built_dtypes)

    def fill(
        self,
        keep: Keep,
        rank0: Callable[[list[torch.Tensor]], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Initialize the model unit by unit, each value to ``keep`` (see the class), a value it does not take
        to its parameter's own memory on ``device`` (default: the device given at construction); then every
        buffer is rank 0's (``rank0``: overwrite tensors with rank 0's values; None for one rank)."""
        device = device or self.device
        module = self._module()
        if module is None:
            raise RuntimeError("the model of this BlockwiseInit is gone")
        dtypes, blank = self._built_dtypes, self._blank_buffers
        plan = init_plan(module, True, None, pending=lambda m, n, t: id(t) in dtypes or (id(m), n) in blank)
        groups = by_unit(plan, unit_of(module, self._units))
        with torch.no_grad():
            # In the dtype the model was built in: the engine has made its parameters low-precision views since.
            stands_in = self._built_dtypes.get
            for scratch in initialized(groups, self._blank_buffers, True, lambda p: stands_in(id(p)), self._real):
                if rank0 is not None:
                    rank0([whole for _, whole in scratch])
                for param, whole in scratch:
                    if not keep(param, whole):
                        param.data = whole.to(device)
                scratch = param = whole = None  # freed before the next unit's scratch is made
            if rank0 is not None:
                rank0([b for m in module.modules() for b in m._buffers.values() if b is not None])


def _placeholder(param: nn.Parameter) -> nn.Parameter:
    """A parameter like ``param`` whose memory is one zero element (expanded to its shape)."""
    return with_data(param, torch.zeros((), dtype=param.dtype, device="cpu").expand(param.shape))
