"""glibc's heap and the host memory of training with offloaded parameters.

glibc serves an allocation above its mmap threshold with its own ``mmap`` (given back to the OS when
freed) and a smaller one from the heap (kept by the process when freed). The threshold is dynamic: it
rises to the size of the largest block freed so far, so after the first unit-sized buffer is freed, the
per-unit temporaries of every step (all-gather outputs, unsharded gradients, reduce-scatter inputs) come
from the heap and stay in RSS, about half as much again as the training state itself
(docs/benchmarks.md, "Parameter-offload setup"). Fixing the threshold (as ``MALLOC_MMAP_THRESHOLD_`` in
the environment does before the process starts) keeps it from rising.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
THRESHOLD_BYTES = 128 * 1024  # glibc's initial value: larger blocks are mapped and unmapped, smaller ones reused
ENVIRONMENT = "MALLOC_MMAP_THRESHOLD_"


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def release_free_heap() -> None:
    """Hand the free blocks of glibc's heap back to the system now (``malloc_trim``), for a loop that allocates
    and frees blocks under the threshold one after another (the streamed export's reads), without fixing the
    threshold for the rest of the process. Nothing where the C library is not glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def limit_retained_heap() -> bool:
    """Fix glibc's mmap threshold at 128 KiB for the rest of the process (``mallopt``), unless the
    environment set it already (``MALLOC_MMAP_THRESHOLD_``: the user's value stays). Whether the threshold
    is fixed now: False where the C library is not glibc (nothing is changed there)."""
    if ENVIRONMENT in os.environ:
        return True
    libc = _glibc()
    return libc is not None and libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES) == 1
