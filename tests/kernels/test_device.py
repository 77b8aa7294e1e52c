"""kernels.device: the step of state kept on the accelerator follows the CPU kernels (run here on the CPU
"device", the code a GPU runs): bf16 state bitwise, fp32 state within the kernels' rounding."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import HP, adam_args, grads_like
from torch.utils._python_dispatch import TorchDispatchMode

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


def fused_steps(run_pass, adamw_mode: bool, size: int = 3003, chunk: int = 1000) -> tuple[list, list]:
    """Two steps of the bf16-state step through ``run_pass`` and of the native kernel, on the same ``size`` numbers
    in passes of ``chunk`` (the element numbers crossing a 2**32 boundary)."""
    hparams = adam_args(adamw_mode=adamw_mode)
    ours, native = ([t.view(-1)[:size] for t in state(torch.bfloat16, 1)] for _ in range(2))
    for step, grad in enumerate(grads_like(size, 2, seed=2), start=1):
        grad = grad.bfloat16()
        reference.bf16_state_step(
            FlatAdamCall(hparams, ours[0], grad, *ours[1:], step, 0.5, 1, 7, 2**32 - 5), chunk, run_pass
        )
        common = {"hparams": hparams, "step": step, "seed": 7, "offset": 2**32 - 5, "grad_scale": 0.5}
        kernels.adam_step_bf16_state(native[0], grad, *native[1:], **common)
    return ours, native


@pytest.mark.slow  # compiles with the CPU's inductor: about 20 s from an empty cache
def test_the_fused_pass_gives_the_native_bits_from_one_compiled_graph():
    """The compiled pass an accelerator runs, compiled here by the CPU's inductor: the native bits for both update
    rules, windows of several passes and of one, and a window of one element (left unfused), all from one compiled
    graph (the GPU's Triton code is gpu_check.sh's device_step to check)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fused = device.FusedPass()
    for adamw_mode, size, chunk in ((True, 3003, 1000), (False, 3003, 1000), (True, 999, 1000), (False, 1, 1000)):
        ours, native = fused_steps(fused, adamw_mode, size, chunk)
        assert fused.failure is None
        for got, want in zip(ours, native):
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def before_rounding(p, g, m, v, constants):
    """The bf16-state update's fp32 values before the stochastic rounding."""
    return tuple(x.float() for x in reference.update_values(constants, *(t.double() for t in (p, g, m, v))))


def update_inputs(n: int) -> list[torch.Tensor]:
    """bf16 p, g, m, v whose fp32 updates include subnormal values (v of tiny gradients)."""
    gen = torch.Generator().manual_seed(1)
    p, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01, torch.rand(n, generator=gen) * 1e-4
    g = grads_like(n, 1, seed=2)[0]
    g[: n // 8] *= 1e-19  # (1 - beta2) x their squares: fp32 subnormals, some
    v[: n // 8] = 0.0
    return [t.bfloat16() for t in (p, g, m, v)]


@pytest.mark.slow  # compiles twice with the CPU's inductor
@pytest.mark.parametrize("older_torch", [False, True])
def test_the_compiled_update_keeps_every_fp32_rounding(older_torch, monkeypatch):
    """Before the stochastic rounding, which hides an ulp or two in all but about 1 in 65536 elements: the compiled
    update's fp32 values are eager's bit for bit, subnormal ones included. ``older_torch``: with torch 2.12's
    inductor pass that merged a float64 -> float32 -> float64 round trip into nothing (each _r32 is one), which
    the options for a torch before 2.13 switch off (thousands of differing values per 65536 with the default
    options)."""
    if older_torch:
        joint_graph = pytest.importorskip("torch._inductor.fx_passes.joint_graph")
        if not hasattr(joint_graph, "pointless_convert"):
            pytest.skip("this torch has no pointless_convert pass to put the old body into")
        monkeypatch.setattr(joint_graph.pointless_convert, "__code__", merge_any_float_round_trip.__code__)
    import torch._functorch.config
    import torch._inductor.config

    torch._dynamo.reset()
    p, g, m, v = update_inputs(1 << 16)
    # no cache: else an earlier compile, with or without the old pass, comes back from the disk
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        for adamw_mode in (True, False):
            hparams = adam_args(adamw_mode=adamw_mode)
            constants = torch.tensor(reference.update_constants(hparams, 3, 0.5), dtype=torch.float64)
            eager = before_rounding(p, g, m, v, constants)
            options = device.compile_options("2.12.0" if older_torch else torch.__version__)
            compiled = torch.compile(before_rounding, **options)(p, g, m, v, constants)
            subnormal = (eager[2] != 0) & (eager[2] < torch.finfo(torch.float32).tiny)
            assert bool(subnormal.any()) or not adamw_mode  # (Adam's L2 term makes every gradient large)
            for a, b in zip(eager, compiled):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def merge_any_float_round_trip(match, arg, dtype1, dtype2):
    """torch 2.12's joint_graph.pointless_convert: x.to(dtype1).to(dtype2) -> x.to(dtype2) for any float dtypes."""
    graph = match.graph
    node = match.output_node()
    allowed = torch.float16, torch.bfloat16, torch.float32, torch.float64
    if dtype1 in allowed and dtype2 in allowed:
        repl = graph.call_function(torch.ops.prims.convert_element_type.default, (arg, dtype2))
        repl.meta.update(node.meta)
        node.replace_all_uses_with(repl)
        match.erase_nodes()


def test_where_compiling_fails_the_unfused_pass_gives_the_same_bits_and_says_why(monkeypatch):
    def compile_fails(fn, **options):
        def compiled(*args):
            raise RuntimeError("no working C++ compiler\nmore lines")

        return compiled

    monkeypatch.setattr(torch, "compile", compile_fails)
    fused = device.FusedPass()
    said = r"runs unfused.*\(RuntimeError: no working C\+\+ compiler\)\. A missing Triton"
    with pytest.warns(ZeroOffloadRuntimeWarning, match=said):
        ours, native = fused_steps(fused, adamw_mode=True)
    assert fused.failure == "RuntimeError: no working C++ compiler"
    for got, want in zip(ours, native):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


class SeesEveryOperation(TorchDispatchMode):
    """A dispatch mode, as the CUDA sanitizer and torch's FLOP counter are."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_under_a_dispatch_mode_the_pass_runs_unfused_for_that_call_only(monkeypatch):
    """Dynamo compiles nothing under a dispatch mode (fullgraph=True raises): not a failure of the compiler."""
    compiled_calls = []

    def compile_records(fn, **options):
        def compiled(*args):
            compiled_calls.append(fn)
            return fn(*args)

        return compiled

    monkeypatch.setattr(torch, "compile", compile_records)
    fused = device.FusedPass()
    with SeesEveryOperation():
        ours, native = fused_steps(fused, adamw_mode=True)
    assert compiled_calls == [] and fused.failure is None
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(ours, native))
    fused_steps(fused, adamw_mode=True)
    assert compiled_calls and fused.failure is None


def test_a_step_writes_a_parameter_that_requires_grad_whatever_the_grad_mode():
    """An optimizer's step: the sharded parameter (offload_params' bf16 master) is written in place."""
    p, m, v = (torch.nn.Parameter(t, requires_grad=i == 0) for i, t in enumerate(state(torch.bfloat16, 1)))
    native = [t.detach().clone() for t in (p, m, v)]
    grad = grads_like(p.numel(), 1, seed=2)[0].view(SHAPE).bfloat16()
    common = {"hparams": adam_args(adamw_mode=True), "step": 1, "seed": 7, "grad_scale": 0.5}
    device.adam_step_bf16_state(p, grad, m, v, **common)
    kernels.adam_step_bf16_state(*(t.view(-1) for t in (native[0], grad, native[1], native[2])), **common)
    assert all(torch.equal(a.detach().view(torch.int16), b.view(torch.int16)) for a, b in zip((p, m, v), native))


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
