"""CPU kernels of the offload step: a fused Adam/AdamW update and gradient accumulation.

Why native code: torch's fused CPU AdamW already runs a plain fp32 step at memory bandwidth, but the
offload step around it (cast the bf16/fp16 grads, unscale and clip, step, cast the params back)
takes several passes and >= 48 B/param. :func:`adam_step` does all of it in one pass of 28 B/param,
and :func:`grad_accumulate` computes the gradient norm and the inf/nan check in the same pass that
copies gradients into the CPU buffer.

Every kernel has one Python signature, implemented twice: by the C extension
``lightning_zero_offload._native`` (built when the package is installed; AVX-512, AVX2 or portable
code chosen at import) and by torch ops, used when the extension is missing or when
``set_backend("torch")``/``LZO_BACKEND=torch`` asks for it. Arguments are validated up front; the
kernels work in place on the caller's memory and never on a hidden copy.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

try:
    from lightning_zero_offload._native import ffi, lib
except ImportError as _error:
    ffi = lib = None
    _import_error: ImportError | None = _error
else:
    _import_error = None

__all__ = [
    "AdamHyperparams",
    "adam_step",
    "adam_step_bf16_state",
    "adam_step_multi",
    "adam_step_multi_if_finite",
    "adam_undo",
    "available_backends",
    "backend",
    "bandwidth_probe",
    "can_undo",
    "fingerprint16",
    "get_num_threads",
    "grad_accumulate",
    "set_backend",
    "set_num_threads",
    "sum_of_squares",
]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, *_LOW_PRECISION)
if lib is not None:
    _DTYPE_CODES = {
        torch.float32: lib.LZO_FLOAT32,
        torch.bfloat16: lib.LZO_BFLOAT16,
        torch.float16: lib.LZO_FLOAT16,
    }
    _ISAS = {"avx512": lib.LZO_ISA_AVX512, "avx2": lib.LZO_ISA_AVX2, "scalar": lib.LZO_ISA_SCALAR}
else:
    _DTYPE_CODES, _ISAS = {}, {}


def _default_num_threads() -> int:
    """The cores this process may run on (not OMP_NUM_THREADS, which torchrun sets to 1)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


_num_threads = _default_num_threads()
_backend = "torch"


def available_backends() -> list[str]:
    """Backends this CPU and build can run, fastest first; ``"torch"`` is always last."""
    return [name for name, isa in _ISAS.items() if lib.lzo_isa_supported(isa)] + ["torch"]


def backend() -> str:
    """The active path: ``"avx512"``, ``"avx2"``, ``"scalar"`` (native) or ``"torch"`` (fallback)."""
    return _backend


def set_backend(name: str) -> None:
    """Force a path (tests, benchmarks). Raises ValueError naming the choices if it cannot run here."""
    global _backend
    choices = available_backends()
    if name not in choices:
        raise ValueError(f"backend {name!r} is not available on this machine; choose one of {choices}")
    if name != "torch":
        lib.lzo_set_isa(_ISAS[name])
    _backend = name


def set_num_threads(n: int) -> None:
    """Default thread count of the native kernels (initially the cores this process may use).

    The torch fallback ignores it: torch ops use ``torch.set_num_threads``.
    """
    global _num_threads
    _num_threads = _check_threads("n", n)


def get_num_threads() -> int:
    """Thread count used when a call passes ``num_threads=None``."""
    return _num_threads


# --------------------------------------------------------------------------------------------------
# argument checks: every message names the argument and says what to pass instead


def _check_threads(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {n!r}")
    if n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    return int(n)


def _real(name: str, value: object) -> float:
    if type(value) is not float:  # the common case skips the slow ABC check
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
        value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class AdamHyperparams:
    """The hyperparameters of one Adam/AdamW param group, validated once, here.

    The one record of them in the package: the kernels take it (``hparams=``) or build it from their
    separate keywords, CPUAdam and the offload engine read it from ``param_groups`` with
    :meth:`from_param_group`, and it is the C struct ``lzo_adam_hparams`` field for field. Numbers
    are stored as Python floats; ``adamw_mode`` selects decoupled decay (AdamW) over the L2 term
    (Adam).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    maximize: bool = False

    def __post_init__(self) -> None:
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay"):
            object.__setattr__(self, name, _real(name, getattr(self, name)))
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

    @classmethod
    def from_param_group(cls, group: Mapping[str, Any], adamw_mode: bool) -> AdamHyperparams:
        """The record of a torch Adam/AdamW/CPUAdam param group (``lr``, ``betas``, ``eps``, ...).

        ``adamw_mode`` comes from the caller, who knows which optimizer owns the group. ``float()``
        first, so a tensor learning rate (which torch allows) is read as its value.
        """
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw_mode=adamw_mode,
            maximize=group.get("maximize", False),
        )

    def _c_struct(self) -> Any:
        return ffi.new(
            "lzo_adam_hparams *",
            (self.lr, self.beta1, self.beta2, self.eps, self.weight_decay, self.adamw_mode, self.maximize),
        )


def _check_step(name: str, step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"{name} must be an int (the 1-based count of this update), got {step!r}")
    if step < 1:
        raise ValueError(f"{name} must be >= 1 (the first update is step 1), got {step}")
    return int(step)


def _check_tensor(
    name: str, t: object, dtypes: tuple[torch.dtype, ...], numel: int | None = None, numel_of: str = ""
) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.layout != torch.strided:
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


def _check_extrapolate(extrapolate: float, has_out: bool) -> None:
    if extrapolate != 0.0 and not has_out:
        raise ValueError(
            "extrapolate only changes the low-precision copy; pass param_out/params_out, or extrapolate=0.0"
        )


def _resolve_hparams(hparams: AdamHyperparams | None, **keywords: Any) -> AdamHyperparams:
    """The record of a kernel call: ``hparams`` as given, or one built from the separate keywords."""
    if hparams is None:
        missing = [name for name, value in keywords.items() if value is None and name != "maximize"]
        if missing:
            raise TypeError(
                f"missing hyperparameters {', '.join(missing)}: pass them as keywords, "
                "or pass hparams=AdamHyperparams(...)"
            )
        if keywords["maximize"] is None:
            del keywords["maximize"]
        return AdamHyperparams(**keywords)
    if not isinstance(hparams, AdamHyperparams):
        raise TypeError(f"hparams must be an AdamHyperparams, got {type(hparams).__name__}")
    given = [name for name, value in keywords.items() if value is not None]
    if given:
        raise TypeError(f"pass hparams or the separate hyperparameters, not both (also got {', '.join(given)})")
    return hparams


def _adam_table(
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
    if len(rows) == count and grad_dtype in _GRAD_DTYPES and (params_out is None or out_dtype in _LOW_PRECISION):
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
    lists = [("grad", grads, _GRAD_DTYPES), ("exp_avg", exp_avgs, f32), ("exp_avg_sq", exp_avg_sqs, f32)]
    if params_out is not None:
        lists.append(("param_out", params_out, _LOW_PRECISION))
    for i, param in enumerate(params):
        param_name = f"params[{i}]" if plural else "param"
        _check_tensor(param_name, param, f32)
        for name, tensors, dtypes in lists:
            _check_tensor(f"{name}s[{i}]" if plural else name, tensors[i], dtypes, param.numel(), param_name)
    raise TypeError("all grads of one call must share a dtype, as must all params_out; split the call by dtype")


# --------------------------------------------------------------------------------------------------
# public kernels


def adam_step(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    hparams: AdamHyperparams | None = None,
    lr: float | None = None,
    beta1: float | None = None,
    beta2: float | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    adamw_mode: bool | None = None,
    maximize: bool | None = None,
    grad_scale: float = 1.0,
    param_out: Tensor | None = None,
    extrapolate: float = 0.0,
    num_threads: int | None = None,
) -> None:
    """One Adam (``adamw_mode=False``, L2) or AdamW (decoupled decay) update, in place.

    The hyperparameters are either ``hparams`` (an :class:`AdamHyperparams`, already validated) or
    the separate keywords ``lr, beta1, beta2, eps, weight_decay, adamw_mode`` and optionally
    ``maximize`` (default False), not both. Follows torch's single-tensor Adam/AdamW order of
    operations, with the gradient first multiplied by ``grad_scale`` (the engine's unscale x clip
    factor). ``param``, ``exp_avg`` and ``exp_avg_sq``
    are contiguous fp32 CPU tensors; ``grad`` is fp32, bf16 or fp16. If ``param_out`` (bf16 or fp16)
    is given, it receives the updated param rounded to nearest even in the same pass: the
    low-precision copy that goes back to the accelerator. With ``extrapolate`` it receives
    ``p_new + extrapolate * (p_new - p_old)`` instead (the master ``param`` is unaffected): Delayed
    Parameter Update's weight prediction, at no extra memory traffic.
    """
    hp = _resolve_hparams(
        hparams,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adamw_mode=adamw_mode,
        maximize=maximize,
    )
    grad_scale, extrapolate = _real("grad_scale", grad_scale), _real("extrapolate", extrapolate)
    _check_extrapolate(extrapolate, param_out is not None)
    step = _check_step("step", step)
    nt = _num_threads if num_threads is None else _check_threads("num_threads", num_threads)
    outs = None if param_out is None else [param_out]
    table = _adam_table([param], [grad], [exp_avg], [exp_avg_sq], outs, [step], plural=False)
    _adam_impl(table, [param], [grad], [exp_avg], [exp_avg_sq], outs, [step], hp, grad_scale, extrapolate, nt)


def adam_step_multi(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[int] | Sequence[Tensor],
    *,
    hparams: AdamHyperparams | None = None,
    lr: float | None = None,
    beta1: float | None = None,
    beta2: float | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    adamw_mode: bool | None = None,
    maximize: bool | None = None,
    grad_scale: float = 1.0,
    params_out: Sequence[Tensor] | None = None,
    extrapolate: float = 0.0,
    num_threads: int | None = None,
) -> None:
    """:func:`adam_step` over many tensors in ONE native call (pointer arrays, threads split the total).

    Why: a model has hundreds of small tensors, and a call per tensor would cost more in Python and
    thread wake-ups than the update itself. ``steps[i]`` is tensor i's own step number (torch keeps
    one per param), either as an int >= 1 or as torch's ``state["step"]`` tensor (0-dim float32,
    the count before this update), which the call increments in place: then counting steps costs
    no Python work per tensor. All grads must share a dtype, as must all ``params_out``.
    """
    hp = _resolve_hparams(
        hparams,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adamw_mode=adamw_mode,
        maximize=maximize,
    )
    grad_scale, extrapolate = _real("grad_scale", grad_scale), _real("extrapolate", extrapolate)
    _check_extrapolate(extrapolate, params_out is not None)
    if len(steps) != len(params):
        raise ValueError(f"steps has {len(steps)} entries but params has {len(params)}; pass one per param")
    counters = bool(steps) and isinstance(steps[0], Tensor)
    if not counters and not all(type(s) is int and s >= 1 for s in steps):
        steps = [_check_step(f"steps[{i}]", s) for i, s in enumerate(steps)]
    nt = _num_threads if num_threads is None else _check_threads("num_threads", num_threads)
    table = _adam_table(params, grads, exp_avgs, exp_avg_sqs, params_out, steps, plural=True)
    if table:
        _adam_impl(table, params, grads, exp_avgs, exp_avg_sqs, params_out, steps, hp, grad_scale, extrapolate, nt)


def adam_step_multi_if_finite(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[int],
    *,
    hparams: AdamHyperparams,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
) -> tuple[float, bool]:
    """:func:`adam_step_multi` with fp32 grads, applied only if every gradient is finite.

    Returns ``(sum of squares of the grads, applied)``. The norm and the inf/nan check ride along with
    the update: each 256 KiB chunk of gradients is summed as it is brought into cache and updated from
    there, so they need no pass over memory of their own (one would add 4 bytes per parameter to an
    fp32 step's 28). If a gradient is inf or nan, nothing stays changed: the chunks updated before that
    was seen are taken back with :func:`adam_undo`'s arithmetic (to within about one fp32 ulp), and
    ``applied`` is False. Needs hyperparameters a step can be undone with (:func:`can_undo`).
    """
    grad_scale = _real("grad_scale", grad_scale)
    if len(steps) != len(params):
        raise ValueError(f"steps has {len(steps)} entries but params has {len(params)}; pass one per param")
    steps = [_check_step(f"steps[{i}]", s) for i, s in enumerate(steps)]
    nt = _num_threads if num_threads is None else _check_threads("num_threads", num_threads)
    if any(g.dtype != torch.float32 for g in grads):
        raise TypeError("adam_step_multi_if_finite takes fp32 grads only (its rollback reads them in fp32)")
    if not can_undo(hparams):
        raise ValueError("this AdamW step has lr * weight_decay == 1, which zeroes the params: it cannot be undone")
    table = _adam_table(params, grads, exp_avgs, exp_avg_sqs, None, steps, plural=True)
    if not table:
        return 0.0, True
    if _backend == "torch":
        sumsq = sum(sum_of_squares(g)[0] for g in grads)
        if not math.isfinite(sumsq):
            return math.inf, False
        _torch_adam(params, grads, exp_avgs, exp_avg_sqs, None, steps, hparams, grad_scale, 0.0)
        return sumsq, True
    out = ffi.new("double *")
    status = lib.lzo_adam_step_checked(
        hparams._c_struct(), grad_scale, ffi.new("lzo_adam_tensor[]", table), len(table), nt, out
    )
    if status == -2:
        raise MemoryError("adam_step_multi_if_finite could not allocate its per-chunk bookkeeping")
    return out[0], status == 0


def grad_accumulate(
    dst: Tensor,
    src: Tensor,
    *,
    scale: float = 1.0,
    overwrite: bool = False,
    num_threads: int | None = None,
) -> tuple[float, bool]:
    """``dst = src * scale`` (``overwrite``) or ``dst += src * scale``, in one pass over memory.

    Returns the sum of squares of ``dst`` after the update (accumulated in double; the same value
    for any thread count) and whether ``dst`` now holds an inf or nan, so the gradient norm and the
    overflow check need no second pass. ``dst`` is contiguous fp32; ``src`` is fp32, bf16 or fp16.
    """
    scale = _real("scale", scale)
    nt = _num_threads if num_threads is None else _check_threads("num_threads", num_threads)
    _check_tensor("dst", dst, (torch.float32,))
    _check_tensor("src", src, _GRAD_DTYPES, dst.numel(), "dst")
    if _backend == "torch":
        sumsq = _torch_grad_accumulate(dst, src, scale, bool(overwrite))
    else:
        sumsq = lib.lzo_grad_accumulate(
            ffi.cast("float *", dst.data_ptr()),
            ffi.cast("void *", src.data_ptr()),
            dst.numel(),
            _DTYPE_CODES[src.dtype],
            scale,
            bool(overwrite),
            nt,
        )
    # A finite float squared is < 2^256, so the double sum is finite iff every element is.
    return sumsq, not math.isfinite(sumsq)


def sum_of_squares(src: Tensor, *, num_threads: int | None = None) -> tuple[float, bool]:
    """The sum of squares of ``src`` and whether it holds an inf or nan, reading it once and writing nothing.

    Bitwise what :func:`grad_accumulate` returns when it overwrites a buffer of the same size with
    ``src`` (scale 1): the norm of a gradient that is used where it lies instead of being copied.
    ``src`` is contiguous fp32, bf16 or fp16.
    """
    nt = _num_threads if num_threads is None else _check_threads("num_threads", num_threads)
    _check_tensor("src", src, _GRAD_DTYPES)
    if _backend == "torch":
        sumsq = float(torch.linalg.vector_norm(src, dtype=torch.float64)) ** 2
    else:
        sumsq = lib.lzo_sum_squares(ffi.cast("void *", src.data_ptr()), src.numel(), _DTYPE_CODES[src.dtype], nt)
    return sumsq, not math.isfinite(sumsq)


def fingerprint16(words: Tensor, *, num_threads: int | None = None) -> Tensor:
    """A checksum of 16-bit words: ``sum(words[i] * (i + 1)) mod 2**64`` (signed words), as a 0-dim int64.

    Any single changed word and any swap of two different words change it; it is integer arithmetic,
    so it is the same on every backend, device and thread count. On a CPU tensor the native kernel
    computes it in one pass; elsewhere torch does, from row and column sums (no model-sized temporary),
    and the result stays on the device (no synchronisation).
    """
    if words.dtype != torch.int16 or not words.is_contiguous():
        raise TypeError(f"words must be a contiguous int16 tensor (a .view(torch.int16)), got {words.dtype}")
    if words.device.type == "cpu" and _backend != "torch":
        nt = _num_threads if num_threads is None else _check_threads("num_threads", num_threads)
        value = lib.lzo_fingerprint16(ffi.cast("void *", words.data_ptr()), words.numel(), nt)
        return torch.tensor(value - (1 << 64) if value >= 1 << 63 else value, dtype=torch.int64)
    return _torch_fingerprint16(words)


def adam_undo(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    hparams: AdamHyperparams,
    step: int,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
) -> None:
    """Take back one :func:`adam_step` made with these arguments (fp32 grads, step number ``step``).

    For a speculated step that validation rejected (clipping triggered, overflow). The step computes,
    per element, in fp32 (torch's order of operations)::

        g  = grad * grad_scale            (+ p0 * wd   for Adam's L2 decay)
        m1 = m0 + w (g - m0)              w = 1 - beta1
        v1 = beta2 v0 + (1 - beta2) g^2
        p1 = p0 * decay - step_size * m1 / (sqrt(v1) / sqrt(bc2) + eps)     decay = 1 - lr wd (AdamW)

    and every line can be solved for the old value from the new one and the gradient. This does it in
    float64 and rounds once, so ``param``, ``exp_avg`` and ``exp_avg_sq`` return to within about one
    fp32 ulp of their values before the step (the step's own rounding cannot be recovered). With
    ``beta1`` or ``beta2`` 0 the old moment did not influence the new one and is restored as 0. Native
    and torch backends give the same bits; the native one is one vectorised pass over the step's memory
    (its cost relative to the step: docs/benchmarks.md). A step that zeroed the params (AdamW with
    ``lr * weight_decay == 1``, see :func:`can_undo`) raises ValueError.
    """
    grad_scale, step = _real("grad_scale", grad_scale), _check_step("step", step)
    nt = _num_threads if num_threads is None else _check_threads("num_threads", num_threads)
    _check_tensor("param", param, (torch.float32,))
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_tensor(name, t, (torch.float32,), param.numel(), "param")
    if not can_undo(hparams):
        raise ValueError("this AdamW step had lr * weight_decay == 1, which zeroes the params: it cannot be undone")
    if _backend == "torch":
        _torch_adam_undo(param, grad, exp_avg, exp_avg_sq, hparams, step, grad_scale)
        return
    pointers = (ffi.cast("float *", t.data_ptr()) for t in (param, grad, exp_avg, exp_avg_sq))
    lib.lzo_adam_undo(hparams._c_struct(), grad_scale, float(step), *pointers, param.numel(), nt)


def can_undo(hparams: AdamHyperparams) -> bool:
    """Whether :func:`adam_undo` can take back a step with these hyperparameters (not when it zeroed the params)."""
    return _adamw_decay(hparams) != 0.0


def adam_step_bf16_state(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    seed: int,
    offset: int = 0,
    hparams: AdamHyperparams | None = None,
    lr: float | None = None,
    beta1: float | None = None,
    beta2: float | None = None,
    eps: float | None = None,
    weight_decay: float | None = None,
    adamw_mode: bool | None = None,
    maximize: bool | None = None,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
) -> None:
    """:func:`adam_step` on bf16 state: ``param``, ``exp_avg``, ``exp_avg_sq`` are bf16, updated in place.

    Each element is widened to fp32 and updated with exactly :func:`adam_step`'s fp32 arithmetic (the
    same constants and operations), and the new p, m and v are stored with stochastic rounding: 16
    random bits are added below the kept bf16 mantissa and the rest is truncated, so each value rounds
    up with the probability of the dropped fraction and its expectation is the fp32 value. Without it,
    updates below half a bf16 ulp (a 2^-9 relative change) would be lost: the params would stop moving
    and ``exp_avg_sq``, which decays by ``beta2`` a step, would never shrink. ``param`` is also the copy
    to publish to the accelerator: there is no separate low-precision output.

    The random bits are a counter-based hash of ``(seed, step, offset + i)`` for element i, never a
    global generator: a run is bitwise reproducible and resumes bitwise from ``(seed, step)``, and the
    result does not depend on the thread count, the instruction set (every backend, torch included,
    gives the same bits) or how a flat buffer is split into calls, as long as each call passes the
    global index of its first element as ``offset``. ``seed`` is in ``[0, 2**64)``.

    ``grad`` is fp32 (an accumulated buffer), bf16 or fp16, multiplied by ``grad_scale`` first. NaN
    is stored as the quiet NaN ``0x7fc0``; inf stays inf; a finite fp32 value becomes inf only if it
    lies above the largest finite bf16, with the probability of rounding up; zeros keep their sign, and
    subnormals are rounded like any other value (bf16 has fp32's exponent range).
    """
    hp = _resolve_hparams(
        hparams,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        adamw_mode=adamw_mode,
        maximize=maximize,
    )
    grad_scale, step = _real("grad_scale", grad_scale), _check_step("step", step)
    for name, value, limit in (("seed", seed, 1 << 64), ("offset", offset, 1 << 62)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r}")
        if not 0 <= value < limit:
            raise ValueError(f"{name} must be in [0, 2**{limit.bit_length() - 1}), got {value}")
    nt = _num_threads if num_threads is None else _check_threads("num_threads", num_threads)
    _check_tensor("param", param, (torch.bfloat16,))
    _check_tensor("grad", grad, _GRAD_DTYPES, param.numel(), "param")
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _check_tensor(name, t, (torch.bfloat16,), param.numel(), "param")
    if _backend == "torch":
        _torch_adam_bf16_state(param, grad, exp_avg, exp_avg_sq, hp, step, int(seed), int(offset), grad_scale)
        return
    lib.lzo_adam_step_bf16state(
        hp._c_struct(),
        grad_scale,
        int(seed),
        step,
        int(offset),
        ffi.cast("uint16_t *", param.data_ptr()),
        ffi.cast("void *", grad.data_ptr()),
        ffi.cast("uint16_t *", exp_avg.data_ptr()),
        ffi.cast("uint16_t *", exp_avg_sq.data_ptr()),
        param.numel(),
        _DTYPE_CODES[grad.dtype],
        nt,
    )


def bandwidth_probe(p: Tensor, g: Tensor, m: Tensor, v: Tensor, *, num_threads: int | None = None) -> None:
    """The memory roofline of an fp32 Adam step: reads p, g, m, v and writes p, m, v (28 B/element).

    For benchmarks (it changes the tensors). Uses the active native backend's vector width.
    """
    if _backend == "torch":
        raise RuntimeError("bandwidth_probe needs a native backend; the active backend is 'torch'")
    nt = _num_threads if num_threads is None else _check_threads("num_threads", num_threads)
    for name, t in (("p", p), ("g", g), ("m", m), ("v", v)):
        _check_tensor(name, t, (torch.float32,), p.numel(), "p")
    lib.lzo_bandwidth_probe(*(ffi.cast("float *", t.data_ptr()) for t in (p, g, m, v)), p.numel(), nt)


# --------------------------------------------------------------------------------------------------
# implementations


def _adam_impl(
    table: list[tuple[int, ...]],
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    params_out: Sequence[Tensor] | None,
    steps: Sequence[int] | Sequence[Tensor],
    hp: AdamHyperparams,
    grad_scale: float,
    extrapolate: float,
    num_threads: int,
) -> None:
    if _backend == "torch":
        _torch_adam(params, grads, exp_avgs, exp_avg_sqs, params_out, steps, hp, grad_scale, extrapolate)
        return
    bad = lib.lzo_adam_step(
        hp._c_struct(),
        grad_scale,
        extrapolate,
        ffi.new("lzo_adam_tensor[]", table),
        len(table),
        _DTYPE_CODES[grads[0].dtype],
        lib.LZO_NONE if params_out is None else _DTYPE_CODES[params_out[0].dtype],
        num_threads,
    )
    if bad == -2:
        raise MemoryError("adam_step could not allocate its table of per-tensor constants")
    if bad:
        raise _bad_counter(bad - 1, steps[bad - 1])


def _bad_counter(index: int, counter: Tensor) -> ValueError:
    return ValueError(f"steps[{index}] holds {float(counter)}; a step count must be >= 0 before the update")


def _torch_adam(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    params_out: Sequence[Tensor] | None,
    steps: Sequence[int] | Sequence[Tensor],
    hp: AdamHyperparams,
    grad_scale: float,
    extrapolate: float,
) -> None:
    """Fallback: cast/scale the grads (temporaries), torch's fused CPU Adam, then the copy-out."""
    if isinstance(steps[0], Tensor):  # torch-format counters: incremented in place, as torch does
        bad = next((i for i, s in enumerate(steps) if not float(s) >= 0), None)
        if bad is not None:
            raise _bad_counter(bad, steps[bad])
        torch._foreach_add_(list(steps), 1.0)
        step_tensors = list(steps)
    else:
        step_tensors = [torch.tensor(float(s)) for s in steps]
    if grads[0].dtype != torch.float32 or grad_scale != 1.0:
        grads = [g.to(torch.float32, copy=True).mul_(grad_scale) for g in grads]
    before = [p.clone() for p in params] if extrapolate and params_out is not None else None
    fused = torch._fused_adamw_ if hp.adamw_mode else torch._fused_adam_
    fused(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        step_tensors,
        lr=hp.lr,
        beta1=hp.beta1,
        beta2=hp.beta2,
        weight_decay=hp.weight_decay,
        eps=hp.eps,
        amsgrad=False,
        maximize=hp.maximize,
    )
    for i, (param, out) in enumerate(zip(params, params_out or ())):
        out.copy_(param if before is None else torch.add(param, param - before[i], alpha=extrapolate))


def _f32(x: float) -> float:
    """Round a double to float32, as the kernels' constants are."""
    return float(torch.tensor(x, dtype=torch.float32))


def _adamw_decay(hp: AdamHyperparams) -> float:
    """AdamW's per-step factor on the params, as the step rounds it (1.0: no decoupled decay)."""
    return _f32(1.0 - hp.lr * hp.weight_decay) if hp.adamw_mode and hp.weight_decay != 0 else 1.0


_UNDO_CHUNK = 1 << 18  # elements per float64 pass: bounds the temporaries (a few MB) whatever the size


def _torch_adam_undo(
    param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, hp: AdamHyperparams, step: int, grad_scale: float
) -> None:
    """native/undo_body.h in torch ops: the same float64 arithmetic in the same order, so the same bits."""
    bc1 = 1.0 - hp.beta1**step
    bc2_sqrt = _f32((1.0 - hp.beta2**step) ** 0.5)  # pow, as the step computes it
    neg_step_size = _f32(-(hp.lr / bc1))
    eps = _f32(hp.eps)
    decay = _adamw_decay(hp)
    l2 = 0.0 if hp.adamw_mode else _f32(hp.weight_decay)
    w = _f32(1.0 - hp.beta1)
    beta2, one_minus_beta2 = _f32(hp.beta2), _f32(1.0 - hp.beta2)
    scale = torch.tensor(-grad_scale if hp.maximize else grad_scale, dtype=torch.float32)
    inv_bc2_sqrt, inv_decay = 1.0 / bc2_sqrt, 1.0 / decay
    inv_one_minus_w = 1.0 / (1.0 - w) if w != 1.0 else 0.0
    inv_beta2 = 1.0 / beta2 if beta2 != 0 else 0.0
    for start in range(0, param.numel(), _UNDO_CHUNK):
        window = slice(start, start + _UNDO_CHUNK)
        p1, m1, v1 = param[window].double(), exp_avg[window].double(), exp_avg_sq[window].double()
        p0 = (p1 - neg_step_size * m1 / (v1.sqrt() * inv_bc2_sqrt + eps)) * inv_decay
        g = (grad[window] * scale).double() + p0 * l2  # the product rounded to fp32, as in the step; Adam's L2
        param[window] = p0
        exp_avg[window] = (m1 - w * g) * inv_one_minus_w
        exp_avg_sq[window] = ((v1 - one_minus_beta2 * g * g) * inv_beta2).clamp_(min=0.0)


_M32, _M64 = (1 << 32) - 1, (1 << 64) - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer (native/dispatch.c mix64)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _sr_keys(seed: int, step: int, high: int) -> tuple[int, int]:
    """The hash keys (p and m, v) of the elements whose global index has these high 32 bits."""
    z = _mix64((_mix64((_mix64((seed + 0x9E3779B97F4A7C15) & _M64) + step) & _M64) + high) & _M64)
    return z & _M32, z >> 32


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for int64 x in [0, 2**32), in halves so that no product overflows int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _hash32(x: Tensor) -> Tensor:
    """lowbias32 (native/kernels_simd.h hash32) on int64 tensors holding uint32 values."""
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def _sr_bits(seed: int, step: int, offset: int, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """The 16 random bits of p, m and v for elements ``offset .. offset + n - 1`` (int64 tensors)."""
    index = torch.arange(offset, offset + n, dtype=torch.int64)
    high, low = index >> 32, index & _M32
    key_pm, key_v = torch.empty_like(index), torch.empty_like(index)
    for h in range(offset >> 32, ((offset + n - 1) >> 32) + 1 if n else 0):
        where = high == h
        key_pm[where], key_v[where] = _sr_keys(seed, step, h)
    pm, v = _hash32(low ^ key_pm), _hash32(low ^ key_v)
    return pm >> 16, pm & 0xFFFF, v >> 16


def _round_bf16_stochastic(x: Tensor, r: Tensor) -> Tensor:
    """fp32 -> bf16: add the random bits ``r`` (< 2**16) to the bit pattern and truncate; NaN -> 0x7fc0."""
    bits = ((x.view(torch.int32).to(torch.int64) & _M32) + r) >> 16
    bits = torch.where(torch.isnan(x), 0x7FC0, bits)
    return (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.bfloat16)


def _r32(x: Tensor) -> Tensor:
    """Round float64 to float32, kept in float64: one correctly rounded fp32 operation after a float64
    one (+, -, *, / and sqrt of fp32 values in float64 then rounded to fp32 give the fp32 result)."""
    return x.to(torch.float32).to(torch.float64)


def _fma32(a: Tensor | float, b: Tensor, c: Tensor) -> Tensor:
    """fp32 ``a * b + c`` rounded once (the kernels' fused multiply-add), from fp32 values in float64.

    The product is exact in float64; the sum is rounded to odd (to nearest, then, if inexact and even,
    one step towards the exact sum, whose error TwoSum gives), and round-to-odd in 53 bits followed by
    round-to-nearest in 24 is correctly rounded (native/kernels_scalar.c fma_exact does the same).
    """
    prod = b * a
    s = prod + c
    bb = s - prod
    err = (prod - (s - bb)) + (c - bb)
    bits = s.view(torch.int64)
    inexact_even = ((err > 0) | (err < 0)) & ((bits & 1) == 0)  # NaN err (s not finite): untouched
    bits = bits + torch.where(inexact_even, torch.where((err > 0) == (s > 0), 1, -1), 0)
    return _r32(bits.view(torch.float64))


_BF16_STATE_CHUNK = 1 << 16  # elements per pass of the reference: bounds its float64 temporaries


def _torch_adam_bf16_state(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    hp: AdamHyperparams,
    step: int,
    seed: int,
    offset: int,
    grad_scale: float,
) -> None:
    """adam_bf16state (native/kernels_simd.h) in torch ops: every fp32 operation done in float64 and
    rounded to fp32 (exact: see _r32), the multiply-adds rounded once (_fma32), the same constants as
    dispatch.c adam_consts and the same hash, so the same bits as every native backend."""
    bc1, bc2 = 1.0 - hp.beta1**step, 1.0 - hp.beta2**step  # pow, as adam_consts computes them
    scale = _f32(-grad_scale if hp.maximize else grad_scale)
    l2 = 0.0 if hp.adamw_mode else _f32(hp.weight_decay)
    decay = _adamw_decay(hp)
    w = _f32(1.0 - hp.beta1)
    from_end = not w < 0.5
    lerp_w = _f32(w - 1.0) if from_end else w
    beta2, one_minus_beta2 = _f32(hp.beta2), _f32(1.0 - hp.beta2)
    bc2_sqrt, neg_step_size, eps = _f32(bc2**0.5), _f32(-(hp.lr / bc1)), _f32(hp.eps)
    for start in range(0, param.numel(), _BF16_STATE_CHUNK):
        window = slice(start, start + _BF16_STATE_CHUNK)
        gi = _r32(grad[window].double() * scale)
        p, m, v = (t[window].double() for t in (param, exp_avg, exp_avg_sq))
        if l2 != 0.0:
            gi = _fma32(p, l2, gi)
        p = _r32(p * decay)
        m = _fma32(lerp_w, _r32(gi - m), gi if from_end else m)
        v = _fma32(_r32(one_minus_beta2 * gi), gi, _r32(v * beta2))
        denom = _r32(_r32(_r32(v.sqrt()) / bc2_sqrt) + eps)
        p = _r32(p + _r32(_r32(neg_step_size * m) / denom))
        bits = _sr_bits(seed, step, offset + start, p.numel())
        for t, x, r in zip((param, exp_avg, exp_avg_sq), (p, m, v), bits):
            t[window] = _round_bf16_stochastic(x.float(), r)


def _torch_fingerprint16(words: Tensor, width: int = 1024) -> Tensor:
    # sum x[r*w + c] * (r*w + c + 1) = w * sum_r r * rowsum_r + sum_c (c + 1) * colsum_c, plus the tail
    flat = words.reshape(-1)
    rows = flat.numel() // width
    body = flat[: rows * width].view(rows, width)
    index = functools.partial(torch.arange, dtype=torch.int64, device=words.device)
    total = width * (body.sum(1, dtype=torch.int64) * index(rows)).sum()
    total += (body.sum(0, dtype=torch.int64) * index(1, width + 1)).sum()
    tail = flat[rows * width :]
    return total + (tail.to(torch.int64) * index(rows * width + 1, flat.numel() + 1)).sum()


def _torch_grad_accumulate(dst: Tensor, src: Tensor, scale: float, overwrite: bool) -> float:
    """Fallback: the same arithmetic (exact cast, multiply, add) in two passes."""
    if overwrite:
        dst.copy_(src)
        dst.mul_(scale)
    else:
        dst.add_(src.to(torch.float32, copy=True).mul_(scale))
    return float(torch.linalg.vector_norm(dst, dtype=torch.float64)) ** 2


def _select_initial_backend() -> None:
    requested = os.environ.get("LZO_BACKEND", "").strip().lower()
    if lib is None and requested != "torch":
        warnings.warn(
            f"lightning_zero_offload: native CPU kernels are not built ({_import_error}); using the slower "
            "torch fallback. To build them, install a C compiler (e.g. gcc) and reinstall: "
            "`pip install --force-reinstall --no-deps -e .` in a source checkout, or "
            "`pip install --force-reinstall --no-deps lightning-zero-offload`.",
            RuntimeWarning,
            stacklevel=2,
        )
    if requested:
        try:
            set_backend(requested)
        except ValueError as err:
            raise ValueError(f"LZO_BACKEND={requested!r}: {err}") from None
    else:
        set_backend(available_backends()[0])
    if lib is not None and not lib.lzo_has_openmp():
        warnings.warn(
            "lightning_zero_offload: the native kernels were built without OpenMP and run single-threaded; "
            "install OpenMP for your compiler (e.g. libomp) and reinstall the package to use all cores.",
            RuntimeWarning,
            stacklevel=2,
        )


_select_initial_backend()
