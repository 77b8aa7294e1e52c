"""kernels.adam_undo and adam_step_multi_if_finite: taking a (speculated) step back, on every backend."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_helpers import HP, adam_args, grads_like

from lightning_zero_offload import kernels

# fixtures in tests/conftest.py and tests/kernels/conftest.py
pytestmark = pytest.mark.usefixtures("one_torch_thread", "torch_seed")

UNDO_CASES = {  # AdamW, Adam with L2 and maximize, a low beta1 (the step's other lerp branch), odd scales
    "adamw": (dict(HP, adamw_mode=True), 0.5),
    "adam-l2-maximize": (dict(HP, weight_decay=0.01, adamw_mode=False, maximize=True), 1 / 3),
    "low-beta": (dict(HP, beta1=0.3, beta2=0.5, adamw_mode=True), 1e-3),
}


def stepped_state(n: int, hp: dict, scale: float, seed: int):
    gen = torch.Generator().manual_seed(seed)
    state = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-3]
    grad = grads_like(n, 1, seed + 1)[0]
    before = [t.clone() for t in state]
    kernels.adam_step(state[0], grad, state[1], state[2], hparams=kernels.AdamArgs(**hp), step=7, grad_scale=scale)
    return before, state, grad


@pytest.mark.parametrize("case", sorted(UNDO_CASES))
@pytest.mark.parametrize("n", [0, 1, 17, 2**16 + 5, 2**20 + 3])  # empty, tails, one chunk, many chunks
def test_undo_restores_the_state_before_the_step(backend: str, case: str, n: int) -> None:
    hp, scale = UNDO_CASES[case]
    before, state, grad = stepped_state(n, hp, scale, seed=n)
    after = [t.clone() for t in state]
    kernels.adam_undo(*state[:1], grad, *state[1:], hparams=kernels.AdamArgs(**hp), step=7, grad_scale=scale)
    for name, restored, original, stepped in zip(("param", "exp_avg", "exp_avg_sq"), state, before, after):
        if n == 0:
            continue
        # The step's own fp32 rounding cannot be recovered: within 1e-5 of the step's largest change
        # (observed <= 4.3e-6), or 2 ulp of the value where the change was below its resolution.
        ulp = torch.nextafter(original.abs(), torch.tensor(math.inf)) - original.abs()
        tolerance = 1e-5 * (stepped - original).abs().max() + 2 * ulp
        assert ((restored - original).abs() <= tolerance).all(), name


@pytest.mark.parametrize("case", sorted(UNDO_CASES))
def test_native_undo_equals_the_torch_path_bitwise(native: str, case: str) -> None:
    """Both do the same float64 arithmetic in the same order, from the step's own float constants, and round once."""
    hp, scale = UNDO_CASES[case]
    _, state, grad = stepped_state(2**20 + 3, hp, scale, seed=3)
    results = []
    for name in (native, "torch"):
        kernels.set_backend(name)
        copy = [t.clone() for t in state]
        kernels.adam_undo(copy[0], grad, copy[1], copy[2], hparams=kernels.AdamArgs(**hp), step=7, grad_scale=scale)
        results.append(copy)
    kernels.set_backend(native)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), *results):
        assert torch.equal(a, b), name


CHECKED_SIZES = [100, 70_000, 3, 200_000, 1]  # five chunks of 2^16 elements, tensors across their borders


def checked_state(seed: int):
    gen = torch.Generator().manual_seed(seed)
    make = lambda scale: [torch.randn(n, generator=gen) * scale for n in CHECKED_SIZES]  # noqa: E731
    return make(1.0), make(0.1), make(0.01), [t.abs() for t in make(0.001)]  # params, grads, exp_avg, exp_avg_sq


def test_checked_step_applies_exactly_the_plain_step_and_sums_the_grads(backend: str) -> None:
    hp = adam_args(adamw_mode=True)
    params, grads, m, v = checked_state(0)
    steps = [3, 1, 7, 3, 2]
    expected = [[t.clone() for t in ts] for ts in (params, m, v)]
    kernels.adam_step_multi(expected[0], grads, expected[1], expected[2], steps, hparams=hp, grad_scale=0.5)
    sums = []
    for threads in (1, 2):
        state = [[t.clone() for t in ts] for ts in (params, m, v)]
        sumsq, applied = kernels.adam_step_multi_if_finite(
            state[0], grads, state[1], state[2], steps, hparams=hp, grad_scale=0.5, num_threads=threads
        )
        assert applied
        for got, want in zip(state, expected):
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        sums.append(sumsq)
    assert sums[0] == sums[1]  # fixed chunks summed in order: the same for any thread count
    assert sums[0] == pytest.approx(sum(float((g.double() ** 2).sum()) for g in grads), rel=1e-12)


@pytest.mark.parametrize(
    "where", [(0, 5), (1, 69_999), (3, 150_000), (4, 0)], ids=["first", "chunk1", "chunk3", "last"]
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_checked_step_with_a_nonfinite_grad_changes_nothing(backend: str, where, bad: float) -> None:
    hp = adam_args(adamw_mode=True)
    params, grads, m, v = checked_state(1)
    grads[where[0]][where[1]] = bad
    before = [[t.clone() for t in ts] for ts in (params, m, v)]
    with torch.no_grad():
        stepped = [[t.clone() for t in ts] for ts in (params, m, v)]
        finite = [g.nan_to_num(0.0, 0.0, 0.0) for g in grads]
        kernels.adam_step_multi(stepped[0], finite, stepped[1], stepped[2], [4] * 5, hparams=hp)
    for threads in (1, 2):
        state = [[t.clone() for t in ts] for ts in (params, m, v)]
        sumsq, applied = kernels.adam_step_multi_if_finite(
            state[0], grads, state[1], state[2], [4] * 5, hparams=hp, num_threads=threads
        )
        assert not applied and sumsq == math.inf
        for name, got, original, after in zip(("param", "exp_avg", "exp_avg_sq"), state, before, stepped):
            for g, o, a in zip(got, original, after):
                # chunks updated before the bad one was seen were undone: adam_undo's tolerance; the rest is untouched
                ulp = torch.nextafter(o.abs(), torch.tensor(math.inf)) - o.abs()
                assert ((g - o).abs() <= 1e-5 * (a - o).abs().max() + 2 * ulp).all(), name


def test_checked_step_refuses_what_it_cannot_take_back() -> None:
    zeroing = kernels.AdamArgs(lr=0.5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=2.0, adamw_mode=True)
    t = [[torch.zeros(4)] for _ in range(4)]
    with pytest.raises(ValueError, match="cannot be undone"):
        kernels.adam_step_multi_if_finite(*t, [1], hparams=zeroing)
    with pytest.raises(TypeError, match="fp32 grads only"):
        bf16 = [torch.zeros(4, dtype=torch.bfloat16)]
        kernels.adam_step_multi_if_finite(t[0], bf16, t[2], t[3], [1], hparams=adam_args(adamw_mode=True))


def test_undo_refuses_a_step_that_zeroed_the_params_and_bad_arguments() -> None:
    zeroing = kernels.AdamArgs(lr=0.5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=2.0, adamw_mode=True)
    assert not kernels.can_undo(zeroing) and kernels.can_undo(adam_args(adamw_mode=True))
    t = [torch.zeros(4) for _ in range(4)]
    with pytest.raises(ValueError, match="cannot be undone"):
        kernels.adam_undo(*t, hparams=zeroing, step=1)
    hp = adam_args(adamw_mode=True)
    with pytest.raises(TypeError, match="grad has dtype torch.bfloat16"):
        kernels.adam_undo(t[0], t[1].bfloat16(), t[2], t[3], hparams=hp, step=1)
    with pytest.raises(ValueError, match="exp_avg_sq has 3 elements"):
        kernels.adam_undo(t[0], t[1], t[2], torch.zeros(3), hparams=hp, step=1)
    with pytest.raises(ValueError, match="step must be >= 1"):
        kernels.adam_undo(*t, hparams=hp, step=0)
