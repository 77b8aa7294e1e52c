"""Argument checks of the kernels, and :class:`AdamArgs`, the hyperparameter record checked once.

Every message names the argument and says what to pass instead. The kernels trust what passed: the
native code writes through raw pointers.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch import Tensor

from lightning_zero_offload.kernels import _native

LOW_PRECISION = (torch.bfloat16, torch.float16)
GRAD_DTYPES = (torch.float32, *LOW_PRECISION)


def check_threads(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {n!r}")
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    return int(n)


def real(name: str, value: object) -> float:
    if type(value) is not float:  # the common case skips the slow ABC check
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
        value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class AdamArgs:
    """The hyperparameters of an Adam kernel call, checked once, when the record is built.

    Every Adam kernel takes one (``hparams=``). Build it once per param group and step and pass it to
    every bucket's call: neither the checks nor the C struct (``lzo_adam_hparams``, field for field)
    are redone per call. Numbers are stored as Python floats; ``adamw_mode`` selects decoupled decay
    (AdamW) over the L2 term (Adam).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    maximize: bool = False
    c_struct: Any = field(init=False, repr=False, compare=False)  # None without the native extension

    def __post_init__(self) -> None:
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay"):
            object.__setattr__(self, name, real(name, getattr(self, name)))
        object.__setattr__(self, "adamw_mode", bool(self.adamw_mode))
        object.__setattr__(self, "maximize", bool(self.maximize))
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0 (it keeps the update finite where exp_avg_sq is 0), got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        fields = (self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, self.adamw_mode, self.maximize)
        c_struct = None if _native.ffi is None else _native.ffi.new("lzo_adam_hparams *", fields)
        object.__setattr__(self, "c_struct", c_struct)


@dataclass(frozen=True)
class AdamCall:
    """A checked fused-Adam call over lists of tensors, as a backend gets it (``adam_step``,
    ``adam_step_multi`` and its ``_if_finite`` variant); ``table`` holds each tensor's C record
    (:func:`adam_table`)."""

    hparams: AdamArgs
    table: list[tuple[int, ...]]
    params: Sequence[Tensor]
    grads: Sequence[Tensor]
    exp_avgs: Sequence[Tensor]
    exp_avg_sqs: Sequence[Tensor]
    steps: Sequence[int] | Sequence[Tensor]
    grad_scale: float
    num_threads: int
    params_out: Sequence[Tensor] | None = None
    extrapolate: float = 0.0


@dataclass(frozen=True)
class FlatAdamCall:
    """A checked call on one flat tensor of each kind (``adam_undo``, ``adam_step_bf16_state``, whose
    stochastic rounding takes ``seed`` and ``offset``)."""

    hparams: AdamArgs
    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: int
    grad_scale: float
    num_threads: int
    seed: int = 0
    offset: int = 0


def check_args(hparams: object) -> None:
    if type(hparams) is not AdamArgs:
        raise TypeError(
            f"hparams must be a kernels.AdamArgs (built once per param group and step), got {type(hparams).__name__}"
        )


def check_step(name: str, step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"{name} must be an int (the 1-based count of this update), got {step!r}")
    if step < 1:
        raise ValueError(f"{name} must be >= 1 (the first update is step 1), got {step}")
    return int(step)


def check_steps(steps: Sequence[int] | Sequence[Tensor], count: int) -> Sequence[int] | Sequence[Tensor]:
    """One step per param: ints >= 1, or torch's ``state["step"]`` tensors (checked with the tensors)."""
    if len(steps) != count:
        raise ValueError(f"steps has {len(steps)} entries but params has {count}; pass one per param")
    if steps and isinstance(steps[0], Tensor):
        return steps
    if all(type(s) is int and s >= 1 for s in steps):
        return steps
    return [check_step(f"steps[{i}]", s) for i, s in enumerate(steps)]


def check_seed_and_offset(seed: object, offset: object) -> None:
    for name, value, limit in (("seed", seed, 1 << 64), ("offset", offset, 1 << 62)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if not 0 <= value < limit:
            raise ValueError(f"{name} must be in [0, 2**{limit.bit_length() - 1}), got {value}")


def check_tensor(
    name: str,
    t: object,
    dtypes: tuple[torch.dtype, ...],
    numel: int | None = None,
    numel_of: str = "",
    device: torch.device | None = None,
) -> None:
    """A dense contiguous tensor of one of ``dtypes`` (of ``numel`` elements, as ``numel_of``): on the CPU for the
    CPU kernels, on ``device`` for the device share's step (kernels/device.py)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, the call's first tensor on {device}: keep one call on one device")
    if (device is None and t.device.type != "cpu") or t.layout != torch.strided:
        raise ValueError(
            f"{name} is a {t.layout} tensor on {t.device}; the CPU kernels need dense CPU tensors "
            "(use .cpu() / .to_dense())"
        )
    if t.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected {expected}")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} is not contiguous; the kernels update memory in place, so pass a contiguous tensor "
            "(for example a view of a flat buffer) rather than a strided view"
        )
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements but {numel_of} has {numel}; sizes must match")


def check_bf16_state_call(
    hparams: AdamArgs,
    grad_scale: object,
    step: object,
    seed: object,
    offset: object,
    tensors: tuple[object, object, object, object],
    device: torch.device | None = None,
) -> tuple[float, int]:
    """The arguments of a bf16-state step (param, grad, exp_avg, exp_avg_sq; ``device`` as :func:`check_tensor`'s);
    returns (grad_scale, step) as numbers."""
    check_args(hparams)
    grad_scale, step = real("grad_scale", grad_scale), check_step("step", step)
    check_seed_and_offset(seed, offset)
    param, grad, exp_avg, exp_avg_sq = tensors
    check_tensor("param", param, (torch.bfloat16,), device=device)
    numel = param.numel()  # type: ignore[attr-defined]
    check_tensor("grad", grad, GRAD_DTYPES, numel, "param", device)
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        check_tensor(name, t, (torch.bfloat16,), numel, "param", device)
    return grad_scale, step


def check_extrapolate(extrapolate: float, has_out: bool) -> None:
    if extrapolate != 0.0 and not has_out:
        raise ValueError(
            "extrapolate only changes the low-precision copy; pass param_out/params_out, or extrapolate=0.0"
        )


def bad_counter(index: int, counter: Tensor) -> ValueError:
    return ValueError(f"steps[{index}] holds {float(counter)}; a step count must be >= 0 before the update")


def adam_table(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    params_out: Sequence[Tensor] | None,
    steps: Sequence[int] | Sequence[Tensor],
    plural: bool,
) -> list[tuple[int, ...]]:
    """Validate the tensors of one Adam call; returns the rows of the C table (lzo_adam_tensor).

    One fast pass that checks and collects at once; only if it fails does _explain_bad_tensors look
    for the culprit, so a valid call with hundreds of tensors costs little Python time.
    """
    count = len(params)
    others = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "params_out": params_out}
    for name, tensors in others.items():
        if tensors is not None and len(tensors) != count:
            raise ValueError(f"{name} has {len(tensors)} tensors but params has {count}; pass one per param")
    if count == 0:
        return []
    f32 = torch.float32
    counters = isinstance(steps[0], Tensor)
    grad_dtype = getattr(grads[0], "dtype", None)
    out_dtype = None if params_out is None else getattr(params_out[0], "dtype", None)
    rows = []
    try:
        for p, g, m, v, o, step in zip(
            params, grads, exp_avgs, exp_avg_sqs, params_out or itertools.repeat(None), steps
        ):
            n = p.numel()
            if not (
                p.is_cpu
                and g.is_cpu
                and m.is_cpu
                and v.is_cpu
                and p.dtype is f32
                and g.dtype is grad_dtype
                and m.dtype is f32
                and v.dtype is f32
                and p.is_contiguous()
                and g.is_contiguous()
                and m.is_contiguous()
                and v.is_contiguous()
                and g.numel() == n
                and m.numel() == n
                and v.numel() == n
                and (o is None or (o.is_cpu and o.dtype is out_dtype and o.is_contiguous() and o.numel() == n))
            ):
                break
            if counters:
                if not (step.is_cpu and step.dtype is f32 and step.dim() == 0):
                    break
                step, counter = 0, step.data_ptr()
            else:
                counter = 0
            out = 0 if o is None else o.data_ptr()
            rows.append((p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), out, n, step, counter))
    except (AttributeError, RuntimeError):  # not a tensor, or a layout without strides
        pass
    if len(rows) == count and grad_dtype in GRAD_DTYPES and (params_out is None or out_dtype in LOW_PRECISION):
        return rows
    _explain_bad_tensors(params, grads, exp_avgs, exp_avg_sqs, params_out, steps, plural)


def _explain_bad_tensors(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    params_out: Sequence[Tensor] | None,
    steps: Sequence[int] | Sequence[Tensor],
    plural: bool,
) -> NoReturn:
    """Raise the error that names the first invalid tensor of an Adam call and says how to fix it."""
    if isinstance(steps[0], Tensor):
        for i, step in enumerate(steps):
            if not (isinstance(step, Tensor) and step.is_cpu and step.dtype is torch.float32 and step.dim() == 0):
                raise TypeError(
                    f"steps[{i}] must be a 0-dim float32 CPU tensor (torch's state['step']) like steps[0]; "
                    "or pass every step as an int"
                )
    f32 = (torch.float32,)
    lists = [("grad", grads, GRAD_DTYPES), ("exp_avg", exp_avgs, f32), ("exp_avg_sq", exp_avg_sqs, f32)]
    if params_out is not None:
        lists.append(("param_out", params_out, LOW_PRECISION))
    for i, param in enumerate(params):
        param_name = f"params[{i}]" if plural else "param"
        check_tensor(param_name, param, f32)
        for name, tensors, dtypes in lists:
            check_tensor(f"{name}s[{i}]" if plural else name, tensors[i], dtypes, param.numel(), param_name)
    raise TypeError("all grads of one call must share a dtype, as must all params_out; split the call by dtype")
