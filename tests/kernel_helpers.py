"""Inputs, torch's results and tolerances shared by the kernel tests (tests/kernels/).

Tolerances. The native Adam kernel performs torch's single-tensor operations in torch's order, in
fp32, with fused multiply-adds where torch's vectorised CPU kernels use them. The one systematic
difference is the square root: ours is correctly rounded, torch's (MKL) is within 1 ulp. So after
S steps the params differ by at most a few roundings per step: |dp| <= S * (ulp(p) + 2^-21 lr),
i.e. rtol = S * 2^-23 and atol = S * lr * 2^-21 (observed: below a fifth of that). Rounding errors of
the moments scale with the terms they add up: atol = S * 2^-23 * |g|max for exp_avg and its square
for exp_avg_sq. The portable backend on CPUs without FMA rounds multiply-adds separately and stays
inside the same bounds. Against float64, Adam's L2 mode can be ill-conditioned; see
test_adam_matches_torch_and_float64 (tests/kernels/test_adam.py).
"""

from __future__ import annotations

import math

import torch

from lightning_zero_offload import kernels

BACKENDS = kernels.available_backends()
NATIVE = [b for b in BACKENDS if b != "torch"]
SIMD = [b for b in NATIVE if b != "scalar"]
LOW = [torch.bfloat16, torch.float16]
HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}


def adam_args(hp: dict | None = None, **overrides) -> kernels.AdamArgs:
    """The kernels' record of ``hp`` (default HP) with ``overrides`` (``adamw_mode`` is required)."""
    return kernels.AdamArgs(**{**(HP if hp is None else hp), **overrides})


def grads_like(n: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Gradients spanning six orders of magnitude, so eps and the sqrt both matter."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 3, (n,), generator=gen).float() for _ in range(steps)
    ]


def torch_steps(p0: torch.Tensor, grads: list[torch.Tensor], hp: dict, adamw_mode: bool, maximize: bool):
    """torch's single-tensor Adam/AdamW, the behaviour we reproduce."""
    param = p0.clone().requires_grad_()
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    opt = cls(
        [param],
        lr=hp["lr"],
        betas=(hp["beta1"], hp["beta2"]),
        eps=hp["eps"],
        weight_decay=hp["weight_decay"],
        maximize=maximize,
        foreach=False,
    )
    for g in grads:
        param.grad = g.clone()
        opt.step()
    state = opt.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


def reference64(p0: torch.Tensor, grads: list[torch.Tensor], hp: dict, adamw_mode: bool, maximize: bool):
    """The update rule in float64 (the documented order of operations)."""
    p, m, v = (
        p0.double(),
        torch.zeros_like(p0, dtype=torch.float64),
        torch.zeros_like(p0, dtype=torch.float64),
    )
    lr, b1, b2, eps, wd = hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"]
    for step, grad in enumerate(grads, start=1):
        g = -grad.double() if maximize else grad.double()
        if wd and not adamw_mode:
            g = g + wd * p
        if wd and adamw_mode:
            p = p * (1 - lr * wd)
        m = m + (g - m) * (1 - b1)
        v = v * b2 + (1 - b2) * g * g
        denom = v.sqrt() / math.sqrt(1 - b2**step) + eps
        p = p - lr / (1 - b1**step) * m / denom
    return p, m, v


def our_steps(p0: torch.Tensor, grads: list[torch.Tensor], hp: dict, adamw_mode: bool, maximize: bool, **kw):
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    args = adam_args(hp, adamw_mode=adamw_mode, maximize=maximize)
    for step, g in enumerate(grads, start=1):
        kernels.adam_step(p, g, m, v, hparams=args, step=step, **kw)
    return p, m, v


def assert_adam_close(actual, expected, steps: int, hp: dict, gmax: float, slack=(0.0, 0.0, 0.0)) -> None:
    """(param, exp_avg, exp_avg_sq) within the rounding bound of the module docstring.

    Rounding errors of the moments scale with the terms they add up: the effective gradient
    (bounded by gmax) for exp_avg, its square for exp_avg_sq. `slack` widens the bound elementwise
    where the problem itself is ill-conditioned (see test_adam_matches_torch_and_float64).
    """
    rtol = steps * 2**-23
    scales = (steps * hp["lr"] * 2**-21, steps * 2**-23 * gmax, steps * 2**-23 * gmax**2)
    for name, a, e, atol, extra in zip(("param", "exp_avg", "exp_avg_sq"), actual, expected, scales, slack):
        a, e = a.double(), e.double()
        error, allowed = (a - e).abs(), atol + rtol * e.abs() + extra
        worst = int((error - allowed).argmax()) if error.numel() else 0
        assert (error <= allowed).all(), (
            f"{name}[{worst}] = {a[worst].item()!r}, expected {e[worst].item()!r} +- {allowed[worst].item():.3g}"
        )


def grad_bound(p0: torch.Tensor, grads: list[torch.Tensor], hp: dict, scale: float = 1.0) -> float:
    """A bound on |grad * scale + weight_decay * param| over the run (params move by <= ~10 lr a step)."""
    drift = 10 * hp["lr"] * len(grads)
    biggest = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
    pmax = float(p0.abs().max()) if p0.numel() else 0.0
    return biggest * abs(scale) + hp["weight_decay"] * (pmax + drift)
