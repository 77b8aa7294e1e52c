"""The forward pass of ``bf16-mixed`` / ``16-mixed`` when the device holds low-precision weights.

Under torch AMP (``strategy="auto"``) the module stays fp32 and ``torch.autocast`` casts the inputs of
matmul-like ops to bf16/fp16; every other op computes with the fp32 parameters. Under ``zero_offload``
the trainable parameters themselves are bf16/fp16 (the fp32 masters live on the CPU), while buffers and
tensors the model creates during forward stay fp32, exactly as under AMP. Left alone, every op other
than a matmul would then meet a low-precision weight where AMP has an fp32 one: norms and ops that
require one dtype fail (``index_add``, ``lerp``, ``nn.Bilinear``, ``spectral_norm``'s ``mv`` on the
CPU, ...), parametrizations compute in bf16, and the gradients of a parameter used many times are
summed in bf16.

The rule here: *every op sees what it sees under AMP on the fp32 model, with the weights rounded to the
low-precision dtype; the gradients of each parameter's uses are summed in fp32.* A ``TorchFunctionMode``
active during forward looks at each torch call's arguments for parameters of the device dtype (also one
level inside lists and tuples, and views of them made during the forward):

- ops that autocast runs in low precision on that device type (linear, matmul, conv, bmm, attention;
  :data:`_AUTOCAST_LOW_PRECISION`) and functions that feed the weights only to such ops
  (``multi_head_attention_forward``, the RNNs) get the parameter as it is: no copy. Its first such use in a
  forward is the parameter itself; later uses reach it through a zero-memory fp32 stand-in
  (:class:`_FloatGradientSum`) where autograd sums their gradients in fp32 before one rounding;
- ``embedding`` looks its rows up in low precision and returns them as fp32, as AMP's fp32 table does
  (exact; no fp32 copy of the table). On the CPU its backward sums repeated rows in fp32
  (torch's CPU kernel sums them in the table's dtype; the CUDA kernel already sums in fp32);
- view and selection ops (``.T``, ``view``, ``__getitem__``, ``chunk``, ``index_select``, ...) pass the
  parameter through; a view of a parameter then counts as that parameter for the ops that consume it,
  and a selection that copies returns its (exact) elements as fp32;
- ``zeros_like``/``new_zeros``-style factories without a dtype make fp32 tensors, as from AMP's fp32 weight;
- in-place ops leave their destination alone (a write to a parameter reaches the parameter);
- metadata and identity calls (``.shape``, ``.dtype``, ``.grad``, ``register_hook``, ...) see the parameter;
- every other op (elementwise, norms, reductions, ``lerp``, ``index_add``, ``dot`` on the CPU,
  parametrizations) gets an fp32 copy of the parameter, made once per parameter and forward and dropped
  when the forward ends, like autocast's cast cache: it computes in fp32 as under AMP, and autograd sums
  the gradients of all its uses in fp32 before the one cast back to bf16. (Without grad, each use makes
  its own copy, freed with it.)

The table of autocast ops only saves memory: an autocast op missing from it would get the fp32 copy and
autocast would round it back, to the same bf16 values. The fp32 copies cost 4 bytes per element of
every parameter used by such ops, from its first use to the end of the forward (longer where an op saves
it for backward); under AMP those parameters are fp32 all the time.

Activation checkpointing (``torch.utils.checkpoint``) recomputes a region during backward, outside this
context; torch restores autocast there but not torch function modes, so each checkpointed region the rule
touches recomputes under a rule of its own (non-reentrant: through the region's ``_CheckpointFrame``;
reentrant: through the ``run_function`` its ``CheckpointFunction`` keeps).

Plain torch: no Lightning imports; the Trainer and the Fabric precision plugins both use
:func:`forward_context`.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils.checkpoint import CheckpointFunction

try:  # what non-reentrant activation checkpointing keeps for its recomputation (torch private)
    from torch.utils.checkpoint import _CheckpointFrame
except ImportError:  # pragma: no cover - a torch that renamed it: checkpointed regions recompute without the rule
    _CheckpointFrame = None

LOW_PRECISION = (torch.bfloat16, torch.float16)

# Ops that autocast runs in low precision, by device type, as torch's Python API names them: torch 2.13's
# aten/src/ATen/autocast_mode.{cpp,h} (AutocastCPU's lower_precision_fp list; AT_FORALL_LOWER_PRECISION_FP for
# CUDA and XPU; AutocastMPS's list), plus the ``@`` operator. A device type not listed gets fp32 copies for
# every op: correct, at 4 bytes per element of each parameter used.
_MATMULS = frozenset({"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "addbmm", "baddbmm"})
_CONVS = frozenset(
    {"conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}
)
_RNN_CELLS = frozenset({"lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"})
_AUTOCAST_OPS: dict[str, frozenset[str]] = {
    "cpu": _MATMULS
    | _CONVS
    | {"_addmm_activation", "linalg_vecdot", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention"},
    "cuda": _MATMULS
    | _CONVS
    | _RNN_CELLS
    | {"convolution", "prelu", "addmv", "addr", "einsum", "mv", "linalg_vecdot", "chain_matmul", "linalg_multi_dot"}
    | {"scaled_dot_product_attention"},
    "mps": _MATMULS
    | (_CONVS - {"conv3d", "conv_transpose3d"})
    | {"convolution", "prelu", "addmv", "addr", "einsum", "mv", "chain_matmul", "linalg_multi_dot", "lstm_cell"},
}
_AUTOCAST_OPS["xpu"] = _AUTOCAST_OPS["cuda"]
# Plus the functions that feed the weights they are given to such ops only (inside a torch function's own
# implementation the mode is not active; autocast is): attention's input and output projections (linear), and
# the RNNs but on MPS (their cells' linear, cuDNN's autocast-wrapped kernel, oneDNN's RNN layer, autocast on the
# CPU). An RNN would otherwise copy its weights to fp32, and autocast round that copy back at every time step.
_RNNS = _RNN_CELLS | {"lstm", "gru", "rnn_tanh", "rnn_relu"}
_AUTOCAST_LOW_PRECISION: dict[str, frozenset[str]] = {
    device_type: ops | {"multi_head_attention_forward"} | (_RNNS if device_type != "mps" else frozenset())
    for device_type, ops in _AUTOCAST_OPS.items()
}
# Ops whose result is a view of their first argument: a parameter passes through them unchanged. The selections
# (advanced indexing, index_select, ...) copy; their elements are the parameter's, returned as fp32.
_VIEWS = frozenset(
    {"T", "mT", "H", "mH", "data", "real", "detach", "t", "transpose", "swapaxes", "swapdims", "permute", "movedim"}
    | {"moveaxis", "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "ravel", "contiguous"}
    | {"expand", "expand_as", "broadcast_to", "unsqueeze", "squeeze", "atleast_1d", "atleast_2d", "atleast_3d"}
    | {"narrow", "select", "__getitem__", "diagonal", "unfold", "chunk", "split", "split_with_sizes", "tensor_split"}
    | {"hsplit", "vsplit", "dsplit", "unbind", "index_select", "gather", "take", "take_along_dim", "masked_select"}
)
# Factories that take the dtype of their first argument unless given one.
_FACTORIES = frozenset(
    {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
    | {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
)
# Calls that read a tensor's metadata or act on the tensor object itself (plus every property but the views'
# and every ``is_*``/``register_*`` method).
_METADATA = frozenset(
    {"size", "dim", "ndimension", "numel", "nelement", "stride", "storage_offset", "element_size", "data_ptr"}
    | {"untyped_storage", "storage", "_typed_storage", "get_device", "__len__", "__format__", "__repr__", "tolist"}
    | {"item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "__reduce_ex__", "__deepcopy__"}
    | {"__setstate__", "__array__", "__dlpack__", "__dlpack_device__", "numpy", "requires_grad_", "retain_grad"}
    | {"backward", "share_memory_", "_is_view"}
)
_IN_PLACE_OPERATORS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__ifloordiv__", "__imod__"}
    | {"__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)

# Norm functions and the names of their weight/bias arguments (positional index, keyword): the CPU kernels take
# fp32 activations only with fp32 weights.
_NORMS: dict[Callable[..., Any], tuple[tuple[int, str], ...]] = {
    F.layer_norm: ((2, "weight"), (3, "bias")),
    F.group_norm: ((2, "weight"), (3, "bias")),
    F.batch_norm: ((3, "weight"), (4, "bias")),
    F.instance_norm: ((3, "weight"), (4, "bias")),
    F.rms_norm: ((2, "weight"),),
}

# How the mode treats a torch function (see the module docstring).
_PASS, _VIEW, _FACTORY, _EMBEDDING, _AUTOCAST, _IN_PLACE, _FP32 = range(7)

_EMBEDDING_SIGNATURE = inspect.signature(F.embedding)
_REENTRANT_CHECKPOINT_FORWARD = CheckpointFunction.forward.__code__
_KINDS: dict[str, dict[Callable, int]] = {}  # device type -> torch function -> its kind


def _kind(func: Callable, autocast_ops: frozenset[str]) -> int:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):  # a property: ``Tensor.T.__get__``, ``Tensor.grad.__set__``
        prop = getattr(getattr(func, "__self__", None), "__name__", "")
        return _VIEW if name == "__get__" and prop in _VIEWS else _PASS
    if name in _VIEWS:
        return _VIEW
    if name in _METADATA or name.startswith(("is_", "register_")):
        return _PASS
    if name in _FACTORIES:
        return _FACTORY
    if func is F.embedding:
        return _EMBEDDING
    if name in autocast_ops:
        return _AUTOCAST
    if name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__")):
        return _IN_PLACE
    return _FP32


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
        return value.float()
    return value


class _FloatGradientSum(torch.autograd.Function):
    """An fp32 stand-in for a parameter that holds no data (a broadcast scalar). The uses routed through it
    (:class:`_LowPrecisionUse`) send their gradients to it, where autograd sums them in fp32; its backward
    rounds the sum to the parameter's dtype once."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor) -> torch.Tensor:
        ctx.param_dtype = param.dtype
        return param.new_zeros((), dtype=torch.float32).expand(param.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(ctx.param_dtype)


class _LowPrecisionUse(torch.autograd.Function):
    """The parameter itself (an alias, no copy), whose gradient goes to the fp32 ``grad_sum`` instead."""

    @staticmethod
    def forward(ctx: Any, grad_sum: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.float(), None


class _EmbeddingSummedInFloat(torch.autograd.Function):
    """``F.embedding`` of a low-precision table returning fp32 rows, whose backward sums the gradients of repeated
    indices in fp32 (torch's CPU kernel sums them in the table's dtype)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, indices: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.num_weights, ctx.weight_dtype = weight.shape[0], weight.dtype
        padding_idx = options["padding_idx"]
        ctx.padding_idx = -1 if padding_idx is None else padding_idx % weight.shape[0]
        ctx.scale_grad_by_freq = options["scale_grad_by_freq"]
        return F.embedding(indices, weight, **options).float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (indices,) = ctx.saved_tensors
        grad_weight = torch.ops.aten.embedding_dense_backward(
            grad.float(), indices, ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq
        )
        return grad_weight.to(ctx.weight_dtype), None, None


def _rule_active() -> bool:
    return any(isinstance(mode, _RoundedWeights) for mode in _get_current_function_mode_stack())


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


class _RoundedWeights(TorchFunctionMode):
    """Runs every op as AMP runs it on the fp32 model, with the weights rounded to ``dtype`` (module docstring).

    Per forward (cleared on exit) it keeps the fp32 copy of each parameter, the fp32 gradient stand-ins of those
    used more than once by autocast ops, and the views of parameters made so far. The copies and stand-ins are
    dropped when a backward reaches one of them, so a forward after an optimizer step inside the same context
    (manual optimization) copies the updated weights.
    """

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.device_type, self.dtype = device_type, dtype
        self.autocast_ops = _AUTOCAST_LOW_PRECISION.get(device_type, frozenset())
        self.kinds = _KINDS.setdefault(device_type, {})
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
            kind = self.kinds[func] = _kind(func, self.autocast_ops)
        if kind == _PASS:
            return func(*args, **kwargs)
        if kind == _VIEW:
            return self._view(func, args, kwargs)
        if kind == _EMBEDDING:
            return self._embedding(args, kwargs)
        if kind == _FACTORY:
            if args and "dtype" not in kwargs and self._source(args[0]) is not None:
                if torch.is_grad_enabled():
                    self._cover_checkpoint()
                kwargs = {**kwargs, "dtype": torch.float32}
            return func(*args, **kwargs)
        route = self._autocast_use if kind == _AUTOCAST else self._float_use
        args = self._routed(args, route, start=1 if kind == _IN_PLACE else 0)
        if kwargs:
            kwargs = {key: value if key == "out" else self._routed_value(value, route) for key, value in kwargs.items()}
        slots = _NORMS.get(func) if kind == _FP32 else None
        if slots is not None:  # a low-precision weight that is no parameter (computed in bf16) is upcast too
            args = list(args)
            for index, name in slots:
                if index < len(args):
                    args[index] = _upcast(args[index])
                elif name in kwargs:
                    kwargs[name] = _upcast(kwargs[name])
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
            grad_sum = _FloatGradientSum.apply(param)
            grad_sum.register_hook(self._backward_reached)
            entry = self.grad_sums[id(param)] = (param, grad_sum)
        alias = _LowPrecisionUse.apply(entry[1], param)
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
        return _upcast(out)  # a selection copied the parameter's elements: exact in fp32

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
            return _EmbeddingSummedInFloat.apply(weight, indices, options)
        return _upcast(F.embedding(*args, **kwargs))

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
            if _rule_active():  # a backward called inside the forward context (manual optimization)
                return function(*args, **kwargs)
            with _RoundedWeights(device_type, dtype):
                return function(*args, **kwargs)

        under_rule.under_rounded_weights = True  # type: ignore[attr-defined]
        return under_rule


def _takes_grad_requiring_activation(args: tuple) -> bool:
    return any(type(a) is torch.Tensor and a.requires_grad for a in args)


def forward_context(device_type: str, dtype: torch.dtype) -> AbstractContextManager:
    """The context a training/evaluation forward runs in for device parameters of ``dtype``.

    fp32 parameters need nothing; bf16/fp16 parameters get autocast plus the rule of the module docstring
    (a forward_context entered inside another adds autocast only).
    """
    if dtype not in LOW_PRECISION:
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(torch.autocast(device_type, dtype=dtype))
    if not _rule_active():
        stack.enter_context(_RoundedWeights(device_type, dtype))
    return stack
