"""Backend selection (one object every kernel calls), the torch fallback without the extension, threads."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import warnings

import pytest
import torch
from kernel_helpers import BACKENDS, HP, NATIVE, adam_args, assert_adam_close, grad_bound, grads_like, torch_steps

import lightning_zero_offload
from lightning_zero_offload import kernels
from lightning_zero_offload.kernels import _native, backends
from lightning_zero_offload.kernels.native import NativeBackend
from lightning_zero_offload.kernels.reference import TorchBackend

# fixtures in tests/conftest.py
pytestmark = pytest.mark.usefixtures("one_torch_thread", "torch_seed")

PACKAGE = "lightning_zero_offload.kernels"


def test_the_native_extension_was_built_with_every_kernel() -> None:
    """The extension is optional at install time (no compiler: torch fallback), so a source that stops
    compiling would pass silently; on machines with a compiler, as here and in CI, it must be there."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the torch fallback is expected")
    assert _native.lib is not None, f"the native extension failed to build or load: {_native.import_error}"
    for name in ("lzo_adam_step", "lzo_adam_undo", "lzo_grad_accumulate", "lzo_fingerprint16"):
        assert hasattr(_native.lib, name), f"{name} is missing from the built extension: rebuild it (pip install -e .)"
    # the bandwidth probe is a benchmark's tool (benchmarks/roofline.c), not a kernel of the package
    assert not hasattr(_native.lib, "lzo_bandwidth_probe")


def test_backend_selection() -> None:
    assert BACKENDS[-1] == "torch"
    assert kernels.backend() == BACKENDS[0]  # the best path is chosen at import
    with pytest.raises(ValueError, match=r"backend 'sve' is not available on this machine; choose one of \["):
        kernels.set_backend("sve")


def test_selecting_a_backend_swaps_the_one_object_every_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each backend is one object, made once; selecting it makes it the one the public functions call,
    and every public kernel reaches it (none decides by the backend's name on its own)."""
    previous = kernels.backend()
    try:
        selected = {}
        for name in BACKENDS:
            kernels.set_backend(name)
            selected[name] = backends.active()
            assert selected[name].name == kernels.backend() == name
            assert isinstance(selected[name], TorchBackend if name == "torch" else NativeBackend)
        for name in BACKENDS:
            kernels.set_backend(name)
            assert backends.active() is selected[name]
    finally:
        kernels.set_backend(previous)

    calls: list[str] = []

    class Recorder:
        """The torch backend, noting which of its methods each kernel call ends in."""

        name = "recorder"

        def __getattr__(self, method: str):
            real = getattr(backends.REFERENCE, method)
            return lambda *args: calls.append(method) or real(*args)

    monkeypatch.setattr(backends, "_active", Recorder())
    assert kernels.backend() == "recorder"
    t = [torch.zeros(8) for _ in range(4)]
    bf16 = [torch.zeros(8, dtype=torch.bfloat16) for _ in range(3)]
    hp = adam_args(adamw_mode=True)
    kernels.adam_step(*t, hparams=hp, step=1)
    kernels.adam_step_multi([t[0]], [t[1]], [t[2]], [t[3]], [1], hparams=hp)
    kernels.adam_step_multi_if_finite([t[0]], [t[1]], [t[2]], [t[3]], [1], hparams=hp)
    kernels.adam_undo(*t, hparams=hp, step=1)
    kernels.adam_step_bf16_state(bf16[0], t[1], bf16[1], bf16[2], hparams=hp, step=1, seed=0)
    kernels.grad_accumulate(t[0], t[1])
    kernels.sum_of_squares(t[0])
    kernels.fingerprint16(bf16[0].view(torch.int16))
    expected = ["adam", "adam", "adam_if_finite", "adam_undo", "adam_bf16_state", "grad_accumulate"]
    assert calls == [*expected, "sum_of_squares", "fingerprint16"]


def fresh_kernels(monkeypatch: pytest.MonkeyPatch, native_missing: bool, env: str | None = None):
    """Import a fresh copy of the kernels package (the real one is put back afterwards); returns it and
    the warnings its import gave."""
    if native_missing:
        monkeypatch.setitem(sys.modules, "lightning_zero_offload._native", None)  # import now fails
    if env is None:
        monkeypatch.delenv("LZO_BACKEND", raising=False)
    else:
        monkeypatch.setenv("LZO_BACKEND", env)
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(lightning_zero_offload, "kernels", kernels)  # the import rebinds it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(PACKAGE)
    return module, caught


def test_missing_native_library_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    fallback, caught = fresh_kernels(monkeypatch, native_missing=True)
    assert fallback is not kernels
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "native CPU kernels are not built" in message
    assert "install a C compiler" in message and "pip install --force-reinstall --no-deps -e ." in message
    assert fallback.backend() == "torch" and fallback.available_backends() == ["torch"]
    assert not fallback.has_openmp()
    with pytest.raises(ValueError, match="choose one of \\['torch'\\]"):
        fallback.set_backend("avx2")
    # everything still works, with the same results as the real module's torch path
    n, steps = 1000, 5
    p0, grads = torch.randn(n, generator=torch.Generator().manual_seed(4)), grads_like(n, steps, seed=4)
    p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    hp = fallback.AdamArgs(**HP, adamw_mode=True)
    for step, g in enumerate(grads, start=1):
        fallback.adam_step(p, g.to(torch.bfloat16), m, v, hparams=hp, step=step, param_out=out)
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
        forced, caught = fresh_kernels(monkeypatch, native_missing=False, env="scalar")
        assert forced.backend() == "scalar" and not caught
        forced, _ = fresh_kernels(monkeypatch, native_missing=False, env="torch")
        assert forced.backend() == "torch"
        with pytest.raises(ValueError, match=r"LZO_BACKEND='avx9000': backend 'avx9000' is not available"):
            fresh_kernels(monkeypatch, native_missing=False, env="avx9000")
    finally:
        kernels.set_backend(previous)  # the copies selected an instruction set in the shared C library


def test_thread_count_defaults_to_usable_cores() -> None:
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
