"""The compiled extension ``lightning_zero_offload._native`` (native/, built at install time), if it loaded.

``lib`` and ``ffi`` are None when it did not (no C compiler at install time); ``import_error`` then says
why. The tables translate torch dtypes and backend names into the C API's codes.
"""

from __future__ import annotations

import torch

try:
    from lightning_zero_offload._native import ffi, lib
except ImportError as _error:
    ffi = lib = None
    import_error: ImportError | None = _error
else:
    import_error = None

if lib is not None:
    DTYPE_CODES = {
        torch.float32: lib.LZO_FLOAT32,
        torch.bfloat16: lib.LZO_BFLOAT16,
        torch.float16: lib.LZO_FLOAT16,
    }
    ISAS = {"avx512": lib.LZO_ISA_AVX512, "avx2": lib.LZO_ISA_AVX2, "scalar": lib.LZO_ISA_SCALAR}
else:
    DTYPE_CODES, ISAS = {}, {}


def supported_isas() -> list[str]:
    """The instruction sets of the extension this CPU can run, fastest first (none without the extension)."""
    return [name for name, isa in ISAS.items() if lib.lzo_isa_supported(isa)]


def has_openmp() -> bool:
    return lib is not None and bool(lib.lzo_has_openmp())
