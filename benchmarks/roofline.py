"""The memory roofline of the Adam step, for the benchmarks: benchmarks/roofline.c, compiled on first use.

The probe reads p, g, m, v and writes p, m, v (28 B/param), the Adam step's traffic without its
arithmetic, at the vector width of the active native backend. It is a measuring tool, not a kernel,
so it is not in the package's extension: cffi compiles it here into benchmarks/build/ (ignored by
git) with the extension's flags, once per change of the source.

    from roofline import probe
    probe(p, g, m, v, num_threads=2)  # changes the tensors
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from cffi import FFI

from lightning_zero_offload import kernels

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "roofline.c"
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}  # roofline.c, as native/lzo.h numbers them
CFLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off"]  # native/build.py's, so the loops compile alike
_module: ModuleType | None = None


def _build() -> ModuleType:
    """The compiled probe: benchmarks/build/roofline-<hash of source and flags>/, built if missing."""
    openmp = ["-fopenmp"] if kernels.has_openmp() else []
    source = SOURCE.read_text()
    key = hashlib.sha256((source + " ".join(CFLAGS + openmp)).encode()).hexdigest()[:16]
    name = "_lzo_roofline"
    out = HERE / "build" / f"roofline-{key}"
    built = sorted(out.glob(f"{name}*.so"))
    if not built:
        ffi = FFI()
        ffi.cdef("void roofline(int isa, float *p, const float *g, float *m, float *v, int64_t n, int num_threads);")
        ffi.set_source(name, source, extra_compile_args=CFLAGS + openmp, extra_link_args=openmp)
        out.mkdir(parents=True, exist_ok=True)
        built = [Path(ffi.compile(tmpdir=str(out)))]
    spec = importlib.util.spec_from_file_location(name, built[0])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def isa() -> str:
    """The instruction set the probe uses: the active native backend's, or the best one under "torch"."""
    native = [b for b in kernels.available_backends() if b != "torch"]
    if kernels.backend() != "torch":
        return kernels.backend()
    return native[0] if native else "scalar"


def probe(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, num_threads: int) -> None:
    """One pass of the Adam memory pattern over four contiguous fp32 CPU tensors of one size (changes them)."""
    global _module
    for name, t in (("p", p), ("g", g), ("m", m), ("v", v)):
        if not (t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and t.numel() == p.numel()):
            raise ValueError(f"{name} must be a contiguous fp32 CPU tensor of p's size ({p.numel()} elements)")
    if _module is None:
        _module = _build()
    ffi, lib = _module.ffi, _module.lib
    pointers = (ffi.cast("float *", t.data_ptr()) for t in (p, g, m, v))
    lib.roofline(ISAS[isa()], *pointers, p.numel(), num_threads)
