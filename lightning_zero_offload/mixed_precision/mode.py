"""The torch function mode that runs every op of a forward as AMP runs it on the fp32 model, and the
recomputation of checkpointed regions under it."""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils.checkpoint import CheckpointFunction

from lightning_zero_offload.mixed_precision.functions import (
    EmbeddingSummedInFloat,
    FloatGradientSum,
    LowPrecisionUse,
    upcast,
)
from lightning_zero_offload.mixed_precision.rules import (
    AUTOCAST,
    AUTOCAST_LOW_PRECISION,
    EMBEDDING,
    FACTORY,
    FP32,
    IN_PLACE,
    KINDS,
    LOW_PRECISION,
    NORMS,
    PASS,
    VIEW,
    kind_of,
)

try:  # what non-reentrant activation checkpointing keeps for its recomputation (torch private)
    from torch.utils.checkpoint import _CheckpointFrame
except ImportError:  # pragma: no cover - a torch that renamed it: checkpointed regions recompute without the rule
    _CheckpointFrame = None

_EMBEDDING_SIGNATURE = inspect.signature(F.embedding)
_REENTRANT_CHECKPOINT_FORWARD = CheckpointFunction.forward.__code__


def rule_active() -> bool:
    return any(isinstance(mode, RoundedWeights) for mode in _get_current_function_mode_stack())


def _checkpoint_frame(pack_hook: Callable) -> Any:
    """The ``_CheckpointFrame`` whose saved-tensor hook is ``pack_hook`` (None if it is no checkpoint's)."""
    if _CheckpointFrame is None:
        return None
    for cell in getattr(pack_hook, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(contents, _CheckpointFrame):
            return contents
    return None


class RoundedWeights(TorchFunctionMode):
    """Runs every op as AMP runs it on the fp32 model, with the weights rounded to ``dtype`` (module docstring).

    Per forward (cleared on exit) it keeps the fp32 copy of each parameter, the fp32 gradient stand-ins of those
    used more than once by autocast ops, and the views of parameters made so far. The copies and stand-ins are
    dropped when a backward reaches one of them, so a forward after an optimizer step inside the same context
    (manual optimization) copies the updated weights.
    """

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.device_type, self.dtype = device_type, dtype
        self.autocast_ops = AUTOCAST_LOW_PRECISION.get(device_type, frozenset())
        self.kinds = KINDS.setdefault(device_type, {})
        self.float_copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # grad mode only: no_grad copies anew
        self.grad_sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.used_in_autocast: set[int] = set()
        # id(view) -> (weak reference to the view, its parameter, the function that makes it from another base)
        self.views: dict[int, tuple[weakref.ref, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]] = {}
        self.last_pack_hook: Callable | None = None

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.float_copies.clear()
        self.grad_sums.clear()
        self.used_in_autocast.clear()
        self.views.clear()
        self.last_pack_hook = None

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not torch.is_grad_enabled() and _takes_grad_requiring_activation(args):
            self._cover_reentrant_checkpoint()
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = kind_of(func, self.autocast_ops)
        if kind == PASS:
            return func(*args, **kwargs)
        if kind == VIEW:
            return self._view(func, args, kwargs)
        if kind == EMBEDDING:
            return self._embedding(args, kwargs)
        if kind == FACTORY:
            if args and "dtype" not in kwargs and self._source(args[0]) is not None:
                if torch.is_grad_enabled():
                    self._cover_checkpoint()
                kwargs = {**kwargs, "dtype": torch.float32}
            return func(*args, **kwargs)
        # Inside torch.autocast(enabled=False) AMP's matmul gets the fp32 weight, as any other op does.
        autocast = kind == AUTOCAST and torch.is_autocast_enabled(self.device_type)
        route = self._autocast_use if autocast else self._float_use
        args = self._routed(args, route, start=1 if kind == IN_PLACE else 0)
        if kwargs:
            kwargs = {key: value if key == "out" else self._routed_value(value, route) for key, value in kwargs.items()}
        slots = NORMS.get(func) if kind == FP32 else None
        if slots is not None:  # a low-precision weight that is no parameter (computed in bf16) is upcast too
            args = list(args)
            for index, name in slots:
                if index < len(args):
                    args[index] = upcast(args[index])
                elif name in kwargs:
                    kwargs[name] = upcast(kwargs[name])
        return func(*args, **kwargs)

    # -- finding parameters among the arguments

    def _source(self, value: Any) -> tuple[torch.Tensor, Callable | None] | None:
        """(parameter, how ``value`` is made from it) if ``value`` is a low-precision parameter or a view of one."""
        if type(value) is torch.Tensor:  # most arguments; isinstance(x, nn.Parameter) runs Python code
            entry = self.views.get(id(value)) if self.views else None
            if entry is not None and entry[0]() is value:
                return entry[1], entry[2]
        elif isinstance(value, nn.Parameter) and value.dtype == self.dtype:
            return value, None
        return None

    def _routed(self, values: tuple | list, route: Callable, start: int = 0) -> tuple | list:
        routed = None
        for index in range(start, len(values)):
            value = values[index]
            new = self._routed_value(value, route)
            if new is not value:
                if routed is None:
                    routed = list(values)
                routed[index] = new
        if routed is None:
            return values
        return routed if isinstance(values, list) else tuple(routed)

    def _routed_value(self, value: Any, route: Callable) -> Any:
        if isinstance(value, torch.Tensor):
            source = self._source(value)
            return value if source is None else route(value, *source)
        if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):  # torch.cat([w1, w2]), RNN weights
            return self._routed(value, route)
        return value

    # -- the routes

    def _float_use(self, value: torch.Tensor, param: torch.Tensor, replay: Callable | None) -> torch.Tensor:
        if torch.is_grad_enabled():
            self._cover_checkpoint()
            entry = self.float_copies.get(id(param))
            if entry is None:
                copy = param.float()
                if copy.requires_grad:
                    copy.register_hook(self._backward_reached)
                entry = self.float_copies[id(param)] = (param, copy)
            copy = entry[1]
        else:  # nothing to sum gradients for: a copy per use, freed with it
            copy = param.float()
        return copy if replay is None else replay(copy)

    def _autocast_use(self, value: torch.Tensor, param: torch.Tensor, replay: Callable | None) -> torch.Tensor:
        if not (torch.is_grad_enabled() and param.requires_grad):
            return value
        self._cover_checkpoint()
        if id(param) not in self.used_in_autocast:  # the first use: the parameter itself
            self.used_in_autocast.add(id(param))
            return value
        entry = self.grad_sums.get(id(param))
        if entry is None:
            grad_sum = FloatGradientSum.apply(param)
            grad_sum.register_hook(self._backward_reached)
            entry = self.grad_sums[id(param)] = (param, grad_sum)
        alias = LowPrecisionUse.apply(entry[1], param)
        return alias if replay is None else replay(alias)

    def _view(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        source = self._source(args[0]) if args else None
        out = func(*args, **kwargs)
        if source is None:
            return out
        if torch.is_grad_enabled():
            self._cover_checkpoint()
        param, replay = source
        if isinstance(out, torch.Tensor):
            return self._derived(out, args[0], param, self._replay(func, args, kwargs, replay, None))
        if isinstance(out, (tuple, list)):  # chunk, split, unbind
            parts = [
                self._derived(part, args[0], param, self._replay(func, args, kwargs, replay, index))
                for index, part in enumerate(out)
            ]
            return parts if isinstance(out, list) else type(out)(parts)
        return out

    def _derived(self, out: Any, arg: torch.Tensor, param: torch.Tensor, replay: Callable) -> Any:
        if not isinstance(out, torch.Tensor) or out is arg:
            return out
        if out.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():  # a view, .data, detach
            key = id(out)
            self.views[key] = (weakref.ref(out, lambda _: self.views.pop(key, None)), param, replay)
            return out
        return upcast(out)  # a selection copied the parameter's elements: exact in fp32

    @staticmethod
    def _replay(
        func: Callable, args: tuple, kwargs: dict, previous: Callable | None, index: int | None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def replay(base: torch.Tensor) -> torch.Tensor:
            out = func(base if previous is None else previous(base), *args[1:], **kwargs)
            return out if index is None else out[index]

        return replay

    def _embedding(self, args: tuple, kwargs: dict) -> torch.Tensor:
        bound = _EMBEDDING_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        indices, weight = options.pop("input"), options.pop("weight")
        if (
            weight.dtype in LOW_PRECISION
            and weight.device.type == "cpu"
            and weight.requires_grad
            and torch.is_grad_enabled()
            and not options["sparse"]
        ):
            self._cover_checkpoint()
            return EmbeddingSummedInFloat.apply(weight, indices, options)
        return upcast(F.embedding(*args, **kwargs))

    def _backward_reached(self, grad: torch.Tensor) -> None:
        """A backward ran through this forward's copies: an optimizer step may follow, so later uses copy anew."""
        self.float_copies.clear()
        self.grad_sums.clear()

    # -- activation checkpointing: the recomputation in backward runs outside this context

    def _cover_checkpoint(self) -> None:
        """Inside a non-reentrant checkpointed region, make its recomputation run under a rule too."""
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is None or hooks[0] is self.last_pack_hook:
            return
        self.last_pack_hook = hooks[0]
        frame = _checkpoint_frame(hooks[0])
        if frame is not None and not getattr(frame.recompute_fn, "under_rounded_weights", False):
            frame.recompute_fn = self._under_rule(frame.recompute_fn)

    def _cover_reentrant_checkpoint(self) -> None:
        """Inside a reentrant checkpointed region (its forward runs without grad on inputs that require it),
        make its recomputation run under a rule too."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code is not _REENTRANT_CHECKPOINT_FORWARD:
            frame = frame.f_back
        if frame is None:
            return
        ctx = frame.f_locals.get("ctx")
        run_function = getattr(ctx, "run_function", None)
        if run_function is not None and not getattr(run_function, "under_rounded_weights", False):
            ctx.run_function = self._under_rule(run_function)

    def _under_rule(self, function: Callable) -> Callable:
        device_type, dtype = self.device_type, self.dtype

        def under_rule(*args: Any, **kwargs: Any) -> Any:
            if rule_active():  # a backward called inside the forward context (manual optimization)
                return function(*args, **kwargs)
            with RoundedWeights(device_type, dtype):
                return function(*args, **kwargs)

        under_rule.under_rounded_weights = True  # type: ignore[attr-defined]
        return under_rule


def _takes_grad_requiring_activation(args: tuple) -> bool:
    return any(type(a) is torch.Tensor and a.requires_grad for a in args)
