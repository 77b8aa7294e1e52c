"""The forward pass of ``bf16-mixed`` / ``16-mixed`` when the device holds low-precision weights.

Under torch AMP (``strategy="auto"``) the module stays fp32 and ``torch.autocast`` casts the inputs of
matmul-like ops to bf16/fp16. Under ``zero_offload`` the trainable parameters themselves are bf16/fp16
(the fp32 masters live on the CPU), while buffers (BatchNorm running statistics, rotary/positional
caches) and tensors the model creates during forward stay fp32, exactly as under AMP. Autocast covers
matmul-like ops; the ops it leaves alone and that require one dtype across their arguments are the
norms, which then meet bf16 weights next to fp32 inputs or fp32 running statistics and fail
("mixed dtype (CPU): expect parameter to have scalar type of Float", "expected scalar type BFloat16
but found Float").

The rule here: *the forward computes what autocast computes on the fp32 model, with the weights
rounded to the low-precision dtype.* Concretely, while the forward runs:

- norm functions (``layer_norm``, ``group_norm``, ``batch_norm``, ``instance_norm``, ``rms_norm``)
  get their low-precision weight and bias upcast to fp32, as they are under AMP (a differentiable
  cast of a few small vectors; the gradient flows back to the bf16 parameter);
- ``embedding`` returns fp32 rows, as under AMP (the lookup happens in bf16, then the rows are
  upcast: exact, and no fp32 copy of the table is made).

Everything else sees the low-precision parameters as they are: matmul-like ops are autocast anyway,
and elementwise ops with a parameter follow torch type promotion. docs/mixed-precision.md explains the
alternatives (casting buffers too, as DeepSpeed does) and what they cost.

Plain torch: no Lightning imports; the Trainer and the Fabric precision plugins both use
:func:`forward_context`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

LOW_PRECISION = (torch.bfloat16, torch.float16)

# Norm functions and the names of their parameter arguments (positional index, keyword).
_NORMS: dict[Callable[..., Any], tuple[tuple[int, str], ...]] = {
    F.layer_norm: ((2, "weight"), (3, "bias")),
    F.group_norm: ((2, "weight"), (3, "bias")),
    F.batch_norm: ((3, "weight"), (4, "bias")),
    F.instance_norm: ((3, "weight"), (4, "bias")),
    F.rms_norm: ((2, "weight"),),
}


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
        return value.float()
    return value


class _MasterDtypeNorms(TorchFunctionMode):
    """Runs norms with fp32 weights and returns fp32 embeddings: the ops autocast does not cover."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        slots = _NORMS.get(func)
        if slots is not None:
            args = list(args)
            for index, name in slots:
                if index < len(args):
                    args[index] = _upcast(args[index])
                elif name in kwargs:
                    kwargs[name] = _upcast(kwargs[name])
            return func(*args, **kwargs)
        if func is F.embedding:
            return _upcast(func(*args, **kwargs))
        return func(*args, **kwargs)


def forward_context(device_type: str, dtype: torch.dtype) -> AbstractContextManager:
    """The context a training/evaluation forward runs in for device parameters of ``dtype``.

    fp32 parameters need nothing; bf16/fp16 parameters get autocast plus the norm/embedding rule above.
    """
    if dtype not in LOW_PRECISION:
        return nullcontext()
    stack = ExitStack()
    stack.enter_context(torch.autocast(device_type, dtype=dtype))
    stack.enter_context(_MasterDtypeNorms())
    return stack
