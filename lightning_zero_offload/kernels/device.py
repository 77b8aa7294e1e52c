"""The Adam step of optimizer state that stays on the accelerator (the ``device_share`` option).

The torch backend's arithmetic (kernels/reference.py) run on the tensors where they lie, so a parameter
whose state is on the device follows the update rule of the CPU kernels: fp32 state to fp32 rounding
(torch's fused Adam/AdamW with the same gradient factor, as the torch backend runs it), bf16 state bitwise
(the same widened arithmetic, counter-based hash and stochastic rounding). Every tensor of one call lies on
one device; on a CPU "device" (the tests' accelerator) this is the code a GPU runs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.torch_version import TorchVersion
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from lightning_zero_offload.kernels.arguments import (
    GRAD_DTYPES,
    AdamArgs,
    AdamCall,
    FlatAdamCall,
    check_args,
    check_bf16_state_call,
    check_step,
    check_tensor,
    real,
)
from lightning_zero_offload.kernels.backends import REFERENCE
from lightning_zero_offload.kernels.reference import BF16StatePass, bf16_state_pass, bf16_state_step
from lightning_zero_offload.warning import ZeroOffloadRuntimeWarning

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
        check_tensor(f"params[{i}]", p, (torch.float32,), device=device)
        for name, t in (("grads", grads[i]), ("exp_avgs", exp_avgs[i]), ("exp_avg_sqs", exp_avg_sqs[i])):
            dtypes = GRAD_DTYPES if name == "grads" else (torch.float32,)
            check_tensor(f"{name}[{i}]", t, dtypes, p.numel(), f"params[{i}]", device)
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
    tensors = (param, grad, exp_avg, exp_avg_sq)
    grad_scale, step = check_bf16_state_call(hparams, grad_scale, step, seed, offset, tensors, param.device)
    flat = (t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq))  # element i is the i-th in memory, as natively
    call = FlatAdamCall(hparams, *flat, step, grad_scale, 1, int(seed), int(offset))
    bf16_state_step(call, BF16_STATE_CHUNK, FUSED_PASS if param.device.type != "cpu" else bf16_state_pass)


def compile_options(torch_version: str) -> dict[str, Any]:
    """``torch.compile``'s options for the pass under ``torch_version``: before 2.13 without pattern matching, whose
    pointless_convert there merges a float64 -> float32 -> float64 round trip into nothing (every fp32 rounding of
    the update is one); 2.13 keeps a narrowing round trip, and its pattern matching makes the pass faster."""
    older = TorchVersion(torch_version) < (2, 13)
    return {"dynamic": True, "fullgraph": True, "options": {"pattern_matcher": False} if older else {}}


COMPILE_OPTIONS = compile_options(torch.__version__)


class FusedPass:
    """:func:`reference.bf16_state_pass` compiled (``torch.compile``) into one kernel: unfused, each of its
    operations is a kernel reading and writing float64 and int64 temporaries of the pass's size; fused, the state
    is read and written once (docs/benchmarks.md, "The device share's bf16 step, fused"). One compiled graph serves
    every size from 2 elements, step, offset, hyperparameter and update rule (all tensors); another gradient dtype
    compiles another. Where compiling fails (no Triton, no compiler), a warning says why and the unfused pass takes
    over: the same arithmetic, so the same bits; the pass is pure, so the failed call is simply run again."""

    def __init__(self) -> None:
        self._compiled: BF16StatePass | None = None
        self.failure: str | None = None

    def __call__(
        self, p: Tensor, g: Tensor, m: Tensor, v: Tensor, constants: Tensor, where: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        # Unfused: sizes 0 and 1 (dynamo compiles them apart), and under a dispatch mode (the CUDA sanitizer, a FLOP
        # counter), where dynamo compiles nothing and fullgraph=True fails: that call only.
        if self.failure is None and p.numel() > 1 and not is_in_torch_dispatch_mode():
            if self._compiled is None:
                self._compiled = torch.compile(bf16_state_pass, **COMPILE_OPTIONS)
            try:
                # ``where`` a tensor of its own: as a view, its base's size is guarded (one pass, or several)
                return self._compiled(p, g, m, v, constants, where.clone())
            except torch.OutOfMemoryError:  # the device's, not the compiler's: the unfused pass needs more
                raise
            except Exception as error:  # noqa: BLE001 - the unfused pass below raises what is not the compiler's
                self.failure = f"{type(error).__name__}: {error}".splitlines()[0]
                warnings.warn(
                    f"zero_offload: the device share's bf16 step runs unfused, many times slower (the same bits), "
                    f"since torch.compile failed ({self.failure}). A missing Triton comes with torch's CUDA wheels; "
                    "cpu_state='fp32' steps the device share with torch's fused Adam instead.",
                    ZeroOffloadRuntimeWarning,
                    stacklevel=2,
                )
        return bf16_state_pass(p, g, m, v, constants, where)


FUSED_PASS = FusedPass()


def sum_of_squares(src: Tensor) -> tuple[float, bool]:
    """The sum of squares of ``src`` in float64, wherever it lies, and whether it holds an inf or nan (one
    synchronisation with the device)."""
    check_tensor("src", src, GRAD_DTYPES, device=src.device)
    sumsq = float(torch.linalg.vector_norm(src, dtype=torch.float64)) ** 2
    return sumsq, not math.isfinite(sumsq)
