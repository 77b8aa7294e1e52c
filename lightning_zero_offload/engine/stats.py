"""What one optimizer step did and where its time went."""

from __future__ import annotations

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
    ``update_wait_s`` is the part of it the training thread waited for).
    """

    skipped: bool = False
    grad_norm: float = 0.0
    loss_scale: float = 1.0
    backward_s: float = 0.0
    transfer_s: float = 0.0
    transfer_wait_s: float = 0.0
    cpu_step_s: float = 0.0
    update_wait_s: float = 0.0
    copy_back_s: float = 0.0
    total_s: float = 0.0
    speculated_fraction: float = 0.0  # share of this rank's trainable elements updated during backward
    rolled_back: bool = False  # speculated buckets had to be undone (clipping, overflow, hyperparameters)

    @property
    def hidden_transfer_fraction(self) -> float:
        return hidden_fraction(self.transfer_s, self.transfer_wait_s)
