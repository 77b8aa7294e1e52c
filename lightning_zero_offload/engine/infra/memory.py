"""Host and device buffers: the only place that knows about pinned memory.

Pinned memory is allocated by registering an ordinary allocation with the driver, not through torch's
caching host allocator, which rounds every block up to a power of two (a 1.1 GB buffer would pin
2 GB: DeepSpeed users' host-RAM blowups). Only bucket-sized pools are pinned; model-sized host
buffers (master weights, moments, gradients, DPU's next parameters) stay pageable and reach the
device through a pinned bucket-sized staging buffer (:class:`HostToDevice`). A pin the OS refuses
falls back to pageable memory with a warning.

Every buffer made here is recorded in the current memory ledger (engine/infra/ledger.py); the streams and
events that order their reuse are engine/infra/streams.py's.
"""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import warnings
import weakref
from collections import deque
from collections.abc import Hashable
from typing import Any

import torch

from lightning_zero_offload.engine.infra.ledger import (
    COLLECTIVE,
    DEVICE,
    HOST,
    HOST_PINNED,
    MemoryLedger,
    current_ledger,
    record_allocation,
)
from lightning_zero_offload.engine.infra.streams import record_event, stream_wait_event, wait_event
from lightning_zero_offload.warning import ZeroOffloadRuntimeWarning

# -- host buffers ------------------------------------------------------------------------------


def can_pin(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


_pinned_storages: set[int] = set()  # data pointers of the storages registered here, to skip staging them


def host_empty(
    numel: int, dtype: torch.dtype, pin: bool, kind: str = "state", ledger: MemoryLedger | None = None
) -> torch.Tensor:
    """An uninitialised CPU tensor, page-locked with its exact size when ``pin`` is true (and the OS agrees),
    on huge pages where Linux offers them."""
    tensor = torch.empty(numel, dtype=dtype)
    advise_huge_pages(tensor)
    pinned = pin and tensor.numel() > 0 and _register_pinned(tensor)
    record_allocation(ledger, HOST_PINNED if pinned else HOST, kind, tensor)
    return tensor


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
_libc: Any = None


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back ``tensor``'s whole 2 MiB pages with transparent huge pages; False where it cannot.

    The CPU step streams every model-sized state buffer once per step, and with 4 KiB pages each stream
    crosses a page, and often misses the TLB, every 1-2k elements; on 2 MiB pages the step runs faster
    (docs/benchmarks.md, "Huge pages"). Called before the buffer is first written, so its pages fault in
    huge (pinning faults them too). The advice is a hint: "never" in
    /sys/kernel/mm/transparent_hugepage/enabled, or another OS, leaves 4 KiB pages and the same results.
    """
    global _libc
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + tensor.untyped_storage().nbytes()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= start or not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise(start, end - start, _MADV_HUGEPAGE) == 0


def host_zeros(
    numel: int, dtype: torch.dtype, pin: bool, kind: str = "state", ledger: MemoryLedger | None = None
) -> torch.Tensor:
    return host_empty(numel, dtype, pin, kind, ledger).zero_()


def is_pinned_here(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in a buffer pinned by :func:`host_empty` (no driver call)."""
    return tensor.untyped_storage().data_ptr() in _pinned_storages


def _register_pinned(tensor: torch.Tensor) -> bool:
    """Page-lock ``tensor``'s memory; on failure warn and leave it pageable (slower copies, same results)."""
    nbytes = tensor.untyped_storage().nbytes()
    try:
        cudart = torch.cuda.cudart()
        pointer = tensor.data_ptr()
        # Portable: pinned for every device's context, not only the one current on this thread.
        status = cudart.cudaHostRegister(pointer, nbytes, _HOST_REGISTER_PORTABLE)
        if int(status) != 0:
            # The runtime keeps the failure as this thread's last error, and torch's check after the next
            # kernel launch would report it as that kernel's error: clear it here, where it is handled.
            clear_cuda_error(cudart)
            raise RuntimeError(f"cudaHostRegister returned {status}")
    except Exception as error:  # no driver, locked-memory limit (ulimit -l), container limits...
        warnings.warn(
            f"Pinning {nbytes / 2**20:.1f} MiB of host memory failed ({error}); using pageable memory, so "
            "host-device copies of this buffer are synchronous. Raise the locked-memory limit or pass "
            "pin_memory=False to the strategy to silence this.",
            ZeroOffloadRuntimeWarning,
            stacklevel=3,
        )
        return False
    _pinned_storages.add(pointer)
    weakref.finalize(tensor.untyped_storage(), _unregister_pinned, cudart, pointer)
    return True


def _unregister_pinned(cudart: Any, pointer: int) -> None:
    _pinned_storages.discard(pointer)
    if int(cudart.cudaHostUnregister(pointer)) != 0:  # at exit, say: not the next kernel's error (see above)
        clear_cuda_error(cudart)


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


def clear_cuda_error(cudart: Any) -> None:
    """Reset the CUDA runtime's last error of the calling thread (``cudaGetLastError``).

    Uses torch's binding where it has one; otherwise the runtime library torch already loaded (looked up
    with ``RTLD_NOLOAD``, so it is the same instance and its error state; nothing new is loaded).
    """
    get_last_error = getattr(cudart, "cudaGetLastError", None)
    if get_last_error is not None:
        get_last_error()
        return
    for name in _CUDART_NAMES:
        try:
            library = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        library.cudaGetLastError()
        return


class BufferPool:
    """A fixed set of equal host buffers, handed out one at a time and returned with a completion event.

    ``acquire`` blocks until a buffer is free and its last transfer has finished, so a buffer is never
    overwritten while a copy still reads it. Thread-safe: the gradient worker returns buffers.

    The thread that would return a buffer can fail instead: it then calls :meth:`fail`, which wakes a
    waiting ``acquire`` and makes every later one raise that error, so the waiter never blocks forever.
    """

    def __init__(
        self, count: int, numel: int, dtype: torch.dtype, pin: bool, ledger: MemoryLedger | None = None
    ) -> None:
        # None in the queue is the wake-up sent by fail().
        self._free: queue.SimpleQueue[tuple[torch.Tensor, torch.Event | None] | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.buffers = [host_empty(numel, dtype, pin, "staging", ledger) for _ in range(count)]
        for buffer in self.buffers:
            self._free.put((buffer, None))

    def acquire(self) -> torch.Tensor:
        if self._error is not None:
            raise self._error
        item = self._free.get()
        if item is None:
            self._free.put(None)  # wake the next waiter too
            raise self._error  # type: ignore[misc]
        buffer, event = item
        wait_event(event)
        return buffer

    def release(self, buffer: torch.Tensor, event: torch.Event | None = None) -> None:
        self._free.put((buffer, event))

    def record_in(self, ledger: MemoryLedger) -> None:
        """Count the pool's buffers in ``ledger`` (an owner kept across a re-plan, which starts a fresh ledger)."""
        for buffer in self.buffers:
            record_allocation(ledger, HOST_PINNED if is_pinned_here(buffer) else HOST, "staging", buffer)

    def fail(self, error: BaseException) -> None:
        """The pool's users failed with ``error``: waiting and later acquires raise it (the first one kept)."""
        if self._error is None:
            self._error = error
            self._free.put(None)


class HostToDevice:
    """Host-to-device copies that never need a model-sized pinned buffer.

    A source already pinned by :func:`host_empty` is copied directly; a pageable one (the master in
    ``32-true``, DPU's next parameters) first goes into one of two pinned buffers of ``numel`` elements,
    so the copy stays asynchronous while pinned memory stays bucket-sized. The buffers are made on first
    use, so runs that never copy pageable memory pin nothing extra.
    """

    def __init__(self, device: torch.device, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self.device = device
        self._shape = (numel, dtype, pin)
        self._pool: BufferPool | None = None
        self._ledger = current_ledger()
        self.staged_copies = 0

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)``, queued on the current stream; ``source`` may change once this returns (a
        device source, the device share's master, is copied on the device)."""
        numel, dtype, pin = self._shape
        if not pin or is_pinned_here(source) or source.numel() > numel or source.device.type != "cpu":
            target.copy_(source, non_blocking=True)
            return
        if self._pool is None:
            self._pool = BufferPool(2, numel, dtype, pin, self._ledger)
        buffer = self._pool.acquire()
        staging = buffer[: source.numel()]
        staging.copy_(source)
        target.copy_(staging, non_blocking=True)
        self._pool.release(buffer, record_event(self.device))
        self.staged_copies += 1

    def record_in(self, ledger: MemoryLedger) -> None:
        """Count the staging buffers made so far in ``ledger``, and make it the one later buffers are recorded in."""
        self._ledger = ledger
        if self._pool is not None:
            self._pool.record_in(ledger)

    @property
    def staging_buffers(self) -> list[torch.Tensor]:
        """The pinned buffers pageable sources go through (none before the first such copy)."""
        return [] if self._pool is None else list(self._pool.buffers)


# -- device buffers ----------------------------------------------------------------------------


def device_empty(
    numel: int, dtype: torch.dtype, device: torch.device, kind: str, ledger: MemoryLedger | None = None
) -> torch.Tensor:
    """A device buffer, recorded in the ledger (``collective temporaries`` count as transient)."""
    tensor = torch.empty(numel, dtype=dtype, device=device)
    ledger = ledger or current_ledger()
    if ledger is not None:
        if kind == COLLECTIVE:
            ledger.transient(DEVICE, kind, tensor.numel() * tensor.element_size())
        else:
            ledger.add(DEVICE, kind, tensor.numel() * tensor.element_size())
    return tensor


def device_zeros(
    numel: int, dtype: torch.dtype, device: torch.device, kind: str, ledger: MemoryLedger | None = None
) -> torch.Tensor:
    return device_empty(numel, dtype, device, kind, ledger).zero_()


class DeviceBufferPool:
    """Equal device buffers, reused oldest-first once the transfer that last read them has completed.

    Reusing the buffer freed last would make the compute stream wait for the transfer just launched,
    serializing transfers with backward. So ``acquire`` takes the oldest free buffer whose event has
    completed; if none has, it allocates another, up to ``cap`` buffers; at the cap it waits (on the
    device, not the host) for the oldest transfer. ``waits`` records (transfer waited for, transfer
    released last) per such wait, so tests can check it is never the latest.

    A reused buffer always gets a stream wait on its event, also when the event has completed (then the
    wait costs nothing): a completed ``query()`` orders nothing for the CUDA sanitizer, a stream wait
    does. With every buffer in use, ``acquire`` allocates past the cap (the caller bounds how many it
    holds); a buffer returned while more than ``cap`` exist is freed once its transfer has completed,
    so the pool keeps at most ``cap``.
    """

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        cap: int,
        ledger: MemoryLedger | None = None,
    ) -> None:
        self.numel, self.dtype, self.device, self.cap = numel, dtype, device, cap
        self._ledger = ledger or current_ledger()
        self._free: deque[tuple[torch.Tensor, torch.Event | None, Hashable]] = deque()
        # Buffers beyond the cap, kept only until the transfer reading them has completed.
        self._retiring: list[tuple[torch.Tensor, torch.Event | None]] = []
        self._last_released: Hashable = None
        self.allocated = 0  # buffers that exist now
        self.peak = 0  # the most that existed at once (what the ledger records)
        self.waits: list[tuple[Hashable, Hashable]] = []

    def acquire(self) -> torch.Tensor:
        self._drop_retired()
        for position, (buffer, event, _) in enumerate(self._free):
            if event is None or event.query():
                del self._free[position]
                stream_wait_event(event, self.device)
                return buffer
        if self._free and self.allocated >= self.cap:
            buffer, event, tag = self._free.popleft()
            stream_wait_event(event, self.device)
            self.waits.append((tag, self._last_released))
            return buffer
        self.allocated += 1
        buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        if self.allocated > self.peak:  # recorded once per high-water mark: freed extras come back as the same bytes
            self.peak = self.allocated
            record_allocation(self._ledger, DEVICE, "gradient buckets", buffer)
        return buffer

    def release(self, buffer: torch.Tensor, event: torch.Event | None, tag: Hashable) -> None:
        self._last_released = tag
        if self.allocated - len(self._retiring) > self.cap:  # more than the cap would stay
            self._retiring.append((buffer, event))
            self._drop_retired()
            return
        self._free.append((buffer, event, tag))

    def _drop_retired(self) -> None:
        kept = [(buffer, event) for buffer, event in self._retiring if event is not None and not event.query()]
        self.allocated -= len(self._retiring) - len(kept)
        self._retiring = kept

    def clear(self) -> None:
        self._free.clear()
        self._retiring.clear()
