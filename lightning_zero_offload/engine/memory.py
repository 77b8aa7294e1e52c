"""Host buffers and transfer completion: the only place that knows about pinned memory and events.

Pinned memory is allocated by registering an ordinary allocation with the driver, not through torch's
caching host allocator, which rounds every block up to a power of two (a 1.1 GB buffer would pin
2 GB: DeepSpeed users' host-RAM blowups). Only buffers that take part in asynchronous copies are
pinned; the Adam moments and the fp32 gradient buffer never cross the bus and stay pageable.
"""

from __future__ import annotations

import queue
import weakref
from contextlib import AbstractContextManager, nullcontext

import torch


def can_pin(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """An uninitialised CPU tensor, page-locked with its exact size when ``pin`` is true."""
    tensor = torch.empty(numel, dtype=dtype)
    if pin and tensor.numel() > 0:
        _register_pinned(tensor)
    return tensor


def host_zeros(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return host_empty(numel, dtype, pin).zero_()


def _register_pinned(tensor: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    pointer, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    status = cudart.cudaHostRegister(pointer, nbytes, 0)
    if int(status) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes / 2**20:.1f} MiB failed ({status}); "
            "pass pin_memory=False to the strategy to use pageable memory"
        )
    weakref.finalize(tensor, cudart.cudaHostUnregister, pointer)


def side_stream(device: torch.device) -> torch.Stream | None:
    """A second stream for transfers, so they overlap compute; None where copies are synchronous (CPU)."""
    return None if device.type == "cpu" else torch.Stream(device=device)


def on_stream(stream: torch.Stream | None) -> AbstractContextManager:
    """Make ``stream`` current (after it has waited for the work queued so far on the current one)."""
    if stream is None:
        return nullcontext()
    stream.wait_stream(torch.accelerator.current_stream(stream.device))
    return stream


def stream_wait_event(device: torch.device, event: torch.Event | None) -> None:
    """Queue a wait for ``event`` on the current stream (no host blocking)."""
    if event is not None:
        torch.accelerator.current_stream(device).wait_event(event)


def record_event(device: torch.device) -> torch.Event | None:
    """An event marking the work queued so far on ``device``; None where copies are synchronous."""
    if device.type == "cpu":
        return None
    event = torch.Event(device=device)
    event.record()
    return event


def wait_event(event: torch.Event | None) -> None:
    """Block the calling host thread until ``event`` has completed (no-op for synchronous devices)."""
    if event is not None:
        event.synchronize()


class BufferPool:
    """A fixed set of equal host buffers, handed out one at a time and returned with a completion event.

    ``acquire`` blocks until a buffer is free and its last transfer has finished, so a buffer is never
    overwritten while a copy still reads it. Thread-safe: the gradient worker returns buffers.
    """

    def __init__(self, count: int, numel: int, dtype: torch.dtype, pin: bool) -> None:
        self._free: queue.SimpleQueue[tuple[torch.Tensor, torch.Event | None]] = queue.SimpleQueue()
        self.buffers = [host_empty(numel, dtype, pin) for _ in range(count)]
        for buffer in self.buffers:
            self._free.put((buffer, None))

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def acquire(self) -> torch.Tensor:
        buffer, event = self._free.get()
        wait_event(event)
        return buffer

    def release(self, buffer: torch.Tensor, event: torch.Event | None = None) -> None:
        self._free.put((buffer, event))
