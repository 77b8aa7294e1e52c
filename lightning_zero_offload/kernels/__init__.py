"""CPU kernels of the offload step: a fused Adam/AdamW update and gradient accumulation.

Why native code: torch's fused CPU AdamW already runs a plain fp32 step at memory bandwidth, but the
offload step around it (cast the bf16/fp16 grads, unscale and clip, step, cast the params back)
takes several passes and >= 48 B/param. :func:`adam_step` does all of it in one pass of 28 B/param,
and :func:`grad_accumulate` computes the gradient norm and the inf/nan check in the same pass that
copies gradients into the CPU buffer.

Every kernel has one Python signature, implemented twice: by the C extension (``native/``, built when
the package is installed; AVX-512, AVX2 or portable code chosen at import) and by torch ops, used when
the extension is missing or when ``set_backend("torch")``/``LZO_BACKEND=torch`` asks for it. The
package, in the order a call runs through it:

- this module: the public functions; each checks its arguments and calls the active backend;
- ``arguments``: the argument checks, and :class:`AdamArgs`, the hyperparameters checked once;
- ``backends``: the one active backend object, its selection and the default thread count;
- ``native``: the native backend (cffi calls); ``_native``: loading the extension;
- ``reference``: the torch backend, the reference the native kernels are tested against.

The Adam kernels take their hyperparameters as one :class:`AdamArgs` (``hparams=``), built once per
param group and step. The kernels work in place on the caller's memory and never on a hidden copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero_offload.kernels import _native, backends
from lightning_zero_offload.kernels.arguments import (
    GRAD_DTYPES,
    AdamArgs,
    AdamCall,
    FlatAdamCall,
    adam_table,
    check_args,
    check_bf16_state_call,
    check_extrapolate,
    check_step,
    check_steps,
    check_tensor,
    real,
)
from lightning_zero_offload.kernels.backends import (
    available_backends,
    backend,
    get_num_threads,
    set_backend,
    set_num_threads,
    usable_cores,
)
from lightning_zero_offload.kernels.reference import adamw_decay

__all__ = [
    "AdamArgs",
    "adam_step",
    "adam_step_bf16_state",
    "adam_step_multi",
    "adam_step_multi_if_finite",
    "adam_undo",
    "available_backends",
    "backend",
    "can_undo",
    "fingerprint16",
    "get_num_threads",
    "grad_accumulate",
    "has_openmp",
    "set_backend",
    "set_num_threads",
    "sum_of_squares",
    "usable_cores",
]


def has_openmp() -> bool:
    """Whether the native kernels were built with OpenMP (without it they run single-threaded)."""
    return _native.has_openmp()


def adam_step(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    hparams: AdamArgs,
    step: int,
    grad_scale: float = 1.0,
    param_out: Tensor | None = None,
    extrapolate: float = 0.0,
    num_threads: int | None = None,
) -> None:
    """One Adam (``adamw_mode=False``, L2) or AdamW (decoupled decay) update, in place.

    Follows torch's single-tensor Adam/AdamW order of operations, with the gradient first multiplied
    by ``grad_scale`` (the engine's unscale x clip factor). ``param``, ``exp_avg`` and ``exp_avg_sq``
    are contiguous fp32 CPU tensors; ``grad`` is fp32, bf16 or fp16. If ``param_out`` (bf16 or fp16)
    is given, it receives the updated param rounded to nearest even in the same pass: the
    low-precision copy that goes back to the accelerator. With ``extrapolate`` it receives
    ``p_new + extrapolate * (p_new - p_old)`` instead (the master ``param`` is unaffected): Delayed
    Parameter Update's weight prediction, at no extra memory traffic.
    """
    check_args(hparams)
    grad_scale, extrapolate = real("grad_scale", grad_scale), real("extrapolate", extrapolate)
    check_extrapolate(extrapolate, param_out is not None)
    steps = [check_step("step", step)]
    nt = backends.threads(num_threads)
    outs = None if param_out is None else [param_out]
    table = adam_table([param], [grad], [exp_avg], [exp_avg_sq], outs, steps, plural=False)
    call = AdamCall(hparams, table, [param], [grad], [exp_avg], [exp_avg_sq], steps, grad_scale, nt, outs, extrapolate)
    backends.active().adam(call)


def adam_step_multi(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[int] | Sequence[Tensor],
    *,
    hparams: AdamArgs,
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
    check_args(hparams)
    grad_scale, extrapolate = real("grad_scale", grad_scale), real("extrapolate", extrapolate)
    check_extrapolate(extrapolate, params_out is not None)
    steps = check_steps(steps, len(params))
    nt = backends.threads(num_threads)
    table = adam_table(params, grads, exp_avgs, exp_avg_sqs, params_out, steps, plural=True)
    if table:
        call = AdamCall(
            hparams, table, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale, nt, params_out, extrapolate
        )
        backends.active().adam(call)


def adam_step_multi_if_finite(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[int],
    *,
    hparams: AdamArgs,
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
    check_args(hparams)
    grad_scale = real("grad_scale", grad_scale)
    if len(steps) != len(params):
        raise ValueError(f"steps has {len(steps)} entries but params has {len(params)}; pass one per param")
    steps = [check_step(f"steps[{i}]", s) for i, s in enumerate(steps)]
    nt = backends.threads(num_threads)
    if any(g.dtype != torch.float32 for g in grads):
        raise TypeError("adam_step_multi_if_finite takes fp32 grads only (its rollback reads them in fp32)")
    if not can_undo(hparams):
        raise ValueError("this AdamW step has lr * weight_decay == 1, which zeroes the params: it cannot be undone")
    table = adam_table(params, grads, exp_avgs, exp_avg_sqs, None, steps, plural=True)
    if not table:
        return 0.0, True
    call = AdamCall(hparams, table, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale, nt)
    return backends.active().adam_if_finite(call)


def adam_undo(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    hparams: AdamArgs,
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
    check_args(hparams)
    grad_scale, step = real("grad_scale", grad_scale), check_step("step", step)
    nt = backends.threads(num_threads)
    check_tensor("param", param, (torch.float32,))
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        check_tensor(name, t, (torch.float32,), param.numel(), "param")
    if not can_undo(hparams):
        raise ValueError("this AdamW step had lr * weight_decay == 1, which zeroes the params: it cannot be undone")
    backends.active().adam_undo(FlatAdamCall(hparams, param, grad, exp_avg, exp_avg_sq, step, grad_scale, nt))


def can_undo(hparams: AdamArgs) -> bool:
    """Whether :func:`adam_undo` can take back a step with these hyperparameters (not when it zeroed the params)."""
    return adamw_decay(hparams) != 0.0


def adam_step_bf16_state(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    hparams: AdamArgs,
    step: int,
    seed: int,
    offset: int = 0,
    grad_scale: float = 1.0,
    num_threads: int | None = None,
) -> None:
    """:func:`adam_step` on bf16 state: ``param``, ``exp_avg``, ``exp_avg_sq`` are bf16, updated in place.

    Each element is widened to fp32 and updated with :func:`adam_step`'s fp32 arithmetic (the same
    constants; m and v bitwise, p within a few fp32 ulp: one division fewer, see
    ``reference.bf16_state_update``), and the new p, m and v are stored with stochastic rounding: 16
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
    tensors = (param, grad, exp_avg, exp_avg_sq)
    grad_scale, step = check_bf16_state_call(hparams, grad_scale, step, seed, offset, tensors)
    nt = backends.threads(num_threads)
    call = FlatAdamCall(hparams, param, grad, exp_avg, exp_avg_sq, step, grad_scale, nt, int(seed), int(offset))
    backends.active().adam_bf16_state(call)


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
    scale = real("scale", scale)
    nt = backends.threads(num_threads)
    check_tensor("dst", dst, (torch.float32,))
    check_tensor("src", src, GRAD_DTYPES, dst.numel(), "dst")
    sumsq = backends.active().grad_accumulate(dst, src, scale, bool(overwrite), nt)
    # A finite float squared is < 2^256, so the double sum is finite iff every element is.
    return sumsq, not math.isfinite(sumsq)


def sum_of_squares(src: Tensor, *, num_threads: int | None = None) -> tuple[float, bool]:
    """The sum of squares of ``src`` and whether it holds an inf or nan, reading it once and writing nothing.

    Bitwise what :func:`grad_accumulate` returns when it overwrites a buffer of the same size with
    ``src`` (scale 1): the norm of a gradient that is used where it lies instead of being copied.
    ``src`` is contiguous fp32, bf16 or fp16.
    """
    nt = backends.threads(num_threads)
    check_tensor("src", src, GRAD_DTYPES)
    sumsq = backends.active().sum_of_squares(src, nt)
    return sumsq, not math.isfinite(sumsq)


def fingerprint16(words: Tensor, *, num_threads: int | None = None) -> Tensor:
    """A checksum of 16-bit words: ``sum(words[i] * (i + 1)) mod 2**64`` (signed words), as a 0-dim int64.

    Any single changed word and any swap of two different words change it; it is integer arithmetic,
    so it is the same on every backend, device and thread count. On a CPU tensor the active backend
    computes it (the native kernel in one pass); on a device tensor torch does, from row and column
    sums (no model-sized temporary), and the result stays on the device (no synchronisation).
    """
    if words.dtype != torch.int16 or not words.is_contiguous():
        raise TypeError(f"words must be a contiguous int16 tensor (a .view(torch.int16)), got {words.dtype}")
    implementation = backends.active() if words.device.type == "cpu" else backends.REFERENCE
    return implementation.fingerprint16(words, backends.threads(num_threads))


backends.select_initial_backend()
