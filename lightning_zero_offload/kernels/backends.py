"""The one backend object every kernel call goes to, how it is selected, and the default thread count.

A backend is an object with one method per kernel (:class:`Backend`): a
:class:`~lightning_zero_offload.kernels.native.NativeBackend` per instruction set the CPU runs, and the
:class:`~lightning_zero_offload.kernels.reference.TorchBackend`. Selecting one (at import, from
``LZO_BACKEND`` or the best the CPU runs; later with :func:`set_backend`) swaps the object that
:func:`active` returns; the public functions check their arguments and call it, with no per-backend
branches of their own.
"""

from __future__ import annotations

import os
import warnings
from typing import Protocol

from torch import Tensor

from lightning_zero_offload.kernels import _native
from lightning_zero_offload.kernels.arguments import AdamCall, FlatAdamCall, check_threads
from lightning_zero_offload.kernels.native import NativeBackend
from lightning_zero_offload.kernels.reference import TorchBackend
from lightning_zero_offload.warning import ZeroOffloadRuntimeWarning


class Backend(Protocol):
    """The kernels of one implementation, on arguments already checked (kernels/arguments.py)."""

    name: str

    def activate(self) -> None: ...

    def adam(self, call: AdamCall) -> None: ...

    def adam_if_finite(self, call: AdamCall) -> tuple[float, bool]: ...

    def adam_undo(self, call: FlatAdamCall) -> None: ...

    def adam_bf16_state(self, call: FlatAdamCall) -> None: ...

    def grad_accumulate(self, dst: Tensor, src: Tensor, scale: float, overwrite: bool, num_threads: int) -> float: ...

    def sum_of_squares(self, src: Tensor, num_threads: int) -> float: ...

    def fingerprint16(self, words: Tensor, num_threads: int) -> Tensor: ...


REFERENCE = TorchBackend()
_BACKENDS: dict[str, Backend] = {name: NativeBackend(name) for name in _native.supported_isas()} | {"torch": REFERENCE}


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; not OMP_NUM_THREADS, which torchrun sets to 1).

    The one count of them: the kernels' default thread count, the engine's options and the planner's
    machine probe all ask here.
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


_active: Backend = REFERENCE
_num_threads = usable_cores()


def active() -> Backend:
    """The selected backend object."""
    return _active


def available_backends() -> list[str]:
    """Backends this CPU and build can run, fastest first; ``"torch"`` is always last."""
    return list(_BACKENDS)


def backend() -> str:
    """The active path: ``"avx512"``, ``"avx2"``, ``"scalar"`` (native) or ``"torch"`` (fallback)."""
    return _active.name


def set_backend(name: str) -> None:
    """Force a path (tests, benchmarks). Raises ValueError naming the choices if it cannot run here."""
    global _active
    if name not in _BACKENDS:
        raise ValueError(f"backend {name!r} is not available on this machine; choose one of {available_backends()}")
    selected = _BACKENDS[name]
    selected.activate()
    _active = selected


def set_num_threads(n: int) -> None:
    """Default thread count of the native kernels (initially the cores this process may use).

    The torch fallback ignores it: torch ops use ``torch.set_num_threads``.
    """
    global _num_threads
    _num_threads = check_threads("n", n)


def get_num_threads() -> int:
    """Thread count used when a call passes ``num_threads=None``."""
    return _num_threads


def threads(num_threads: int | None) -> int:
    """A call's thread count: its own, or the default."""
    return _num_threads if num_threads is None else check_threads("num_threads", num_threads)


def select_initial_backend() -> None:
    """At import: ``LZO_BACKEND`` if set, else the fastest available; warns if the native build is missing."""
    requested = os.environ.get("LZO_BACKEND", "").strip().lower()
    if _native.lib is None and requested != "torch":
        warnings.warn(
            f"lightning_zero_offload: native CPU kernels are not built ({_native.import_error}); using the slower "
            "torch fallback. To build them, install a C compiler (e.g. gcc) and reinstall: "
            "`pip install --force-reinstall --no-deps -e .` in a source checkout, or "
            "`pip install --force-reinstall --no-deps lightning-zero-offload`.",
            ZeroOffloadRuntimeWarning,
            stacklevel=2,
        )
    if requested:
        try:
            set_backend(requested)
        except ValueError as err:
            raise ValueError(f"LZO_BACKEND={requested!r}: {err}") from None
    else:
        set_backend(available_backends()[0])
    if _native.lib is not None and not _native.has_openmp():
        warnings.warn(
            "lightning_zero_offload: the native kernels were built without OpenMP and run single-threaded; "
            "install OpenMP for your compiler (e.g. libomp) and reinstall the package to use all cores.",
            ZeroOffloadRuntimeWarning,
            stacklevel=2,
        )
