"""glibc's mmap threshold, fixed: a block freed no longer moves the next large ones onto the heap."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from lightning_zero_offload.engine.offload_params.heap import ENVIRONMENT

MIB = 2**20
glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")


class Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def mapped_bytes_of_a_block_after_a_larger_one_is_freed() -> int:
    """How much of an 8 MiB malloc glibc serves with its own mmap, after a 16 MiB block was freed (which
    raises a dynamic threshold to 16 MiB: the 8 MiB then comes from the heap)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = Mallinfo2
    libc.free(libc.malloc(16 * MIB))
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(8 * MIB)
    mapped = libc.mallinfo2().hblkhd - before
    libc.free(block)
    return mapped


# Fresh interpreters: the threshold is process-wide, and in a process that ran other tests a free chunk left on
# the heap serves the block whatever the threshold (glibc maps only what its bins and top chunk cannot serve).
@pytest.mark.slow
@glibc
@pytest.mark.parametrize("limit", [False, True])
def test_without_the_limit_the_same_block_comes_from_the_heap(limit):
    code = (
        "from lightning_zero_offload.engine.offload_params.heap import limit_retained_heap\n"
        f"from {__name__} import mapped_bytes_of_a_block_after_a_larger_one_is_freed as probe\n"
        f"{'limit_retained_heap()' if limit else ''}\n"
        "print(probe())"
    )
    env = {k: v for k, v in os.environ.items() if k != ENVIRONMENT}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), *sys.path])
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 8 * MIB if limit else int(done.stdout) == 0
