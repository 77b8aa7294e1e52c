"""kernels.device: the step of state kept on the accelerator follows the CPU kernels (run here on the CPU
"device", the code a GPU runs): bf16 state bitwise, fp32 state within the kernels' rounding."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import HP, adam_args, grads_like

from lightning_zero_offload import kernels
from lightning_zero_offload.kernels import device, reference
from lightning_zero_offload.kernels.arguments import FlatAdamCall
from lightning_zero_offload.warning import ZeroOffloadRuntimeWarning

pytestmark = pytest.mark.usefixtures("one_torch_thread", "torch_seed")

SHAPE = (3, 1001)  # 2-D, as a shard of a matrix


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """The device step's passes made small, so that one call here takes several (the tails included)."""
    monkeypatch.setattr(device, "BF16_STATE_CHUNK", 1000)


def state(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(SHAPE, generator=gen)
    m = torch.randn(SHAPE, generator=gen) * 0.01
    v = torch.rand(SHAPE, generator=gen) * 1e-4
    return [t.to(dtype) for t in (p, m, v)]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_bf16_state_step_gives_the_native_bits(grad_dtype, adamw_mode):
    hparams = adam_args(adamw_mode=adamw_mode)
    ours, native = state(torch.bfloat16, 1), state(torch.bfloat16, 1)
    offset = 2**32 - 5  # the element numbers cross a 2**32 boundary: the hash's high word changes mid-call
    for step, grad in enumerate(grads_like(ours[0].numel(), 2, seed=2), start=1):
        grad = grad.view(SHAPE).to(grad_dtype)
        common = {"hparams": hparams, "step": step, "seed": 7, "offset": offset, "grad_scale": 0.5}
        device.adam_step_bf16_state(ours[0], grad, ours[1], ours[2], **common)
        flat = [t.view(-1) for t in (native[0], grad, native[1], native[2])]
        kernels.adam_step_bf16_state(*flat, **common)
    for got, want in zip(ours, native):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def fused_steps(run_pass, adamw_mode: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two steps of the bf16-state step through ``run_pass`` and of the native kernel, on the same numbers (the
    element numbers crossing a 2**32 boundary, passes of 1000 elements and a tail)."""
    hparams = adam_args(adamw_mode=adamw_mode)
    ours, native = state(torch.bfloat16, 1), state(torch.bfloat16, 1)
    for step, grad in enumerate(grads_like(ours[0].numel(), 2, seed=2), start=1):
        grad = grad.bfloat16()
        flat = [t.view(-1) for t in (ours[0], grad, ours[1], ours[2])]
        reference.bf16_state_step(FlatAdamCall(hparams, *flat, step, 0.5, 1, 7, 2**32 - 5), 1000, run_pass)
        kernels.adam_step_bf16_state(
            *(t.view(-1) for t in (native[0], grad, native[1], native[2])),
            hparams=hparams,
            step=step,
            seed=7,
            offset=2**32 - 5,
            grad_scale=0.5,
        )
    return ours, native


@pytest.mark.slow  # compiles twice with the CPU's inductor: about 20 s
def test_the_fused_pass_gives_the_native_bits():
    """The compiled pass an accelerator runs, compiled here by the CPU's inductor: the same bits (the GPU's Triton
    code is gpu_check.sh's device_step to check)."""
    fused = device.FusedPass()
    for adamw_mode in (True, False):  # AdamW, and Adam with an L2 term: two compiled variants
        ours, native = fused_steps(fused, adamw_mode)
        assert fused.failure is None
        for got, want in zip(ours, native):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_where_compiling_fails_the_unfused_pass_gives_the_same_bits_and_says_why(monkeypatch):
    def compile_fails(fn, **options):
        def compiled(*args):
            raise RuntimeError("no working C++ compiler\nmore lines")

        return compiled

    monkeypatch.setattr(torch, "compile", compile_fails)
    fused = device.FusedPass()
    with pytest.warns(
        ZeroOffloadRuntimeWarning, match=r"runs unfused.*\(RuntimeError: no working C\+\+ compiler\)\. Install"
    ):
        ours, native = fused_steps(fused, adamw_mode=True)
    assert fused.failure == "RuntimeError: no working C++ compiler"
    for got, want in zip(ours, native):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fp32_step_follows_the_native_kernel_within_its_rounding():
    """Observed: bitwise on this machine (AVX2); the bound is the kernel tests' (tests/kernel_helpers.py)."""
    hparams, steps = adam_args(adamw_mode=True), 3
    ours, native = state(torch.float32, 3), state(torch.float32, 3)
    for step, grad in enumerate(grads_like(ours[0].numel(), steps, seed=4), start=1):
        grad = grad.view(SHAPE).bfloat16()
        device.adam_step_multi([ours[0]], [grad], [ours[1]], [ours[2]], [step], hparams=hparams, grad_scale=0.25)
        kernels.adam_step_multi([native[0]], [grad], [native[1]], [native[2]], [step], hparams=hparams, grad_scale=0.25)
    torch.testing.assert_close(ours[0], native[0], rtol=steps * 2**-23, atol=steps * HP["lr"] * 2**-21)


def test_sum_of_squares_is_the_native_sum():
    grad = grads_like(1000, 1, seed=5)[0]
    assert device.sum_of_squares(grad)[0] == pytest.approx(kernels.sum_of_squares(grad)[0], rel=1e-12)
    grad[3] = float("inf")
    assert device.sum_of_squares(grad)[1]


def test_bad_arguments_are_refused_with_the_fix():
    p, m, v = state(torch.float32, 0)
    with pytest.raises(ValueError, match="keep one call on one device"):
        elsewhere = torch.empty(SHAPE, device="meta")
        device.adam_step_multi([p], [elsewhere], [m], [v], [1], hparams=adam_args(adamw_mode=True))
    with pytest.raises(TypeError, match="expected torch.bfloat16"):
        device.adam_step_bf16_state(p, p, m, v, hparams=adam_args(adamw_mode=True), step=1, seed=0)
    with pytest.raises(ValueError, match="contiguous"):
        device.sum_of_squares(p.t())
    with pytest.raises(ValueError, match="sizes must match"):
        device.adam_step_multi([p], [p[:1]], [m], [v], [1], hparams=adam_args(adamw_mode=True))
