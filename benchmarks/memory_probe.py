"""Host memory of this process as the kernel counts it (resident set), its peak over an interval, and the
model the memory benchmarks measure."""

from __future__ import annotations

import os
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def transparent_huge_pages() -> str:
    """Linux's transparent-huge-page mode ("always", "madvise" or "never"), or "absent" elsewhere."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def status(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """The kernel's high-water mark (VmHWM) starts again from the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def anonymous_rss() -> int:
    """RSS less its file-backed pages (mapped files such as a memory-mapped checkpoint, code paged in):
    the memory that only swap or the OOM killer can take back."""
    with open("/proc/self/statm") as f:
        _, resident, shared = map(int, f.read().split()[:3])
    return (resident - shared) * PAGE


def mappings(start: int, end: int) -> list[dict[str, str]]:
    """The /proc/self/smaps fields ("VmFlags", "AnonHugePages", ...) of each mapping that overlaps the bytes
    [start, end), with its address range as "Range": one buffer can span several (``madvise`` splits a
    mapping where its advice starts)."""
    found: list[dict[str, str]] = []
    fields: dict[str, str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                fields = {"Range": head} if low < end and start < high else None
                if fields is not None:
                    found.append(fields)
            elif fields is not None:
                name, _, value = line.partition(":")
                fields[name] = value.strip()
    return found


class PeakSampler(threading.Thread):
    """The largest RSS (or ``measure()``) seen, sampled every millisecond (a shorter peak can be missed)."""

    def __init__(self, measure=rss) -> None:
        super().__init__(daemon=True)
        self.measure = measure
        self.peak, self.done = measure(), threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.measure())
            time.sleep(0.001)

    def reset(self) -> int:
        """The peak so far (including now), and start a new one from the current value."""
        peak, self.peak = max(self.peak, self.measure()), self.measure()
        return peak

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, self.measure())


def linear_stack(params: float, width: int):
    """A LightningModule of Linear(width, width) layers with about ``params`` parameters (Lightning is
    imported here, in the measuring child, so the parent's RSS is not part of the measurement)."""
    import lightning as L
    import torch
    from torch import nn

    layers = max(1, round(params / (width * width + width)))

    class LinearStack(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return LinearStack
