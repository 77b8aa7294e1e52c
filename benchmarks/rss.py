"""Host memory of this process as the kernel counts it (resident set), and its peak over an interval."""

from __future__ import annotations

import os
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler(threading.Thread):
    """The largest RSS seen, sampled every millisecond (a peak shorter than that can be missed)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.done = rss(), threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def reset(self) -> int:
        """The peak so far (including now), and start a new one from the current RSS."""
        peak, self.peak = max(self.peak, rss()), rss()
        return peak

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, rss())
