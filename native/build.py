"""cffi build script: compiles native/*.c into ``lightning_zero_offload._native`` at install time.

setup.py names it in ``cffi_modules``, so ``pip install .`` and ``pip install -e .`` build the
extension once, ahead of time, instead of a JIT build on first use (the failure mode users of
DeepSpeed's cpu_adam keep reporting). The extension is optional: if there is no working C
compiler, installation still succeeds and ``lightning_zero_offload.kernels`` falls back to torch.

One shared object holds every instruction-set variant (per-function target attributes, runtime
dispatch), so there is no ``-march=native`` and the built wheel runs on any CPU of its architecture.
The AVX2 and AVX-512 variants are one body, kernels_simd.h, compiled once per instruction set by
kernels_avx2.c and kernels_avx512.c, which only supply its vector shim.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from cffi import FFI

NATIVE = Path(__file__).resolve().parent
SOURCES = ["dispatch.c", "kernels_scalar.c", "kernels_avx2.c", "kernels_avx512.c", "fingerprint.c"]
HEADERS = ["lzo.h", "kernels_simd.h", "undo_body.h"]  # included by the sources: a change rebuilds them
# -fno-math-errno lets sqrtf vectorise; no -ffast-math, which would break inf/nan handling.
# -ffp-contract=off keeps every multiply-add as written: fused only where the code says fma.
CFLAGS = ["-O3", "-fno-math-errno", "-ffp-contract=off"]


def _cdef(header: str) -> str:
    """The public half of lzo.h without preprocessor lines (cffi's parser has no preprocessor)."""
    public = header.split("#ifdef LZO_INTERNAL")[0]
    return "\n".join(line for line in public.splitlines() if not line.lstrip().startswith("#"))


def _openmp_flags() -> list[str]:
    """``["-fopenmp"]`` if the compiler can build and link an OpenMP program, else ``[]``.

    Without OpenMP (e.g. Apple clang) the kernels still build and run single-threaded; a missing
    compiler is not handled here: the extension build itself then fails and is skipped.
    """
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.errors import CCompilerError, DistutilsError
    from setuptools._distutils.sysconfig import customize_compiler

    compiler = new_compiler()
    customize_compiler(compiler)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "probe.c")
        src.write_text("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
        try:
            objects = compiler.compile([str(src)], output_dir=tmp, extra_preargs=["-fopenmp"])
            compiler.link_executable(objects, "probe", output_dir=tmp, extra_preargs=["-fopenmp"])
        except (CCompilerError, DistutilsError, OSError):
            return []
    return ["-fopenmp"]


ffibuilder = FFI()
ffibuilder.cdef(_cdef((NATIVE / "lzo.h").read_text()))
_openmp = _openmp_flags()
ffibuilder.set_source(
    "lightning_zero_offload._native",
    '#include "lzo.h"',
    # setuptools wants source paths relative to the project root (the cwd of setup.py)
    sources=[os.path.relpath(NATIVE / name) for name in SOURCES],
    include_dirs=[os.path.relpath(NATIVE)],
    depends=[os.path.relpath(NATIVE / name) for name in HEADERS],
    extra_compile_args=CFLAGS + _openmp,
    extra_link_args=_openmp,
    libraries=["m"],
    optional=True,
)
