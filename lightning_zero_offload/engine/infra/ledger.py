"""The memory ledger: bytes the engine holds, by place and purpose, recorded where each buffer is made.

Every buffer engine/infra/memory.py makes is recorded in the :class:`MemoryLedger` that is current where it
is made (:func:`records_allocations` makes an engine's constructor that place), so ``memory_report``
is read off the allocations themselves and a new buffer cannot be left out of it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import torch

HOST, HOST_PINNED, DEVICE = "host", "host_pinned", "device"
COLLECTIVE = "collective temporaries"  # transient device buffers: counted with their largest size


class MemoryLedger:
    """Bytes the engine holds, by place (host, host_pinned, device) and purpose, recorded at allocation.

    Long-lived buffers add up; transient ones (collective temporaries) count with their largest size,
    since each is freed before the next of its kind is made.
    """

    def __init__(self) -> None:
        self._bytes: dict[tuple[str, str], int] = {}
        self._count: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def add(self, place: str, kind: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[place, kind] = self._bytes.get((place, kind), 0) + nbytes
            self._count[place, kind] = self._count.get((place, kind), 0) + 1

    def transient(self, place: str, kind: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[place, kind] = max(self._bytes.get((place, kind), 0), nbytes)
            self._count[place, kind] = 1

    def bytes(self, place: str | None = None, kind: str | None = None) -> int:
        return sum(n for (p, k), n in self._bytes.items() if place in (None, p) and kind in (None, k))

    def count(self, place: str | None = None, kind: str | None = None) -> int:
        return sum(n for (p, k), n in self._count.items() if place in (None, p) and kind in (None, k))

    def report(self, params: int) -> dict[str, int]:
        """``OffloadEngine.memory_report``: totals per place plus the figures the summary prints."""
        grad_buffers = self.count(DEVICE, "gradient buckets")
        return {
            "params": params,
            "host_state_bytes": self.bytes(HOST, "state") + self.bytes(HOST_PINNED, "state"),
            "host_staging_bytes": self.bytes(HOST, "staging") + self.bytes(HOST_PINNED, "staging"),
            "host_pinned_bytes": self.bytes(HOST_PINNED),
            "host_total_bytes": self.bytes(HOST) + self.bytes(HOST_PINNED),
            "device_param_bytes": self.bytes(DEVICE, "params"),
            "device_grad_buffer_bytes": self.bytes(DEVICE, "gradient buckets") // max(1, grad_buffers),
            "device_grad_buffers_peak": grad_buffers,
            "device_collective_bytes": self.bytes(DEVICE, COLLECTIVE),
            "device_state_bytes": self.bytes(DEVICE, "state"),
            "device_total_bytes": self.bytes(DEVICE),
        }


_current_ledger: ContextVar[MemoryLedger | None] = ContextVar("zero_offload_ledger", default=None)


def current_ledger() -> MemoryLedger | None:
    """The ledger of the engine being constructed (None outside a constructor)."""
    return _current_ledger.get()


_Init = TypeVar("_Init", bound=Callable[..., None])


def records_allocations(init: _Init) -> _Init:
    """Decorate a constructor: it gets ``self.ledger``, and every buffer made while it runs is recorded there."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        self.ledger = MemoryLedger()
        token = _current_ledger.set(self.ledger)
        try:
            init(self, *args, **kwargs)
        finally:
            _current_ledger.reset(token)

    return wrapper  # type: ignore[return-value]


def record_allocation(ledger: MemoryLedger | None, place: str, kind: str, tensor: torch.Tensor) -> None:
    """Add ``tensor``'s bytes to ``ledger``, or to the current one (nothing outside a constructor)."""
    ledger = ledger or current_ledger()
    if ledger is not None:
        ledger.add(place, kind, tensor.numel() * tensor.element_size())
