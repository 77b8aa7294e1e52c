"""Streams, events and worker threads: how the engine orders device work and waits for it.

On the CPU (the tests' device) copies are synchronous: there is no side stream and no event (``None``),
and waiting for ``None`` returns at once, so callers need no branch of their own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


def side_stream(device: torch.device) -> torch.Stream | None:
    """A second stream for transfers, so they overlap compute; None where copies are synchronous (CPU)."""
    return None if device.type == "cpu" else torch.Stream(device=device)


def on_stream(stream: torch.Stream | None) -> AbstractContextManager:
    """Make ``stream`` current (after it has waited for the work queued so far on the current one)."""
    if stream is None:
        return nullcontext()
    stream.wait_stream(torch.accelerator.current_stream(stream.device))
    return stream


def new_event(device: torch.device, timing: bool = False) -> torch.Event | None:
    """An event for ``device``; None where copies are synchronous (CPU).

    On CUDA a blocking-sync event, so a host thread waiting for it sleeps instead of spinning a core
    that CPU Adam needs (``torch.Event`` accepts ``blocking`` but ignores it).
    """
    if device.type == "cpu":
        return None
    if device.type == "cuda":
        return torch.cuda.Event(enable_timing=timing, blocking=True)
    return torch.Event(device=device, enable_timing=timing)


def current_stream(device: torch.device) -> Any:
    """``device``'s current stream in this thread (even when another device is the current one); None on the CPU."""
    if device.type == "cpu":
        return None
    if device.type == "cuda":  # torch.cuda.Event takes only torch.cuda streams
        return torch.cuda.current_stream(device)
    return torch.accelerator.current_stream(device)


def record_event(device: torch.device, timing: bool = False) -> torch.Event | None:
    """An event marking the work queued so far on ``device``'s current stream; None where copies are synchronous."""
    event = new_event(device, timing)
    if event is not None:
        event.record(current_stream(device))
    return event


def stream_wait_event(event: torch.Event | None, device: torch.device) -> None:
    """Queue a wait for ``event`` on ``device``'s current stream (no host blocking)."""
    if event is not None:
        event.wait(current_stream(device))


def wait_event(event: torch.Event | None) -> None:
    """Block the calling host thread until ``event`` has completed (no-op for synchronous devices)."""
    if event is not None:
        event.synchronize()


def resolve_device(device: torch.device) -> torch.device:
    """``device`` with its index filled in from the calling thread ("cuda" -> "cuda:<current>")."""
    if device.type == "cpu" or device.index is not None:
        return device
    return torch.device(device.type, torch.accelerator.current_device_index())


def set_thread_device(device: torch.device) -> None:
    """Make ``device`` current in this thread. A new thread's current device is 0, so without this its
    event waits and event destruction would create a context on GPU 0 (about 0.5 GiB per rank)."""
    if device.type != "cpu" and device.index is not None:
        torch.accelerator.set_device_index(device.index)


def worker_pool(name: str, device: torch.device) -> ThreadPoolExecutor:
    """A one-thread executor whose thread runs with ``device`` current."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=set_thread_device, initargs=(resolve_device(device),)
    )


def device_transfer_times(
    origin: torch.Event, spans: list[tuple[torch.Event, torch.Event]], backward_end: torch.Event
) -> tuple[float, float]:
    """(seconds of transfer, seconds of it before ``backward_end``) of device ``spans`` (start and end
    events of each transfer), all timed on one device clock from ``origin``."""
    end_ms = origin.elapsed_time(backward_end)
    transfer_s = hidden_s = 0.0
    for started, copied in spans:  # milliseconds after the origin
        a, b = origin.elapsed_time(started), origin.elapsed_time(copied)
        transfer_s += (b - a) / 1e3
        hidden_s += max(0.0, min(b, end_ms) - a) / 1e3
    return transfer_s, hidden_s
