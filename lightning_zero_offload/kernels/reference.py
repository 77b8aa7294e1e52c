"""The torch backend: every kernel in torch ops, the reference the native backends are tested against.

Used where the extension is missing, or when ``set_backend("torch")``/``LZO_BACKEND=torch`` asks for
it. The Adam step is torch's fused CPU Adam with the casts around it (to fp32 rounding of the native
step); the undo and the bf16-state step repeat the native arithmetic operation for operation, so they
give the native backends' bits. Arguments arrive checked (kernels/arguments.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_zero_offload.kernels.arguments import AdamArgs, AdamCall, FlatAdamCall, bad_counter


def _f32(x: float) -> float:
    """Round a double to float32, as the kernels' constants are."""
    return float(torch.tensor(x, dtype=torch.float32))


def adamw_decay(hp: AdamArgs) -> float:
    """AdamW's per-step factor on the params, as the step rounds it (1.0: no decoupled decay)."""
    return _f32(1.0 - hp.lr * hp.weight_decay) if hp.adamw_mode and hp.weight_decay != 0 else 1.0


_UNDO_CHUNK = 1 << 18  # elements per float64 pass: bounds the temporaries (a few MB) whatever the size
_BF16_STATE_CHUNK = 1 << 16  # elements per pass of the reference: bounds its float64 temporaries

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
    """lowbias32 (native/kernels_simd.h, hash32_from_stage1 with its first and last steps) on int64 tensors
    holding uint32 values."""
    x = _mul32(x ^ (x >> 16), 0x7FEB352D)
    x = _mul32(x ^ (x >> 15), 0x846CA68B)
    return x ^ (x >> 16)


def sr_bits(
    seed: int, step: int, offset: int, n: int, device: torch.device | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The 16 random bits of p, m and v for elements ``offset .. offset + n - 1`` (int64 tensors on ``device``;
    at most 2**32 elements: two values of the index's high word)."""
    if n > 2**32:
        raise ValueError(f"sr_bits takes at most 2**32 elements at a time, got {n}")
    return _sr_bits_at(torch.tensor(_pass_index(seed, step, offset), device=device), n)


def _pass_index(seed: int, step: int, offset: int) -> list[int]:
    """Where a pass of the bf16-state step starts (its first element's global index) and the hash keys of that
    index's high word and of the next: what :func:`_sr_bits_at` takes, as one int64 tensor."""
    high = offset >> 32
    return [offset, *_sr_keys(seed, step, high), *_sr_keys(seed, step, high + 1)]


def _sr_bits_at(where: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`sr_bits` for the ``n`` elements from ``where`` (:func:`_pass_index`, on their device): tensors only,
    so the compiled pass (kernels/device.py) takes another step or offset without compiling again."""
    index = where[0] + torch.arange(n, dtype=torch.int64, device=where.device)
    first = (index >> 32) == (where[0] >> 32)
    key_pm, key_v = torch.where(first, where[1], where[3]), torch.where(first, where[2], where[4])
    low = index & _M32
    pm, v = _hash32(low ^ key_pm), _hash32((low >> 1) ^ key_v)  # elements 2k, 2k + 1 share one v hash
    return pm >> 16, pm & 0xFFFF, torch.where((low & 1) == 1, v & 0xFFFF, v >> 16)


def round_bf16_stochastic(x: Tensor, r: Tensor) -> Tensor:
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


def bf16_state_update(
    hp: AdamArgs, step: int, grad_scale: float, p: Tensor, g: Tensor, m: Tensor, v: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The bf16-state step's fp32 update of widened p, m, v (float64 tensors of fp32 values), before
    the rounding: every fp32 operation done in float64 and rounded to fp32 (exact: see _r32), the
    multiply-adds rounded once (_fma32), the constants of dispatch.c adam_consts. m and v are the fp32
    step's; p differs from it by a few fp32 ulp: one division fewer (sqrt(v) * (1 / sqrt(bc2)) + eps,
    then a fused multiply-add), which the kernel's divider needs."""
    constants = torch.tensor(update_constants(hp, step, grad_scale), dtype=torch.float64, device=p.device)
    return update_values(constants, p, g, m, v)


def update_constants(hp: AdamArgs, step: int, grad_scale: float) -> list[float]:
    """dispatch.c adam_consts: the step's constants in fp32, in the order :func:`update_values` reads them, with its
    two choices as 1.0 or 0.0: whether an L2 term is added to the gradient, and whether m moves from the gradient's
    end (a lerp weight of 0.5 or more)."""
    bc1, bc2 = 1.0 - hp.beta1**step, 1.0 - hp.beta2**step  # pow, as adam_consts computes them
    scale = _f32(-grad_scale if hp.maximize else grad_scale)
    l2 = 0.0 if hp.adamw_mode else _f32(hp.weight_decay)
    w = _f32(1.0 - hp.beta1)
    from_end = not w < 0.5
    lerp_w = _f32(w - 1.0) if from_end else w
    beta2, one_minus_beta2 = _f32(hp.beta2), _f32(1.0 - hp.beta2)
    inv_bc2_sqrt, neg_step_size, eps = _f32(1.0 / bc2**0.5), _f32(-(hp.lr / bc1)), _f32(hp.eps)
    constants = [scale, l2, adamw_decay(hp), lerp_w, beta2, one_minus_beta2, inv_bc2_sqrt, neg_step_size, eps]
    return [*constants, float(l2 != 0.0), float(from_end)]


def update_values(constants: Tensor, p: Tensor, g: Tensor, m: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`bf16_state_update` from :func:`update_constants` as a float64 tensor on the state's device. Its two
    choices are made by ``torch.where``, not by Python, so that one compiled pass (kernels/device.py) serves every
    step, learning rate, scale and update rule; each branch is computed as the native kernel computes it."""
    scale, l2, decay, lerp_w, beta2, one_minus_beta2, inv_bc2_sqrt, neg_step_size, eps, has_l2, from_end = (
        constants.unbind()
    )
    gi = _r32(g * scale)
    gi = torch.where(has_l2 != 0, _fma32(p, l2, gi), gi)
    p = _r32(p * decay)
    m = _fma32(lerp_w, _r32(gi - m), torch.where(from_end != 0, gi, m))
    v = _fma32(_r32(one_minus_beta2 * gi), gi, _r32(v * beta2))
    denom = _fma32(inv_bc2_sqrt, _r32(v.sqrt()), eps)
    return _fma32(neg_step_size, _r32(m / denom), p), m, v


def bf16_state_pass(
    p: Tensor, g: Tensor, m: Tensor, v: Tensor, constants: Tensor, where: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One pass of the bf16-state step: the new bf16 p, m and v of these elements (the fp32 update of the widened
    state, stochastically rounded with the native hash's bits), from :func:`update_constants` and
    :func:`_pass_index` as tensors on the state's device. A pure function of tensors, so that kernels/device.py can
    compile it into one kernel."""
    updated = update_values(constants, *(t.double() for t in (p, g, m, v)))
    bits = _sr_bits_at(where, p.numel())
    return tuple(round_bf16_stochastic(x.float(), r) for x, r in zip(updated, bits))  # type: ignore[return-value]


BF16StatePass = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]


@torch.no_grad()  # an optimizer's step: a parameter that requires grad is written in place
def bf16_state_step(call: FlatAdamCall, chunk: int, run_pass: BF16StatePass = bf16_state_pass) -> None:
    """:func:`bf16_state_update`, then the native hash and stochastic rounding, ``chunk`` elements at a time on
    the tensors' own device (``run_pass``: :func:`bf16_state_pass` or its compiled form): the same bits as every
    native backend. The passes' constants and indices reach the device in two copies that do not wait for it."""
    param, grad, exp_avg, exp_avg_sq = call.param, call.grad, call.exp_avg, call.exp_avg_sq
    starts = range(0, param.numel(), chunk)
    values = update_constants(call.hparams, call.step, call.grad_scale)
    constants = torch.tensor(values, dtype=torch.float64).to(param.device, non_blocking=True)
    wheres = torch.tensor([_pass_index(call.seed, call.step, call.offset + start) for start in starts])
    wheres = wheres.to(param.device, non_blocking=True)
    for start, where in zip(starts, wheres):
        window = slice(start, start + chunk)
        state = (t[window] for t in (param, grad, exp_avg, exp_avg_sq))
        for t, x in zip((param, exp_avg, exp_avg_sq), run_pass(*state, constants, where)):
            t[window] = x


class TorchBackend:
    """The kernels in torch ops; the same methods as :class:`kernels.native.NativeBackend`."""

    name = "torch"

    def activate(self) -> None:
        pass

    def adam(self, call: AdamCall) -> None:
        """Fallback: cast/scale the grads (temporaries), torch's fused CPU Adam, then the copy-out."""
        hp, params, grads, steps, params_out = call.hparams, call.params, call.grads, call.steps, call.params_out
        grad_scale, extrapolate = call.grad_scale, call.extrapolate
        if isinstance(steps[0], Tensor):  # torch-format counters: incremented in place, as torch does
            bad = next((i for i, s in enumerate(steps) if not float(s) >= 0), None)
            if bad is not None:
                raise bad_counter(bad, steps[bad])
            torch._foreach_add_(list(steps), 1.0)
            step_tensors = list(steps)
        else:
            # float32, as torch keeps state["step"]: CUDA's fused Adam reads the counter as a float. One tensor
            # of them all: one host-to-device copy (each a blocking one from pageable memory), not one per parameter.
            counters = torch.tensor([float(s) for s in steps], dtype=torch.float32, device=params[0].device)
            step_tensors = list(counters.unbind())
        if grads[0].dtype != torch.float32 or grad_scale != 1.0:
            grads = [g.to(torch.float32, copy=True).mul_(grad_scale) for g in grads]
        before = [p.clone() for p in params] if extrapolate and params_out is not None else None
        fused = torch._fused_adamw_ if hp.adamw_mode else torch._fused_adam_
        fused(
            list(params),
            list(grads),
            list(call.exp_avgs),
            list(call.exp_avg_sqs),
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

    def adam_if_finite(self, call: AdamCall) -> tuple[float, bool]:
        """The norm first, then the step only if it is finite (two passes; the native kernel needs one)."""
        sumsq = sum(self.sum_of_squares(g, call.num_threads) for g in call.grads)
        if not math.isfinite(sumsq):
            return math.inf, False
        self.adam(call)  # no params_out, no extrapolation: adam_step_multi_if_finite takes neither
        return sumsq, True

    def adam_undo(self, call: FlatAdamCall) -> None:
        """native/undo_body.h in torch ops: the same float64 arithmetic in the same order, so the same bits."""
        hp, param, grad, exp_avg, exp_avg_sq = call.hparams, call.param, call.grad, call.exp_avg, call.exp_avg_sq
        step, grad_scale = call.step, call.grad_scale
        bc1 = 1.0 - hp.beta1**step
        bc2_sqrt = _f32((1.0 - hp.beta2**step) ** 0.5)  # pow, as the step computes it
        neg_step_size = _f32(-(hp.lr / bc1))
        eps = _f32(hp.eps)
        decay = adamw_decay(hp)
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

    def adam_bf16_state(self, call: FlatAdamCall) -> None:
        """adam_bf16state (native/kernels_simd.h) in torch ops: :func:`bf16_state_step`."""
        bf16_state_step(call, _BF16_STATE_CHUNK)

    def grad_accumulate(self, dst: Tensor, src: Tensor, scale: float, overwrite: bool, num_threads: int) -> float:
        """Fallback: the same arithmetic (exact cast, multiply, add) in two passes."""
        if overwrite:
            dst.copy_(src)
            dst.mul_(scale)
        else:
            dst.add_(src.to(torch.float32, copy=True).mul_(scale))
        return float(torch.linalg.vector_norm(dst, dtype=torch.float64)) ** 2

    def sum_of_squares(self, src: Tensor, num_threads: int) -> float:
        return float(torch.linalg.vector_norm(src, dtype=torch.float64)) ** 2

    def fingerprint16(self, words: Tensor, num_threads: int, width: int = 1024) -> Tensor:
        # sum x[r*w + c] * (r*w + c + 1) = w * sum_r r * rowsum_r + sum_c (c + 1) * colsum_c, plus the tail
        flat = words.reshape(-1)
        rows = flat.numel() // width
        body = flat[: rows * width].view(rows, width)
        index = functools.partial(torch.arange, dtype=torch.int64, device=words.device)
        total = width * (body.sum(1, dtype=torch.int64) * index(rows)).sum()
        total += (body.sum(0, dtype=torch.int64) * index(1, width + 1)).sum()
        tail = flat[rows * width :]
        return total + (tail.to(torch.int64) * index(rows * width + 1, flat.numel() + 1)).sum()
