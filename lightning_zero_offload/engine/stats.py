"""What one optimizer step did and where its time went."""

from __future__ import annotations

import time
from dataclasses import dataclass


def hidden_fraction(transfer_s: float, exposed_s: float) -> float:
    """Share of the transfer work that overlapped backward, in [0, 1] (0 when there was none)."""
    if transfer_s <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - exposed_s / transfer_s))


@dataclass
class StepStats:
    """What the last optimizer step did and where its time went (seconds).

    ``transfer_s`` is the time the gradient worker spent moving and accumulating buckets;
    ``transfer_wait_s`` the part of it the training thread waited for after backward (not hidden).
    ``cpu_step_s`` is the CPU Adam time of the step wherever it ran: after backward (sync), during it
    (speculative: ``speculated_fraction`` of the parameters) or in the background (delayed, where
    ``update_wait_s`` is the part of it the training thread waited for); ``cpu_step_after_backward_s`` the part
    of it ``step()`` ran. ``tail_s`` is the time from the last gradient's landing (the gradient worker idle) to the
    end of ``step()`` less that part: what follows the host buckets' steps whatever the device share (the
    validation, the device's step, the copy-back, and what the training loop ran between backward and the step).
    """

    skipped: bool = False
    grad_norm: float = 0.0
    loss_scale: float = 1.0
    backward_s: float = 0.0
    transfer_s: float = 0.0
    transfer_wait_s: float = 0.0
    cpu_step_s: float = 0.0
    update_wait_s: float = 0.0
    cpu_step_after_backward_s: float = 0.0
    copy_back_s: float = 0.0
    total_s: float = 0.0
    tail_s: float = 0.0
    speculated_fraction: float = 0.0  # share of this rank's trainable elements updated during backward
    rolled_back: bool = False  # speculated buckets had to be undone (clipping, overflow, hyperparameters)

    @property
    def hidden_transfer_fraction(self) -> float:
        return hidden_fraction(self.transfer_s, self.transfer_wait_s)


class StepTimer:
    """An engine's clock for its steps' figures: backward's seconds (summed over an accumulation window's passes)
    and when the last pass's gradients had all landed, from which the step's ``tail_s`` is timed."""

    def __init__(self) -> None:
        self._backward_start: float | None = None
        self._backward_s = 0.0
        self._landed: float | None = None

    def backward_started(self) -> None:
        self._backward_start = time.perf_counter()

    def backward_ended(self) -> bool:
        """Whether a backward pass was open (and now ends)."""
        if self._backward_start is None:
            return False
        self._backward_s += time.perf_counter() - self._backward_start
        self._backward_start = None
        return True

    def gradients_landed(self) -> None:
        self._landed = time.perf_counter()

    def step_stats(self, loss_scale: float) -> StepStats:
        """A step's figures, begun with the window's backward time (the next window's starts from zero)."""
        stats = StepStats(loss_scale=loss_scale, backward_s=self._backward_s)
        self._backward_s = 0.0
        return stats

    def step_ended(self, stats: StepStats, start: float) -> None:
        """``total_s`` from ``start``, and ``tail_s`` where this step's gradients landed (not: a second step on the
        gradients the first left)."""
        end = time.perf_counter()
        stats.total_s = end - start
        landed, self._landed = self._landed, None
        if landed is not None:
            stats.tail_s = max(0.0, end - landed - stats.cpu_step_after_backward_s)
