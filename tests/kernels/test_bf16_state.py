"""kernels.adam_step_bf16_state: bf16 p, m, v stochastically rounded, bitwise the same on every backend."""

from __future__ import annotations

import ctypes
import functools
import math
import os
import platform

import pytest
import torch
from kernel_helpers import HP, SIMD, adam_args, grads_like

from lightning_zero_offload import kernels
from lightning_zero_offload.kernels import reference

# fixtures in tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_torch_thread", "torch_seed")

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
            hparams=kernels.AdamArgs(**BF16_CASES[case]),
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


def test_bf16state_bits_do_not_depend_on_the_pieces_threads_claim(backend: str) -> None:
    """Sizes whose pieces per thread are 2^16, between 2^16 and 2^18 (not a power of two) and 2^18."""
    if backend == "torch":
        pytest.skip("the reference runs in one piece")
    for size in (2**19 + 3, 3 * 2**18 + 17, 2**21 + 5):
        one = bf16_state_steps(size, torch.bfloat16, "adamw", threads=1, steps=1)
        for threads in (2, 3):
            many = bf16_state_steps(size, torch.bfloat16, "adamw", threads=threads, steps=1)
            assert all(torch.equal(bits16(a), bits16(b)) for a, b in zip(one, many)), (size, threads)


def test_bf16state_bits_do_not_depend_on_the_prefetch_distance(backend: str) -> None:
    if backend not in SIMD:
        pytest.skip("only the SIMD backends prefetch")
    from lightning_zero_offload.kernels._native import lib

    default = lib.lzo_bf16_prefetch()
    try:
        for grad_dtype in (torch.float32, torch.bfloat16):
            expected = bf16_state_steps(3 * 2**16 + 17, grad_dtype, "adamw", threads=2, steps=1)
            for ahead in (0, 32, 1000, 8192):
                assert lib.lzo_set_bf16_prefetch(ahead) == ahead // 32 * 32  # whole lines of bf16
                actual = bf16_state_steps(3 * 2**16 + 17, grad_dtype, "adamw", threads=2, steps=1)
                assert all(torch.equal(bits16(a), bits16(e)) for a, e in zip(actual, expected)), (ahead, grad_dtype)
    finally:
        assert lib.lzo_set_bf16_prefetch(-1) == default


def level1_data_cache_bytes() -> int:
    """What the C library's ``sysconf(_SC_LEVEL1_DCACHE_SIZE)`` answers, as the kernel asks it (Python's
    ``os.sysconf`` does not know the name in every build); -1 where the name does not exist."""
    if "SC_LEVEL1_DCACHE_SIZE" in os.sysconf_names:
        return os.sysconf("SC_LEVEL1_DCACHE_SIZE")
    if platform.libc_ver()[0] != "glibc":
        return -1
    return ctypes.CDLL(None).sysconf(188)  # glibc's _SC_LEVEL1_DCACHE_SIZE


def test_bf16state_default_prefetch_keeps_a_third_of_the_l1_in_flight() -> None:
    """8 bytes per element over the four streams within L1/3, in lines, clamped to [512, 2048] elements."""
    lib = pytest.importorskip("lightning_zero_offload.kernels._native").lib
    if lib is None:
        pytest.skip("no native extension")
    l1 = level1_data_cache_bytes()
    expected = min(max((l1 if l1 > 0 else 32768) // 3 // 8 // 32 * 32, 512), 2048)
    assert lib.lzo_bf16_prefetch() == expected


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
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [1000, 2**32 - 2**15])  # the second across the index's high-word change
def test_bf16state_is_the_fp32_step_stochastically_rounded(
    backend: str, grad_dtype, adamw_mode: bool, offset: int
) -> None:
    """Before rounding, m and v are bitwise the fp32 kernel's update of the widened state and p is within
    2 fp32 ulp of it (one division fewer); the stored bits are that update stochastically rounded."""
    n, step, seed = 2**16 + 37, 5, 7
    p, m, v = bf16_state(n, seed=3)
    g = grads_like(n, 1, seed=4)[0].to(grad_dtype)
    hp = adam_args(adamw_mode=adamw_mode)
    p32, m32, v32 = p.float(), m.float(), v.float()
    previous = kernels.backend()
    kernels.set_backend(SIMD[0])
    kernels.adam_step(p32, g, m32, v32, step=step, grad_scale=0.37, hparams=hp)
    kernels.set_backend(previous)
    before = reference.bf16_state_update(hp, step, 0.37, *(t.double() for t in (p, g, m, v)))
    assert torch.equal(before[1].float(), m32) and torch.equal(before[2].float(), v32)
    # p = p * decay + update, each term's error at most an ulp or two: 4 ulp of the larger term (p's own
    # ulp says little where the two nearly cancel)
    kept = p.double() * reference.adamw_decay(hp)
    larger = torch.maximum(kept.abs(), (p32.double() - kept).abs())
    assert bool(((before[0] - p32.double()).abs() <= 2.0**-21 * larger).all())
    assert 0 < float((before[0] != p32.double()).double().mean()) < 0.5
    kernels.adam_step_bf16_state(p, g, m, v, step=step, seed=seed, offset=offset, grad_scale=0.37, hparams=hp)
    for a, exact, r in zip((p, m, v), before, reference.sr_bits(seed, step, offset, n)):
        assert torch.equal(bits16(a), bits16(reference.round_bf16_stochastic(exact.float(), r)))
        # and the rounding picked one of the two neighbours of the fp32 value
        down = (exact.float().view(torch.int32) >> 16).to(torch.int16)
        assert ((bits16(a) == down) | (bits16(a) == down + 1)).all()


def test_bf16state_any_split_gives_the_same_bits(backend: str) -> None:
    """The bits depend on the global element index: calls on pieces with their offsets equal one call,
    also across a multiple of 2^32 (where the kernel's 32-bit index wraps and the keys change)."""
    n = 3 * 2**16 + 5
    for base in (0, 2**32 - 2**17 - 3):
        whole = bf16_state(n, seed=1)
        g = grads_like(n, 1, seed=2)[0]
        kernels.adam_step_bf16_state(
            *whole[:1], g, *whole[1:], step=2, seed=9, offset=base, hparams=adam_args(adamw_mode=True)
        )
        pieces = bf16_state(n, seed=1)
        cuts = [0, 1, 17, 2**16 - 1, 2**17 + 3, 2**17 + 4, n]
        for a, b in zip(cuts, cuts[1:]):
            p, m, v = (t[a:b] for t in pieces)
            kernels.adam_step_bf16_state(
                p, g[a:b], m, v, step=2, seed=9, offset=base + a, hparams=adam_args(adamw_mode=True)
            )
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
    moments = kernels.AdamArgs(lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    decay = kernels.AdamArgs(lr=0.3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.5, adamw_mode=True)
    ms, vs, ps = [], [], []
    for seed in range(seeds):
        p, m, v = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        kernels.adam_step_bf16_state(p, g, m, v, step=1, seed=seed, hparams=moments)
        assert torch.equal(bits16(p), bits16(p0))  # lr = 0: p is exactly its bf16 value
        ms.append(m)
        vs.append(v)
        p = p0.clone()
        m, v = torch.zeros_like(m), torch.zeros_like(v)
        kernels.adam_step_bf16_state(p, torch.zeros(n), m, v, step=1, seed=seed, hparams=decay)
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
    hp = adam_args(adamw_mode=True)

    def run(seed: int, step: int):
        p, m, v = bf16_state(n, seed=6)
        kernels.adam_step_bf16_state(p, g, m, v, step=step, seed=seed, hparams=hp)
        return [bits16(t) for t in (p, m, v)]

    first = run(1, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, run(1, 3)))  # resumes bitwise from (seed, step)
    for other in (run(2, 3), run(2**64 - 1, 3), run(1, 4)):
        for a, b in zip(first, other):
            # about half of the values that are not exact in bf16 round the other way
            assert 0.2 < float((a != b).double().mean()) < 0.8


def test_bf16state_random_bits_are_uniform_and_the_streams_independent() -> None:
    """The hash's 16-bit outputs: uniform (chi-square over 256 bins of the top 8 bits), and the p, m
    and v streams, other steps and other seeds uncorrelated (|r| < 5 / sqrt(n)); within each stream,
    neighbours uncorrelated, and the v bits of a pair (2k, 2k + 1: the two halves of one hash) jointly
    uniform (chi-square over 256 bins of their top 4 bits each)."""
    n = 2**18
    for offset in (0, 2**32 - n // 2):  # one side of the high-word change and both
        streams = list(reference.sr_bits(3, 1, offset, n)) + [reference.sr_bits(3, 2, offset, n)[0]]
        streams.append(reference.sr_bits(4, 1, offset, n)[0])
        for r in streams:
            assert int(r.min()) >= 0 and int(r.max()) < 2**16
            counts = torch.bincount(r >> 8, minlength=256).double()
            chi2 = float(((counts - n / 256) ** 2 / (n / 256)).sum())
            assert chi2 < 255 + 5 * math.sqrt(2 * 255), f"chi-square {chi2:.0f} with 255 degrees of freedom"
        for i, a in enumerate(streams):
            for b in streams[i + 1 :]:
                assert abs(float(torch.corrcoef(torch.stack([a, b]).double())[0, 1])) < 5 / math.sqrt(n)
        for r in streams[:3]:
            for first in (0, 1):  # within a pair (2k, 2k + 1) and across pairs (2k + 1, 2k + 2)
                a, b = r[first:-1:2], r[first + 1 :: 2]
                neighbours = float(torch.corrcoef(torch.stack([a, b]).double())[0, 1])
                assert abs(neighbours) < 5 / math.sqrt(n // 2), f"neighbours correlated: r = {neighbours:.4f}"
        v = streams[2]
        counts = torch.bincount((v[0::2] >> 12) * 16 + (v[1::2] >> 12), minlength=256).double()
        chi2 = float(((counts - n / 512) ** 2 / (n / 512)).sum())
        assert chi2 < 255 + 5 * math.sqrt(2 * 255), f"v pairs: chi-square {chi2:.0f} with 255 degrees of freedom"


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
    hp = kernels.AdamArgs(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    p32, m32, v32 = p0.float(), torch.zeros(n), torch.zeros(n)
    pn, mn, vn = p0.float(), torch.zeros(n), torch.zeros(n)
    for step in range(1, steps + 1):
        kernels.adam_step(p32, g, m32, v32, step=step, hparams=hp)
        kernels.adam_step(pn, g, mn, vn, step=step, hparams=hp)
        for t in (pn, mn, vn):  # bf16 state rounded to nearest
            t.copy_(t.bfloat16())
    mean = torch.zeros(n, dtype=torch.float64)
    for seed in range(seeds):
        p, m, v = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
        for step in range(1, steps + 1):
            kernels.adam_step_bf16_state(p, g, m, v, step=step, seed=seed, hparams=hp)
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
    n, hp = 4096, kernels.AdamArgs(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    grads = [torch.ones(n)] * 10 + [torch.zeros(n)] * 200
    p, m, v = (
        torch.zeros(n, dtype=torch.bfloat16),
        torch.zeros(n, dtype=torch.bfloat16),
        torch.zeros(n, dtype=torch.bfloat16),
    )
    p32, m32, v32 = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    pn, mn, vn = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, start=1):
        kernels.adam_step_bf16_state(p, g, m, v, step=step, seed=0, hparams=hp)
        kernels.adam_step(p32, g, m32, v32, step=step, hparams=hp)
        kernels.adam_step(pn, g, mn, vn, step=step, hparams=hp)
        vn.copy_(vn.bfloat16())  # only v rounded to nearest
    assert abs(float(v.double().mean()) / float(v32[0]) - 1) < 0.01
    assert float(vn[0]) > 1.2 * float(v32[0])  # stuck near its peak: 0.999^200 = 0.82


def test_bf16state_nan_inf_overflow_and_zero_rules(backend: str) -> None:
    # NaN and inf gradients: NaN is stored as 0x7fc0, inf stays inf
    g = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    p, m, v = (torch.ones(4, dtype=torch.bfloat16) for _ in range(3))
    kernels.adam_step_bf16_state(p, g, m, v, step=1, seed=0, hparams=adam_args(adamw_mode=True))
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
    hp = kernels.AdamArgs(lr=0.0, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0, adamw_mode=True)
    p, m, v = (
        torch.ones(g.numel(), dtype=torch.bfloat16),
        torch.zeros_like(g).bfloat16(),
        torch.zeros_like(g).bfloat16(),
    )
    kernels.adam_step_bf16_state(p, g, m, v, step=1, seed=5, hparams=hp)
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
    hp = adam_args(adamw_mode=True)
    p, g = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)
    m, v = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="param has dtype torch.float32; expected torch.bfloat16"):
        kernels.adam_step_bf16_state(torch.zeros(4), g, m, v, step=1, seed=0, hparams=hp)
    with pytest.raises(TypeError, match="exp_avg_sq has dtype torch.float32"):
        kernels.adam_step_bf16_state(p, g, m, torch.zeros(4), step=1, seed=0, hparams=hp)
    with pytest.raises(ValueError, match="grad has 3 elements but param has 4"):
        kernels.adam_step_bf16_state(p, torch.zeros(3), m, v, step=1, seed=0, hparams=hp)
    with pytest.raises(TypeError, match="grad has dtype torch.int32"):
        kernels.adam_step_bf16_state(p, torch.zeros(4, dtype=torch.int32), m, v, step=1, seed=0, hparams=hp)
    with pytest.raises(ValueError, match="not contiguous"):
        kernels.adam_step_bf16_state(
            torch.zeros(4, 2, dtype=torch.bfloat16).t(), torch.zeros(8), m, v, step=1, seed=0, hparams=hp
        )
    for bad, error in ((-1, ValueError), (2**64, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="seed must be"):
            kernels.adam_step_bf16_state(p, g, m, v, step=1, seed=bad, hparams=hp)
    with pytest.raises(ValueError, match="offset must be in"):
        kernels.adam_step_bf16_state(p, g, m, v, step=1, seed=0, offset=-1, hparams=hp)
    with pytest.raises(ValueError, match="step must be >= 1"):
        kernels.adam_step_bf16_state(p, g, m, v, step=0, seed=0, hparams=hp)
