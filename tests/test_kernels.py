"""lightning_zero_offload.kernels against torch, a float64 reference and itself, on every backend.

Tolerances. The native Adam kernel performs torch's single-tensor operations in torch's order, in
fp32, with fused multiply-adds where torch's vectorised CPU kernels use them. The one systematic
difference is the square root: ours is correctly rounded, torch's (MKL) is within 1 ulp. So after
S steps the params differ by at most a few roundings per step: |dp| <= S * (ulp(p) + 2^-21 lr),
i.e. rtol = S * 2^-23 and atol = S * lr * 2^-21 (observed: below a fifth of that). Rounding errors of
the moments scale with the terms they add up: atol = S * 2^-23 * |g|max for exp_avg and its square
for exp_avg_sq. The portable backend on CPUs without FMA rounds multiply-adds separately and stays
inside the same bounds. Against float64, Adam's L2 mode can be ill-conditioned; see
test_adam_matches_torch_and_float64.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import sys
import warnings

import pytest
import torch

from lightning_zero_offload import kernels

# fixtures in tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_torch_thread", "torch_seed")

BACKENDS = kernels.available_backends()
NATIVE = [b for b in BACKENDS if b != "torch"]
SIMD = [b for b in NATIVE if b != "scalar"]
SIZES = [0, 1, 7, 15, 16, 17, 31, 63, 64, 65, 1023, 2**20 + 3]
LOW = [torch.bfloat16, torch.float16]
HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}


@pytest.fixture(params=NATIVE)
def native(request: pytest.FixtureRequest):
    previous = kernels.backend()
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend(previous)


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
    for step, g in enumerate(grads, start=1):
        kernels.adam_step(p, g, m, v, step=step, adamw_mode=adamw_mode, maximize=maximize, **hp, **kw)
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


# --------------------------------------------------------------------------------------------------
# Adam step


@functools.cache
def every_size_case(size: int):
    """Inputs and torch's result, shared by the backends (tests run grouped by size)."""
    p0 = torch.randn(size, generator=torch.Generator().manual_seed(size))
    grads = grads_like(size, 20, seed=size)
    return p0, grads, torch_steps(p0, grads, HP, adamw_mode=True, maximize=False)


def test_the_native_extension_was_built_with_every_kernel() -> None:
    """The extension is optional at install time (no compiler: torch fallback), so a source that stops
    compiling would pass silently; on machines with a compiler, as here and in CI, it must be there."""
    import shutil

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the torch fallback is expected")
    assert kernels.lib is not None, f"the native extension failed to build or load: {kernels._import_error}"
    for name in ("lzo_adam_step", "lzo_adam_undo", "lzo_grad_accumulate", "lzo_fingerprint16"):
        assert hasattr(kernels.lib, name), f"{name} is missing from the built extension: rebuild it (pip install -e .)"


@pytest.mark.parametrize("size", SIZES)
def test_adam_matches_torch_every_size(size: int, backend: str) -> None:
    p0, grads, expected = every_size_case(size)
    ours = our_steps(p0, grads, HP, adamw_mode=True, maximize=False)
    assert_adam_close(ours, expected, len(grads), HP, grad_bound(p0, grads, HP))


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
@pytest.mark.parametrize(
    "lr,betas,eps",
    [
        (1e-3, (0.9, 0.999), 1e-8),
        (1e-1, (0.8, 0.99), 1e-6),
        (3e-2, (0.3, 0.5), 1e-3),
    ],  # beta1 < 0.5: lerp's other branch
    ids=["default", "fast", "low-beta"],
)
def test_adam_matches_torch_and_float64(backend, adamw_mode, weight_decay, maximize, lr, betas, eps) -> None:
    steps, n = 25, 1023
    hp = {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps, "weight_decay": weight_decay}
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
    grads = grads_like(n, steps, seed=7)
    ours = our_steps(p0, grads, hp, adamw_mode, maximize)
    gmax = grad_bound(p0, grads, hp)
    expected = torch_steps(p0, grads, hp, adamw_mode, maximize)
    exact = reference64(p0, grads, hp, adamw_mode, maximize)
    # In Adam (L2) mode a gradient that nearly cancels weight_decay * param loses its relative
    # precision in fp32, and Adam's normalisation by sqrt(v) amplifies that: torch's own fp32 result
    # is then far from the exact one. Where it is, we allow ours the same distance (3x, to cover
    # both being off in opposite directions); elsewhere the plain rounding bound applies.
    slack = tuple(3 * (t.double() - x).abs() for t, x in zip(expected, exact))
    assert_adam_close(ours, expected, steps, hp, gmax, slack)
    assert_adam_close(ours, exact, steps, hp, gmax, slack)


def test_grad_scale_is_applied_first(backend: str) -> None:
    """adam_step(grad, grad_scale=s) == adam_step(grad * s): the engine's unscale x clip factor."""
    n, steps, scale = 4099, 10, 0.125  # a power of two: g * s is exact, so both runs see equal grads
    p0, grads = torch.randn(n, generator=torch.Generator().manual_seed(2)), grads_like(n, steps, seed=3)
    scaled = our_steps(p0, grads, HP, adamw_mode=False, maximize=True, grad_scale=scale)
    reference = our_steps(p0, [g * scale for g in grads], HP, adamw_mode=False, maximize=True)
    for a, b in zip(scaled, reference):
        assert torch.equal(a, b)
    other = our_steps(p0, grads, HP, adamw_mode=True, maximize=False, grad_scale=0.3)
    expected = torch_steps(p0, [g * 0.3 for g in grads], HP, True, False)
    assert_adam_close(other, expected, steps, HP, grad_bound(p0, grads, HP, 0.3))


def test_multi_equals_single_calls(backend: str) -> None:
    """One call over many tensors (each with its own step) == one call per tensor."""
    sizes = [1, 17, 0, 4096, 70_001, 3]
    steps = [1, 5, 2, 9, 3, 100]
    params = [torch.randn(s) for s in sizes]
    grads = [torch.randn(s).to(torch.bfloat16) for s in sizes]
    moments = [(torch.rand(s), torch.rand(s)) for s in sizes]
    single = [
        (p.clone(), m.clone(), v.clone(), torch.empty(s, dtype=torch.float16))
        for p, (m, v), s in zip(params, moments, sizes)
    ]
    multi = [
        (p.clone(), m.clone(), v.clone(), torch.empty(s, dtype=torch.float16))
        for p, (m, v), s in zip(params, moments, sizes)
    ]
    for (p, m, v, out), g, step in zip(single, grads, steps):
        kernels.adam_step(p, g, m, v, step=step, adamw_mode=True, grad_scale=0.5, param_out=out, **HP)
    kernels.adam_step_multi(
        [t[0] for t in multi],
        grads,
        [t[1] for t in multi],
        [t[2] for t in multi],
        steps,
        adamw_mode=True,
        grad_scale=0.5,
        params_out=[t[3] for t in multi],
        **HP,
    )
    for a, b in zip(single, multi):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_multi_with_torch_step_counters(backend: str) -> None:
    """torch-format step tensors: the call uses count + 1 and stores it back, like torch's step_t += 1."""
    sizes, counts = [5, 300, 1], [0.0, 6.0, 41.0]
    params, grads = [torch.randn(s) for s in sizes], [torch.randn(s) for s in sizes]
    with_ints = [
        [t.clone() for t in params],
        [torch.zeros(s) for s in sizes],
        [torch.zeros(s) for s in sizes],
    ]
    with_counters = [
        [t.clone() for t in params],
        [torch.zeros(s) for s in sizes],
        [torch.zeros(s) for s in sizes],
    ]
    counters = [torch.tensor(c) for c in counts]
    kernels.adam_step_multi(*with_ints[:1], grads, *with_ints[1:], [int(c) + 1 for c in counts], adamw_mode=True, **HP)
    kernels.adam_step_multi(*with_counters[:1], grads, *with_counters[1:], counters, adamw_mode=True, **HP)
    assert [float(c) for c in counters] == [c + 1 for c in counts]
    for a, b in zip(with_ints, with_counters):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    p = [torch.zeros(2), torch.zeros(2)]
    with pytest.raises(ValueError, match=r"steps\[1\] holds -3.0; a step count must be >= 0"):
        kernels.adam_step_multi(p, p, p, p, [torch.tensor(0.0), torch.tensor(-3.0)], adamw_mode=True, **HP)
    with pytest.raises(TypeError, match=r"steps\[1\] must be a 0-dim float32 CPU tensor"):
        kernels.adam_step_multi(p, p, p, p, [torch.tensor(0.0), torch.tensor([1.0])], adamw_mode=True, **HP)


@pytest.mark.skipif(len(SIMD) < 2, reason="needs two SIMD backends")
@pytest.mark.parametrize("grad_dtype", [torch.float32, *LOW])
def test_simd_backends_agree_bitwise(grad_dtype: torch.dtype) -> None:
    """AVX2 and AVX-512 run the same operations: the same bits, tails included."""
    previous = kernels.backend()
    n = 100_003
    results = []
    for name in SIMD:
        kernels.set_backend(name)
        p, m, v = torch.randn(n, generator=torch.Generator().manual_seed(1)), torch.zeros(n), torch.zeros(n)
        out = torch.empty(n, dtype=torch.bfloat16)
        for step, g in enumerate(grads_like(n, 4, seed=2), start=1):
            kernels.adam_step(p, g.to(grad_dtype), m, v, step=step, adamw_mode=False, param_out=out, **HP)
        results.append((p, m, v, out))
    kernels.set_backend(previous)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("grad_dtype", LOW)
@pytest.mark.parametrize("out_dtype", [None, *LOW])
def test_fused_low_precision_step(backend: str, grad_dtype: torch.dtype, out_dtype) -> None:
    """bf16/fp16 grad in, fp32 master/moments, low-precision copy out: the offload step in one pass.

    Against the torch composition (cast the grad to fp32, scale, AdamW, cast the param): the master
    and moments agree to fp32 rounding, and param_out is bitwise the rounding of our own master.
    """
    n, steps, scale = 2**16 + 5, 8, 0.37
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(3))
    grads = [g.to(grad_dtype) for g in grads_like(n, steps, seed=11)]
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    # a view at an odd element offset: the streaming stores of the copy-out must handle misalignment
    out = None if out_dtype is None else torch.full((n + 1,), 7.0, dtype=out_dtype)[1:]
    for step, g in enumerate(grads, start=1):
        kernels.adam_step(p, g, m, v, step=step, adamw_mode=True, grad_scale=scale, param_out=out, **HP)
    expected = torch_steps(p0, [g.float() * scale for g in grads], HP, adamw_mode=True, maximize=False)
    assert_adam_close((p, m, v), expected, steps, HP, grad_bound(p0, [g.float() for g in grads], HP, scale))
    if out is not None:
        assert torch.equal(out, p.to(out_dtype))


@pytest.mark.parametrize("out_dtype", LOW)
@pytest.mark.parametrize("extrapolate", [1.0, 0.5])
def test_extrapolated_copy_out(backend: str, out_dtype: torch.dtype, extrapolate: float) -> None:
    """param_out = p_new + extrapolate * (p_new - p_old), rounded once; the master is not affected."""
    n = 2**16 + 5
    gen = torch.Generator().manual_seed(5)
    p_old, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    p, m, v = p_old.clone(), torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
    p_plain, m_plain, v_plain = p.clone(), m.clone(), v.clone()
    out = torch.empty(n + 1, dtype=out_dtype)[1:]  # odd offset: the streaming-store path
    hp = {**HP, "lr": 0.1}  # steps well above a bf16 ulp, so the prediction shows in the copy
    kernels.adam_step(p, g, m, v, step=3, adamw_mode=True, param_out=out, extrapolate=extrapolate, **hp)
    kernels.adam_step(p_plain, g, m_plain, v_plain, step=3, adamw_mode=True, **hp)
    assert torch.equal(p, p_plain) and torch.equal(m, m_plain) and torch.equal(v, v_plain)
    # extrapolate is a power of two here, so the fused multiply-add and torch's fp32 ops round alike
    assert torch.equal(out, (p + extrapolate * (p - p_old)).to(out_dtype))
    assert (out != p.to(out_dtype)).float().mean() > 0.5  # the prediction did move the copy


def test_extrapolate_without_param_out_is_an_error() -> None:
    p, g, m, v = torch.zeros(8), torch.ones(8), torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="param_out"):
        kernels.adam_step(p, g, m, v, step=1, adamw_mode=True, extrapolate=1.0, **HP)


def test_zero_lr_copies_out_with_exact_rounding(backend: str) -> None:
    """With lr=0 the param is unchanged, so param_out checks fp32 -> bf16/fp16 rounding itself."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int64, generator=gen).to(torch.int32)
    ties_fp16 = [2.0**-25 * k for k in range(1, 64, 2)] + [1 + 2**-11, 1 + 3 * 2**-11, 2048 + 1, 2048 + 3]
    ties_bf16 = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)]
    edges = [
        0.0,
        -0.0,
        65504.0,
        65519.99,
        65520.0,
        2.0**-14,
        2.0**-24,
        2.0**-25,
        2.0**-26,
        3.4e38,
        1e-45,
        float("inf"),
        float("-inf"),
        float("nan"),
        2.0**-14 * (1 - 2**-11),
    ]
    special = torch.tensor(ties_fp16 + ties_bf16 + edges, dtype=torch.float32)
    p = torch.cat([bits.view(torch.float32), special, -special])
    n = p.numel()
    for dtype in LOW:
        out = torch.empty(n, dtype=dtype)
        master = p.clone()
        kernels.adam_step(
            master,
            torch.zeros(n),
            torch.zeros(n),
            torch.zeros(n),
            step=1,
            lr=0.0,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            adamw_mode=True,
            param_out=out,
        )
        nan = p.isnan()
        assert torch.equal(master[~nan], p[~nan]) and master[nan].isnan().all()
        expected = p.to(dtype)
        assert out[nan].isnan().all()
        assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


# --------------------------------------------------------------------------------------------------
# gradient accumulation


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("src_dtype", [torch.float32, *LOW])
def test_grad_accumulate_matches_reference(backend: str, size: int, src_dtype: torch.dtype) -> None:
    dst0 = torch.randn(size)
    src = torch.randn(size).to(src_dtype)
    for overwrite in (False, True):
        dst = torch.empty(size + 1)[1:].copy_(dst0)  # misaligned, for the streaming stores
        sumsq, nonfinite = kernels.grad_accumulate(dst, src, scale=0.75, overwrite=overwrite)
        expected = src.float() * 0.75 if overwrite else dst0 + src.float() * 0.75
        assert torch.equal(dst, expected)  # one rounding each: exact cast, multiply, add
        # squares of floats are exact in double: only the order of the double sum differs
        assert sumsq == pytest.approx(float((expected.double() ** 2).sum()), rel=1e-10, abs=0.0)
        assert nonfinite is False


@pytest.mark.parametrize("src_dtype", [torch.float32, *LOW])
def test_grad_accumulate_converts_every_low_precision_value_exactly(backend: str, src_dtype) -> None:
    if src_dtype == torch.float32:
        src = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    else:
        src = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(src_dtype)
    dst = torch.empty(src.numel())
    kernels.grad_accumulate(dst, src, overwrite=True)
    expected = src.float()
    nan = expected.isnan()
    assert dst[nan].isnan().all()
    assert torch.equal(dst[~nan].view(torch.int32), expected[~nan].view(torch.int32))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("src_dtype", [torch.float32, *LOW])
def test_grad_accumulate_flags_nonfinite(backend: str, bad: float, src_dtype: torch.dtype) -> None:
    for position in (0, 16, 1030):  # first vector, a middle one, the tail
        src = torch.ones(1031, dtype=src_dtype)
        src[position] = bad
        for overwrite in (False, True):
            sumsq, nonfinite = kernels.grad_accumulate(torch.zeros(1031), src, overwrite=overwrite)
            assert nonfinite is True and not math.isfinite(sumsq)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("src_dtype", [torch.float32, *LOW])
def test_sum_of_squares_is_an_overwriting_accumulate_without_the_write(
    backend: str, size: int, src_dtype: torch.dtype
) -> None:
    src = torch.empty(size + 1, dtype=src_dtype)[1:]  # misaligned, as a gradient may be
    src.copy_(torch.randn(size) * 3)
    before = src.clone()
    for threads in (1, 2):
        sumsq, nonfinite = kernels.sum_of_squares(src, num_threads=threads)
        expected, _ = kernels.grad_accumulate(torch.empty(size), src, overwrite=True, num_threads=threads)
        assert sumsq == expected and nonfinite is False  # bitwise: same blocks, same order
    assert torch.equal(src, before)
    if size:
        src[size // 2] = float("nan")
        assert kernels.sum_of_squares(src)[1] is True


def test_grad_accumulate_flags_overflow_from_scale_and_existing_inf(backend: str) -> None:
    _, nonfinite = kernels.grad_accumulate(torch.zeros(100), torch.full((100,), 1e30), scale=1e10)
    assert nonfinite
    _, nonfinite = kernels.grad_accumulate(torch.full((100,), 3e38), torch.full((100,), 3e38))  # sum overflows
    assert nonfinite
    dst = torch.ones(100)
    dst[50] = float("inf")
    assert kernels.grad_accumulate(dst, torch.ones(100))[1]  # add mode keeps an inf already there
    assert not kernels.grad_accumulate(dst, torch.ones(100), overwrite=True)[1]  # overwrite replaces it
    big = torch.full((100,), 3e38)  # finite, but its square overflows fp32: the double sum does not
    assert kernels.grad_accumulate(torch.zeros(100), big) == (pytest.approx(100 * 3e38**2), False)


# --------------------------------------------------------------------------------------------------
# undo: taking a speculated step back

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
    kernels.adam_step(state[0], grad, state[1], state[2], step=7, grad_scale=scale, **hp)
    return before, state, grad


@pytest.mark.parametrize("case", sorted(UNDO_CASES))
@pytest.mark.parametrize("n", [0, 1, 17, 2**16 + 5, 2**20 + 3])  # empty, tails, one chunk, many chunks
def test_undo_restores_the_state_before_the_step(backend: str, case: str, n: int) -> None:
    hp, scale = UNDO_CASES[case]
    before, state, grad = stepped_state(n, hp, scale, seed=n)
    after = [t.clone() for t in state]
    kernels.adam_undo(*state[:1], grad, *state[1:], hparams=kernels.AdamHyperparams(**hp), step=7, grad_scale=scale)
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
        kernels.adam_undo(
            copy[0], grad, copy[1], copy[2], hparams=kernels.AdamHyperparams(**hp), step=7, grad_scale=scale
        )
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
    hp = kernels.AdamHyperparams(**HP, adamw_mode=True)
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
    hp = kernels.AdamHyperparams(**HP, adamw_mode=True)
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
    zeroing = kernels.AdamHyperparams(lr=0.5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=2.0, adamw_mode=True)
    t = [[torch.zeros(4)] for _ in range(4)]
    with pytest.raises(ValueError, match="cannot be undone"):
        kernels.adam_step_multi_if_finite(*t, [1], hparams=zeroing)
    with pytest.raises(TypeError, match="fp32 grads only"):
        bf16 = [torch.zeros(4, dtype=torch.bfloat16)]
        kernels.adam_step_multi_if_finite(
            t[0], bf16, t[2], t[3], [1], hparams=kernels.AdamHyperparams(**HP, adamw_mode=True)
        )


def test_undo_refuses_a_step_that_zeroed_the_params_and_bad_arguments() -> None:
    zeroing = kernels.AdamHyperparams(lr=0.5, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=2.0, adamw_mode=True)
    assert not kernels.can_undo(zeroing) and kernels.can_undo(kernels.AdamHyperparams(**HP, adamw_mode=True))
    t = [torch.zeros(4) for _ in range(4)]
    with pytest.raises(ValueError, match="cannot be undone"):
        kernels.adam_undo(*t, hparams=zeroing, step=1)
    hp = kernels.AdamHyperparams(**HP, adamw_mode=True)
    with pytest.raises(TypeError, match="grad has dtype torch.bfloat16"):
        kernels.adam_undo(t[0], t[1].bfloat16(), t[2], t[3], hparams=hp, step=1)
    with pytest.raises(ValueError, match="exp_avg_sq has 3 elements"):
        kernels.adam_undo(t[0], t[1], t[2], torch.zeros(3), hparams=hp, step=1)
    with pytest.raises(ValueError, match="step must be >= 1"):
        kernels.adam_undo(*t, hparams=hp, step=0)


# --------------------------------------------------------------------------------------------------
# threads


@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_threads_bitwise_identical(native: str, out_dtype) -> None:
    n = 2**20 + 3
    runs = []
    for threads in (1, 2):
        p, m, v = torch.randn(n, generator=torch.Generator().manual_seed(5)), torch.zeros(n), torch.zeros(n)
        out = None if out_dtype is None else torch.empty(n, dtype=out_dtype)
        sizes = [1000, 3, 2**19, 77_777]
        ps, ms = ([torch.randn(s, generator=torch.Generator().manual_seed(s)) for s in sizes] for _ in range(2))
        vs = [torch.rand(s, generator=torch.Generator().manual_seed(s)) for s in sizes]
        for step, g in enumerate(grads_like(n, 3, seed=6), start=1):
            kernels.adam_step(
                p,
                g.to(torch.float16),
                m,
                v,
                step=step,
                adamw_mode=True,
                param_out=out,
                num_threads=threads,
                **HP,
            )
            kernels.adam_step_multi(
                ps, [g[:s] for s in sizes], ms, vs, [step] * 4, adamw_mode=False, num_threads=threads, **HP
            )
        dst = torch.randn(n, generator=torch.Generator().manual_seed(8))
        sums = [kernels.grad_accumulate(dst, g, scale=0.3, num_threads=threads) for g in grads_like(n, 3, seed=9)]
        runs.append([p, m, v, dst, *ps, *ms, *vs] + ([] if out is None else [out]) + [torch.tensor(sums)])
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"result {i} differs between 1 and 2 threads"


def test_thread_count_defaults_to_usable_cores() -> None:
    import os

    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    previous = kernels.get_num_threads()
    try:
        assert previous == expected  # not OMP_NUM_THREADS, which torchrun sets to 1
        kernels.set_num_threads(3)
        assert kernels.get_num_threads() == 3
        with pytest.raises(ValueError, match="must be >= 1"):
            kernels.set_num_threads(0)
    finally:
        kernels.set_num_threads(previous)


# --------------------------------------------------------------------------------------------------
# backends and the fallback


def test_backend_selection() -> None:
    assert BACKENDS[-1] == "torch"
    assert kernels.backend() == BACKENDS[0]  # the best path is chosen at import
    with pytest.raises(ValueError, match=r"backend 'sve' is not available on this machine; choose one of \["):
        kernels.set_backend("sve")


def load_kernels_copy(monkeypatch: pytest.MonkeyPatch, native_missing: bool, env: str | None = None):
    """Import a fresh copy of kernels.py (the real module is left alone); returns it and its warnings."""
    if native_missing:
        monkeypatch.setitem(sys.modules, "lightning_zero_offload._native", None)  # import now fails
    if env is None:
        monkeypatch.delenv("LZO_BACKEND", raising=False)
    else:
        monkeypatch.setenv("LZO_BACKEND", env)
    spec = importlib.util.spec_from_file_location("lzo_kernels_copy", kernels.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # as an import would (dataclasses look it up)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec.loader.exec_module(module)
    return module, caught


def test_missing_native_library_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    fallback, caught = load_kernels_copy(monkeypatch, native_missing=True)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "native CPU kernels are not built" in message
    assert "install a C compiler" in message and "pip install --force-reinstall --no-deps -e ." in message
    assert fallback.backend() == "torch" and fallback.available_backends() == ["torch"]
    with pytest.raises(ValueError, match="choose one of \\['torch'\\]"):
        fallback.set_backend("avx2")
    # everything still works, with the same results as the real module's torch path
    n, steps = 1000, 5
    p0, grads = torch.randn(n, generator=torch.Generator().manual_seed(4)), grads_like(n, steps, seed=4)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    for step, g in enumerate(grads, start=1):
        fallback.adam_step(p, g.to(torch.bfloat16), m, v, step=step, adamw_mode=True, param_out=out, **HP)
    expected = torch_steps(p0, [g.to(torch.bfloat16).float() for g in grads], HP, True, False)
    assert_adam_close((p, m, v), expected, steps, HP, grad_bound(p0, grads, HP))
    assert torch.equal(out, p.to(torch.bfloat16))
    dst = torch.zeros(n)
    sumsq, nonfinite = fallback.grad_accumulate(dst, grads[0], scale=2.0)
    assert torch.equal(dst, grads[0] * 2.0) and not nonfinite
    assert sumsq == pytest.approx(float((dst.double() ** 2).sum()), rel=1e-12)


@pytest.mark.skipif(not NATIVE, reason="no native build")
def test_env_var_forces_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    previous = kernels.backend()
    try:
        forced, caught = load_kernels_copy(monkeypatch, native_missing=False, env="scalar")
        assert forced.backend() == "scalar" and not caught
        forced, _ = load_kernels_copy(monkeypatch, native_missing=False, env="torch")
        assert forced.backend() == "torch"
        with pytest.raises(ValueError, match=r"LZO_BACKEND='avx9000': backend 'avx9000' is not available"):
            load_kernels_copy(monkeypatch, native_missing=False, env="avx9000")
    finally:
        kernels.set_backend(previous)  # the copies selected an instruction set in the shared C library


# --------------------------------------------------------------------------------------------------
# argument checks


def adam_args(n: int = 8, **overrides):
    args = {
        "param": torch.zeros(n),
        "grad": torch.zeros(n),
        "exp_avg": torch.zeros(n),
        "exp_avg_sq": torch.zeros(n),
    }
    kwargs = {"step": 1, "adamw_mode": True, **HP}
    for key, value in overrides.items():
        (args if key in args else kwargs)[key] = value
    return args, kwargs


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (
            {"param": torch.zeros(8, device="meta")},
            ValueError,
            "param is a torch.strided tensor on meta; .*CPU",
        ),
        ({"grad": torch.zeros(16)[::2]}, ValueError, "grad is not contiguous"),
        ({"exp_avg": torch.zeros(9)}, ValueError, "exp_avg has 9 elements but param has 8"),
        (
            {"param": torch.zeros(8, dtype=torch.float64)},
            TypeError,
            "param has dtype torch.float64; expected torch.float32",
        ),
        (
            {"grad": torch.zeros(8, dtype=torch.int32)},
            TypeError,
            "grad has dtype torch.int32; expected torch.float32 or",
        ),
        ({"exp_avg_sq": torch.zeros(8).to_sparse()}, ValueError, "exp_avg_sq is a torch.sparse_coo tensor"),
        (
            {"param_out": torch.zeros(8)},
            TypeError,
            "param_out has dtype torch.float32; expected torch.bfloat16 or",
        ),
        ({"param": [0.0] * 8}, TypeError, "param must be a torch.Tensor, got list"),
        ({"step": 0}, ValueError, r"step must be >= 1 \(the first update is step 1\)"),
        ({"step": 1.0}, TypeError, "step must be an int"),
        ({"lr": -1.0}, ValueError, "lr must be >= 0"),
        ({"lr": float("nan")}, ValueError, "lr must be finite"),
        ({"beta1": 1.0}, ValueError, r"beta1 must be in \[0, 1\)"),
        ({"beta2": -0.1}, ValueError, r"beta2 must be in \[0, 1\)"),
        ({"eps": 0.0}, ValueError, "eps must be > 0"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay must be >= 0"),
        ({"grad_scale": float("inf")}, ValueError, "grad_scale must be finite"),
        ({"lr": "0.1"}, TypeError, "lr must be a real number, got str"),
        ({"num_threads": 0}, ValueError, "num_threads must be >= 1"),
    ],
)
def test_adam_step_rejects_bad_arguments(overrides, error, match) -> None:
    args, kwargs = adam_args(**overrides)
    before = args["param"].clone() if isinstance(args["param"], torch.Tensor) else None
    with pytest.raises(error, match=match):
        kernels.adam_step(*args.values(), **kwargs)
    if before is not None and before.device.type == "cpu":
        assert torch.equal(args["param"], before)  # nothing was touched


def test_hyperparams_record_is_the_keyword_call(backend: str) -> None:
    """hparams=AdamHyperparams(...) runs exactly the update the separate keywords run."""
    n = 1029
    record = kernels.AdamHyperparams(adamw_mode=False, maximize=True, **HP)
    p0, (g,) = torch.randn(n, generator=torch.Generator().manual_seed(4)), grads_like(n, 1, seed=5)
    results = []
    for how in ({"hparams": record}, {"adamw_mode": False, "maximize": True, **HP}):
        p, m, v, out = p0.clone(), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)
        kernels.adam_step(p, g, m, v, step=2, grad_scale=0.3, param_out=out, extrapolate=0.5, **how)
        kernels.adam_step_multi([p], [g], [m], [v], [3], grad_scale=0.7, **how)
        results.append((p, m, v, out))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_hyperparams_record_validates_once_and_converts() -> None:
    hp = kernels.AdamHyperparams(lr=1, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0, adamw_mode=1)
    assert (type(hp.lr), type(hp.weight_decay), hp.adamw_mode, hp.maximize) == (float, float, True, False)
    with pytest.raises(ValueError, match=r"beta1 must be in \[0, 1\)"):
        kernels.AdamHyperparams(lr=1e-3, beta1=1.0, beta2=0.99, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    with pytest.raises(TypeError, match="eps must be a real number, got str"):
        kernels.AdamHyperparams(lr=1e-3, beta1=0.9, beta2=0.99, eps="1e-8", weight_decay=0.0, adamw_mode=True)
    group = {"lr": torch.tensor(0.01), "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1}  # no "maximize"
    assert kernels.AdamHyperparams.from_param_group(group, adamw_mode=True) == kernels.AdamHyperparams(
        lr=float(torch.tensor(0.01)), beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, adamw_mode=True
    )
    with pytest.raises(ValueError, match="lr must be >= 0"):
        kernels.AdamHyperparams.from_param_group({**group, "lr": -1.0}, adamw_mode=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        hp.lr = 2.0


def test_adam_step_takes_the_record_or_the_keywords_not_both() -> None:
    args, _ = adam_args()
    record = kernels.AdamHyperparams(adamw_mode=True, **HP)
    with pytest.raises(TypeError, match="not both .also got lr, maximize"):
        kernels.adam_step(*args.values(), step=1, hparams=record, lr=0.1, maximize=False)
    with pytest.raises(TypeError, match="missing hyperparameters eps, adamw_mode: pass them as keywords"):
        kernels.adam_step(*args.values(), step=1, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0)
    with pytest.raises(TypeError, match="hparams must be an AdamHyperparams, got dict"):
        kernels.adam_step_multi([], [], [], [], [], hparams={"adamw_mode": True, **HP})


def test_multi_rejects_bad_arguments() -> None:
    p = [torch.zeros(4), torch.zeros(5)]
    hp = {"adamw_mode": True, **HP}
    with pytest.raises(ValueError, match="grads has 1 tensors but params has 2"):
        kernels.adam_step_multi(p, [torch.zeros(4)], p, p, [1, 1], **hp)
    with pytest.raises(ValueError, match="steps has 1 entries but params has 2"):
        kernels.adam_step_multi(p, p, p, p, [1], **hp)
    with pytest.raises(ValueError, match=r"steps\[1\] must be >= 1"):
        kernels.adam_step_multi(p, p, p, p, [1, 0], **hp)
    with pytest.raises(ValueError, match=r"exp_avgs\[1\] has 4 elements but params\[1\] has 5"):
        kernels.adam_step_multi(p, p, [torch.zeros(4), torch.zeros(4)], p, [1, 1], **hp)
    mixed = [torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.float16)]
    with pytest.raises(TypeError, match="all grads of one call must share a dtype"):
        kernels.adam_step_multi(
            p, mixed, [torch.zeros(4), torch.zeros(5)], [torch.zeros(4), torch.zeros(5)], [1, 1], **hp
        )
    kernels.adam_step_multi([], [], [], [], [], **hp)  # nothing to do is fine


def test_grad_accumulate_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="src has 3 elements but dst has 4"):
        kernels.grad_accumulate(torch.zeros(4), torch.zeros(3))
    with pytest.raises(TypeError, match="dst has dtype torch.bfloat16; expected torch.float32"):
        kernels.grad_accumulate(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4))
    with pytest.raises(ValueError, match="dst is not contiguous"):
        kernels.grad_accumulate(torch.zeros(4, 2).t(), torch.zeros(8))
    with pytest.raises(ValueError, match="src is a torch.strided tensor on meta"):
        kernels.grad_accumulate(torch.zeros(4), torch.zeros(4, device="meta"))
    with pytest.raises(ValueError, match="scale must be finite"):
        kernels.grad_accumulate(torch.zeros(4), torch.zeros(4), scale=float("nan"))


# --------------------------------------------------------------------------------------------------
# bf16 state: stochastically rounded p, m, v (adam_step_bf16_state)

BF16_SIZES = [1, 7, 15, 16, 17, 31, 33, 1023, 2**16 + 5, 3 * 2**16 + 17]  # tails, one chunk, several
BF16_CASES = {
    "adamw": dict(HP, adamw_mode=True),
    "adam-l2-max": dict(HP, adamw_mode=False, maximize=True),
    "beta1-small": dict(HP, beta1=0.3, adamw_mode=True),  # lerp from the start, not from the end
}


def bits16(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def bf16_state(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 params and moments as after some training (v > 0, m of either sign)."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 0.01
    v = torch.rand(n, generator=gen) * 1e-4
    return p.bfloat16(), m.bfloat16(), v.bfloat16()


def bf16_state_steps(n: int, grad_dtype, case: str, threads: int | None = None, steps: int = 3, seed: int = 42):
    p, m, v = bf16_state(n, seed=n)
    for step, g in enumerate(grads_like(n, steps, seed=n + 1), start=1):
        kernels.adam_step_bf16_state(
            p, g.to(grad_dtype), m, v, step=step, seed=seed, offset=11, grad_scale=0.37, num_threads=threads,
            **BF16_CASES[case],
        )  # fmt: skip
    return p, m, v


@functools.cache
def bf16_state_reference(n: int, grad_dtype, case: str):
    """The torch backend's result: the reference every native backend must match bitwise."""
    previous = kernels.backend()
    kernels.set_backend("torch")
    try:
        return bf16_state_steps(n, grad_dtype, case)
    finally:
        kernels.set_backend(previous)


@pytest.mark.parametrize("case", sorted(BF16_CASES))
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("size", BF16_SIZES)
def test_bf16state_bitwise_on_every_backend_and_thread_count(backend: str, size: int, grad_dtype, case: str) -> None:
    expected = bf16_state_reference(size, grad_dtype, case)
    for threads in (1, 2, 3) if backend != "torch" else (1,):
        actual = bf16_state_steps(size, grad_dtype, case, threads=threads)
        for name, a, e in zip(("param", "exp_avg", "exp_avg_sq"), actual, expected):
            differ = int((bits16(a) != bits16(e)).sum())
            assert differ == 0, f"{backend}, {threads} threads: {differ} of {size} {name} bits differ from torch's"


@pytest.mark.skipif(not SIMD, reason="needs a SIMD backend (the fp32 kernel with fused multiply-adds)")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_bf16state_is_the_fp32_step_stochastically_rounded(backend: str, grad_dtype) -> None:
    """Before rounding, the bf16-state step is bitwise the fp32 kernel's update of the widened state."""
    n, step, seed, offset = 2**16 + 37, 5, 7, 1000
    p, m, v = bf16_state(n, seed=3)
    g = grads_like(n, 1, seed=4)[0].to(grad_dtype)
    hp = dict(HP, adamw_mode=False)
    p32, m32, v32 = p.float(), m.float(), v.float()
    previous = kernels.backend()
    kernels.set_backend(SIMD[0])
    kernels.adam_step(p32, g, m32, v32, step=step, grad_scale=0.37, **hp)
    kernels.set_backend(previous)
    kernels.adam_step_bf16_state(p, g, m, v, step=step, seed=seed, offset=offset, grad_scale=0.37, **hp)
    for a, exact, r in zip((p, m, v), (p32, m32, v32), kernels._sr_bits(seed, step, offset, n)):
        assert torch.equal(bits16(a), bits16(kernels._round_bf16_stochastic(exact, r)))
        # and the rounding picked one of the two neighbours of the fp32 value
        down = (exact.view(torch.int32) >> 16).to(torch.int16)
        assert ((bits16(a) == down) | (bits16(a) == down + 1)).all()


def test_bf16state_any_split_gives_the_same_bits(backend: str) -> None:
    """The bits depend on the global element index: calls on pieces with their offsets equal one call,
    also across a multiple of 2^32 (where the kernel's 32-bit index wraps and the keys change)."""
    n = 3 * 2**16 + 5
    for base in (0, 2**32 - 2**17 - 3):
        whole = bf16_state(n, seed=1)
        g = grads_like(n, 1, seed=2)[0]
        kernels.adam_step_bf16_state(
            *whole[:1], g, *whole[1:], step=2, seed=9, offset=base, **dict(HP, adamw_mode=True)
        )
        pieces = bf16_state(n, seed=1)
        cuts = [0, 1, 17, 2**16 - 1, 2**17 + 3, 2**17 + 4, n]
        for a, b in zip(cuts, cuts[1:]):
            p, m, v = (t[a:b] for t in pieces)
            kernels.adam_step_bf16_state(p, g[a:b], m, v, step=2, seed=9, offset=base + a, **dict(HP, adamw_mode=True))
        for x, y in zip(whole, pieces):
            assert torch.equal(bits16(x), bits16(y))


def rounding_counts(exact: torch.Tensor, results: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """How often each fp32 value was rounded up (away from zero), and its probability of that."""
    down = (exact.view(torch.int32) >> 16).to(torch.int16)
    ups = torch.zeros(exact.numel(), dtype=torch.float64)
    for r in results:
        assert ((bits16(r) == down) | (bits16(r) == down + 1)).all(), "not one of the two bf16 neighbours"
        ups += (bits16(r) == down + 1).double()
    frac = (exact.view(torch.int32).to(torch.int64) & 0xFFFF).double() / 65536
    return ups, frac


def test_bf16state_stochastic_rounding_is_unbiased(backend: str) -> None:
    """E[stored bf16] = the fp32 value, for p, m and v, over many seeds.

    With beta1 = 0 the new m is the gradient itself, with beta2 = 0 the new v is its square rounded
    to fp32, and with a zero gradient and lr = 0 ... AdamW's decay alone moves p: so the fp32 values
    before rounding are known exactly. Each value rounds up with probability f (its dropped fraction
    of an ulp), so over K seeds the round-ups of all elements sum to K * sum(f) with variance
    K * sum(f (1 - f)): the test allows 5 standard deviations, overall and in each quarter of f.
    """
    n, seeds = 4096, 160
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 3, (n,), generator=gen).float()
    g[:64] = torch.rand(64, generator=gen) * 2.0**-126  # fp32 subnormals: rounded like any value
    p0 = torch.randn(n, generator=gen).bfloat16()
    moments = dict(lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    decay = dict(lr=0.3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.5, adamw_mode=True)
    ms, vs, ps = [], [], []
    for seed in range(seeds):
        p, m, v = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        kernels.adam_step_bf16_state(p, g, m, v, step=1, seed=seed, **moments)
        assert torch.equal(bits16(p), bits16(p0))  # lr = 0: p is exactly its bf16 value
        ms.append(m)
        vs.append(v)
        p = p0.clone()
        m, v = torch.zeros_like(m), torch.zeros_like(v)
        kernels.adam_step_bf16_state(p, torch.zeros(n), m, v, step=1, seed=seed, **decay)
        ps.append(p)
    decay_f32 = torch.tensor(1.0 - 0.3 * 0.5, dtype=torch.float32)
    for name, exact, results in (("exp_avg", g, ms), ("exp_avg_sq", g * g, vs), ("param", p0.float() * decay_f32, ps)):
        ups, frac = rounding_counts(exact, results)
        assert (ups[frac == 0] == 0).all(), f"{name}: a value exact in bf16 was rounded"
        for lo, hi in ((0.0, 1.0), (0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0)):
            sel = (frac >= lo) & (frac < hi)
            expected, var = seeds * frac[sel].sum(), seeds * (frac[sel] * (1 - frac[sel])).sum()
            z = float((ups[sel].sum() - expected) / var.sqrt())
            assert abs(z) < 5, f"{name}: round-ups for f in [{lo}, {hi}) are {z:.1f} standard deviations off"


def test_bf16state_same_seed_and_step_reproduce_other_seeds_and_steps_differ(backend: str) -> None:
    n = 2**16 + 3
    g = grads_like(n, 1, seed=5)[0]
    hp = dict(HP, adamw_mode=True)

    def run(seed: int, step: int):
        p, m, v = bf16_state(n, seed=6)
        kernels.adam_step_bf16_state(p, g, m, v, step=step, seed=seed, **hp)
        return [bits16(t) for t in (p, m, v)]

    first = run(1, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, run(1, 3)))  # resumes bitwise from (seed, step)
    for other in (run(2, 3), run(2**64 - 1, 3), run(1, 4)):
        for a, b in zip(first, other):
            # about half of the values that are not exact in bf16 round the other way
            assert 0.2 < float((a != b).double().mean()) < 0.8


def test_bf16state_random_bits_are_uniform_and_the_streams_independent() -> None:
    """The hash's 16-bit outputs: uniform (chi-square over 256 bins of the top 8 bits), and the p, m
    and v streams, other steps and other seeds uncorrelated (|r| < 5 / sqrt(n))."""
    n = 2**18
    for offset in (0, 2**32 - n // 2):  # one side of the high-word change and both
        streams = list(kernels._sr_bits(3, 1, offset, n)) + [kernels._sr_bits(3, 2, offset, n)[0]]
        streams.append(kernels._sr_bits(4, 1, offset, n)[0])
        for r in streams:
            assert int(r.min()) >= 0 and int(r.max()) < 2**16
            counts = torch.bincount(r >> 8, minlength=256).double()
            chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
            assert chi2 < 255 + 5 * math.sqrt(2 * 255), f"chi-square {chi2:.0f} with 255 degrees of freedom"
        for i, a in enumerate(streams):
            for b in streams[i + 1 :]:
                assert abs(float(torch.corrcoef(torch.stack([a, b]).double())[0, 1])) < 5 / math.sqrt(n)
        neighbours = torch.corrcoef(torch.stack([streams[0][:-1], streams[0][1:]]).double())[0, 1]
        assert abs(float(neighbours)) < 5 / math.sqrt(n)  # consecutive elements


def test_bf16state_follows_the_fp32_step_in_expectation(backend: str) -> None:
    """Updates of 0.13 bf16 ulp a step: round-to-nearest state never moves, stochastic rounding moves
    like the fp32 state on average over seeds.

    p in [1, 2) (bf16 ulp 2^-7), lr = 1e-3 and a constant gradient per element, so Adam moves every
    param by about lr a step in its gradient's direction: 20 steps move 2.6 ulp. The rounding noise of
    p after 20 steps has a standard deviation of at most sqrt(20) / 2 ulp, 0.4 ulp in the mean of 32
    seeds: the per-element RMS deviation from the fp32 drift is allowed 35% of the drift (expected
    15%), the mean over elements 3%.
    """
    n, steps, seeds = 2048, 20, 32
    gen = torch.Generator().manual_seed(1)
    p0 = (1 + torch.rand(n, generator=gen)).bfloat16()
    g = (torch.rand(n, generator=gen) + 0.5) * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    p32, m32, v32 = p0.float(), torch.zeros(n), torch.zeros(n)
    pn, mn, vn = p0.float(), torch.zeros(n), torch.zeros(n)
    for step in range(1, steps + 1):
        kernels.adam_step(p32, g, m32, v32, step=step, **hp)
        kernels.adam_step(pn, g, mn, vn, step=step, **hp)
        for t in (pn, mn, vn):  # bf16 state rounded to nearest
            t.copy_(t.bfloat16())
    mean = torch.zeros(n, dtype=torch.float64)
    for seed in range(seeds):
        p, m, v = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        for step in range(1, steps + 1):
            kernels.adam_step_bf16_state(p, g, m, v, step=step, seed=seed, **hp)
        mean += p.double() / seeds
    drift32, drift_sr = p32.double() - p0.double(), mean - p0.double()
    assert float((pn.double() - p0.double()).abs().max()) == 0.0  # round to nearest: stuck
    assert float((drift_sr - drift32).norm() / drift32.norm()) < 0.35
    assert abs(float((drift_sr - drift32).mean())) < 0.03 * float(drift32.abs().mean())


def test_bf16state_second_moment_decays_where_round_to_nearest_sticks(backend: str) -> None:
    """Why v is stochastically rounded too: after the gradient drops to 0, v must shrink by beta2 a
    step (a 1e-3 relative change, below half a bf16 ulp): rounded to nearest it stays at its peak, so
    the denominator sqrt(v) stays too large; stochastically rounded its mean over elements follows the
    fp32 decay (allowed 1%; the mean of 4096 independent roundings is within 0.1%)."""
    n, hp = 4096, dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    grads = [torch.ones(n)] * 10 + [torch.zeros(n)] * 200
    p, m, v = (
        torch.zeros(n, dtype=torch.bfloat16),
        torch.zeros(n, dtype=torch.bfloat16),
        torch.zeros(n, dtype=torch.bfloat16),
    )
    p32, m32, v32 = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    pn, mn, vn = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, start=1):
        kernels.adam_step_bf16_state(p, g, m, v, step=step, seed=0, **hp)
        kernels.adam_step(p32, g, m32, v32, step=step, **hp)
        kernels.adam_step(pn, g, mn, vn, step=step, **hp)
        vn.copy_(vn.bfloat16())  # only v rounded to nearest
    assert abs(float(v.double().mean()) / float(v32[0]) - 1) < 0.01
    assert float(vn[0]) > 1.2 * float(v32[0])  # stuck near its peak: 0.999^200 = 0.82


def test_bf16state_nan_inf_overflow_and_zero_rules(backend: str) -> None:
    # NaN and inf gradients: NaN is stored as 0x7fc0, inf stays inf
    g = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    p, m, v = (torch.ones(4, dtype=torch.bfloat16) for _ in range(3))
    kernels.adam_step_bf16_state(p, g, m, v, step=1, seed=0, **dict(HP, adamw_mode=True))
    nan, inf, ninf = 0x7FC0, 0x7F80, -128  # 0xff80 as int16
    assert bits16(p)[:3].tolist() == [nan] * 3  # inf / inf in the update
    assert bits16(m)[:3].tolist() == [nan, inf, ninf]
    assert bits16(v)[:3].tolist() == [nan, inf, inf]
    # with beta1 = 0 the new m is the gradient: the rounding rules for chosen fp32 values
    max_bf16 = torch.tensor([0x7F7F0000], dtype=torch.int32).view(torch.float32)
    between = torch.tensor([0x7F7F8000, 0x7F7FFFFF, 0x7F7EFFFF], dtype=torch.int32).view(torch.float32)
    special = torch.cat([max_bf16, -max_bf16, between, -between, torch.tensor([0.0, -0.0, 1e-45, -1e-45])])
    n = 4096
    g = special.repeat(n)
    hp = dict(lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    p, m, v = (
        torch.ones(g.numel(), dtype=torch.bfloat16),
        torch.zeros_like(g).bfloat16(),
        torch.zeros_like(g).bfloat16(),
    )
    kernels.adam_step_bf16_state(p, g, m, v, step=1, seed=5, **hp)
    got = bits16(m).view(n, -1).to(torch.int64) & 0xFFFF
    assert (got[:, 0] == 0x7F7F).all() and (got[:, 1] == 0xFF7F).all()  # the largest finite: exact, never inf
    for col, sign in ((2, 0), (5, 0x8000)):  # halfway to the next binade: inf half of the time
        assert set(got[:, col].unique().tolist()) == {sign | 0x7F7F, sign | 0x7F80}
        assert abs(float((got[:, col] == (sign | 0x7F80)).double().mean()) - 0.5) < 0.05
    assert (((got[:, 3] == 0x7F80) | (got[:, 3] == 0x7F7F)).all()) and (got[:, 3] == 0x7F80).double().mean() > 0.99
    assert ((got[:, 4] == 0x7F7E) | (got[:, 4] == 0x7F7F)).all()  # below the largest finite: never inf
    assert (got[:, 8] == 0).all() and (got[:, 9] == 0x8000).all()  # zeros keep their sign
    # the smallest subnormal is 2^-16 of the smallest bf16 subnormal: rounds up that rarely, or to zero
    assert set(got[:, 10].unique().tolist()) <= {0, 1} and set(got[:, 11].unique().tolist()) <= {0x8000, 0x8001}


def test_bf16state_rejects_bad_arguments() -> None:
    hp = dict(HP, adamw_mode=True)
    p, g = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)
    m, v = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="param has dtype torch.float32; expected torch.bfloat16"):
        kernels.adam_step_bf16_state(torch.zeros(4), g, m, v, step=1, seed=0, **hp)
    with pytest.raises(TypeError, match="exp_avg_sq has dtype torch.float32"):
        kernels.adam_step_bf16_state(p, g, m, torch.zeros(4), step=1, seed=0, **hp)
    with pytest.raises(ValueError, match="grad has 3 elements but param has 4"):
        kernels.adam_step_bf16_state(p, torch.zeros(3), m, v, step=1, seed=0, **hp)
    with pytest.raises(TypeError, match="grad has dtype torch.int32"):
        kernels.adam_step_bf16_state(p, torch.zeros(4, dtype=torch.int32), m, v, step=1, seed=0, **hp)
    with pytest.raises(ValueError, match="not contiguous"):
        kernels.adam_step_bf16_state(
            torch.zeros(4, 2, dtype=torch.bfloat16).t(), torch.zeros(8), m, v, step=1, seed=0, **hp
        )
    for bad, error in ((-1, ValueError), (2**64, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="seed must be"):
            kernels.adam_step_bf16_state(p, g, m, v, step=1, seed=bad, **hp)
    with pytest.raises(ValueError, match="offset must be in"):
        kernels.adam_step_bf16_state(p, g, m, v, step=1, seed=0, offset=-1, **hp)
    with pytest.raises(ValueError, match="step must be >= 1"):
        kernels.adam_step_bf16_state(p, g, m, v, step=0, seed=0, **hp)
    with pytest.raises(TypeError, match="missing hyperparameters lr"):
        kernels.adam_step_bf16_state(
            p, g, m, v, step=1, seed=0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True
        )
