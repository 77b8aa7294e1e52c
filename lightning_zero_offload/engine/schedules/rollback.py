"""Taking a speculated Adam step back: algebraically (no memory) or from a snapshot (bitwise).

The kernel (native/kernels_*.c, torch's order of operations) computes, per element, in fp32:

```
g  = grad * grad_scale            (+ p0 * wd   for Adam's L2 decay)
m1 = m0 + w (g - m0)              w = 1 - beta1
v1 = beta2 v0 + (1 - beta2) g^2
p1 = p0 * decay - step_size * m1 / (sqrt(v1) / sqrt(bc2) + eps)     decay = 1 - lr wd for AdamW
```

Every line can be solved for the old value given the new one and the gradient, which the CPU buffer
still holds. :func:`undo_adam` does that in float64 and rounds once: the restored state is within
about one fp32 ulp of the original (the step's own rounding cannot be recovered), so a corrected step
matches the synchronous one to fp32 rounding, not bitwise. When ``beta1`` or ``beta2`` is 0 the old
moment does not influence the new one and is restored as 0; a decay of exactly 0 (``lr * wd == 1``)
cannot be inverted, and such buckets are not speculated (:func:`invertible`).
"""

from __future__ import annotations

import math

import torch

from lightning_zero_offload.engine.adam import AdamHyperparams

_CHUNK = 1 << 18  # elements per float64 pass: bounds the temporaries (a few MB) whatever the bucket size


def _f32(x: float) -> float:
    """Round a double to float32, as the kernel's constants are."""
    return float(torch.tensor(x, dtype=torch.float32))


def _decay(hp: AdamHyperparams) -> float:
    return _f32(1.0 - hp.lr * hp.weight_decay) if hp.adamw_mode and hp.weight_decay != 0 else 1.0


def invertible(hp: AdamHyperparams) -> bool:
    return _decay(hp) != 0.0


def undo_adam(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hp: AdamHyperparams,
    step: int,
    grad_scale: float,
) -> None:
    """Invert ``kernels.adam_step`` (same arguments) in place, to within fp32 rounding."""
    bc1 = 1.0 - hp.beta1**step
    bc2_sqrt = _f32(math.sqrt(1.0 - hp.beta2**step))
    neg_step_size = _f32(-(hp.lr / bc1))
    eps = _f32(hp.eps)
    decay = _decay(hp)
    l2 = 0.0 if hp.adamw_mode else _f32(hp.weight_decay)
    w = _f32(1.0 - hp.beta1)
    beta2, one_minus_beta2 = _f32(hp.beta2), _f32(1.0 - hp.beta2)
    scale = torch.tensor(-grad_scale if hp.maximize else grad_scale, dtype=torch.float32)
    for start in range(0, param.numel(), _CHUNK):
        window = slice(start, start + _CHUNK)
        p1, m1, v1 = param[window].double(), exp_avg[window].double(), exp_avg_sq[window].double()
        p0 = (p1 - neg_step_size * m1 / (v1.sqrt() / bc2_sqrt + eps)) / decay
        g = (grad[window].float() * scale).double()  # the product rounded to fp32, as in the kernel
        if l2:
            g += p0 * l2
        m0 = (m1 - w * g) / (1.0 - w) if w != 1.0 else torch.zeros_like(m1)
        v0 = ((v1 - one_minus_beta2 * g * g) / beta2).clamp_(min=0.0) if beta2 != 0 else torch.zeros_like(v1)
        param[window] = p0
        exp_avg[window] = m0
        exp_avg_sq[window] = v0
