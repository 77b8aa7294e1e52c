"""The Adam step of optimizer state that stays on the accelerator (the ``device_share`` option).

The torch backend's arithmetic (kernels/reference.py) run on the tensors where they lie, so a parameter
whose state is on the device follows the update rule of the CPU kernels: fp32 state to fp32 rounding
(torch's fused Adam/AdamW with the same gradient factor, as the torch backend runs it), bf16 state bitwise
(the same widened arithmetic, counter-based hash and stochastic rounding). Every tensor of one call lies on
one device; on a CPU "device" (the tests' accelerator) this is the code a GPU runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero_offload.kernels.arguments import (
    GRAD_DTYPES,
    AdamArgs,
    AdamCall,
    FlatAdamCall,
    check_args,
    check_seed_and_offset,
    check_step,
    real,
)
from lightning_zero_offload.kernels.backends import REFERENCE
from lightning_zero_offload.kernels.reference import bf16_state_step

# Elements per pass of the bf16-state step: a large parameter is a few dozen passes, not thousands of small
# launches, and the passes' float64 and int64 temporaries stay under 600 MB (docs/benchmarks.md, "The device
# step's scratch").
BF16_STATE_CHUNK = 1 << 22
BF16_STATE_SCRATCH_BYTES = 140  # per element of a pass: what the planner counts

__all__ = ["BF16_STATE_CHUNK", "BF16_STATE_SCRATCH_BYTES", "adam_step_bf16_state", "adam_step_multi", "sum_of_squares"]


def adam_step_multi(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    steps: Sequence[int],
    *,
    hparams: AdamArgs,
    grad_scale: float = 1.0,
) -> None:
    """``kernels.adam_step_multi`` on fp32 state wherever it lies: ``steps[i]`` (an int >= 1) is tensor i's step.

    One tensor at a time: a gradient that is not fp32 or a ``grad_scale`` other than 1 takes an fp32 copy of the
    gradient, which stays the size of one tensor instead of the whole call's."""
    check_args(hparams)
    grad_scale = real("grad_scale", grad_scale)
    steps = [check_step(f"steps[{i}]", s) for i, s in enumerate(steps)]
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    for name, given in lists.items():
        if len(given) != len(params):
            raise ValueError(f"{name} has {len(given)} entries and params {len(params)}; pass one per param")
    if not params:
        return
    device = params[0].device
    for i, p in enumerate(params):
        _check(f"params[{i}]", p, (torch.float32,), device)
        _check(f"grads[{i}]", grads[i], GRAD_DTYPES, device, p.numel())
        _check(f"exp_avgs[{i}]", exp_avgs[i], (torch.float32,), device, p.numel())
        _check(f"exp_avg_sqs[{i}]", exp_avg_sqs[i], (torch.float32,), device, p.numel())
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        REFERENCE.adam(AdamCall(hparams, [], [p], [g], [m], [v], [step], grad_scale, 1, None, 0.0))


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
) -> None:
    """``kernels.adam_step_bf16_state`` wherever the state lies: the same bits as the CPU kernels."""
    check_args(hparams)
    grad_scale, step = real("grad_scale", grad_scale), check_step("step", step)
    check_seed_and_offset(seed, offset)
    _check("param", param, (torch.bfloat16,), param.device)
    _check("grad", grad, GRAD_DTYPES, param.device, param.numel())
    _check("exp_avg", exp_avg, (torch.bfloat16,), param.device, param.numel())
    _check("exp_avg_sq", exp_avg_sq, (torch.bfloat16,), param.device, param.numel())
    flat = (t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq))  # element i is the i-th in memory, as natively
    call = FlatAdamCall(hparams, *flat, step, grad_scale, 1, int(seed), int(offset))
    bf16_state_step(call, BF16_STATE_CHUNK)


def sum_of_squares(src: Tensor) -> tuple[float, bool]:
    """The sum of squares of ``src`` in float64, wherever it lies, and whether it holds an inf or nan (one
    synchronisation with the device)."""
    _check("src", src, GRAD_DTYPES, src.device)
    sumsq = float(torch.linalg.vector_norm(src, dtype=torch.float64)) ** 2
    return sumsq, not math.isfinite(sumsq)


def _check(
    name: str, t: object, dtypes: tuple[torch.dtype, ...], device: torch.device, numel: int | None = None
) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or not t.is_contiguous():
        raise ValueError(f"{name} must be a dense contiguous tensor, got a {t.layout} tensor of strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the call's first tensor on {device}: keep one call on one device")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {' or '.join(str(d) for d in dtypes)}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, and the parameter {numel}; sizes must match")
