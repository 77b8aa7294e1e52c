"""What the engine does when training goes wrong: persistent non-finite steps, and closing after a failure.

Both are about never hanging and never ending "successfully" when something is broken:

- :class:`NonFinitePolicy` turns a run of skipped (inf/nan) steps into an error instead of a run that
  quietly stops learning. Every rank sees the same skip decisions (the overflow flag is all-reduced),
  so every rank raises at the same step.
- ``OffloadEngine.close(after_failure=True)`` releases the engine without a single collective: after an
  exception the other ranks may be anywhere (inside a collective of their own, or dead), so a gather
  would hang; afterwards ``OffloadEngine.refuse_after_failure`` raises instead of gathering.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_zero_offload.engine.scaler import DynamicLossScaler


class NonFiniteLossError(RuntimeError):
    """Training cannot continue: the gradients stay non-finite, so every step is being skipped."""


class NonFinitePolicy:
    """Counts consecutive skipped steps and raises once training has clearly stopped making progress.

    - ``max_consecutive`` skipped steps in a row raise (``None``: never). With bf16/fp32 a skip means
      the loss or gradients themselves are inf/nan; with fp16 the first skips are the loss scale
      calibrating downwards (from 2**16 about two per halving), which the default leaves room for.
    - fp16 also raises when a step overflows with the loss scale already at its minimum (and the
      hysteresis used up): the scale cannot go lower, so every later step would overflow too
      (DeepSpeed raises here as well).
    """

    def __init__(self, max_consecutive: int | None, scaler: DynamicLossScaler | None) -> None:
        self.max_consecutive = max_consecutive
        self.scaler = scaler
        self.consecutive = 0
        self._overflows_at_min = 0

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "overflows_at_min": self._overflows_at_min}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self._overflows_at_min = int(state.get("overflows_at_min", 0))

    def after_step(self, skipped: bool, scale_before: float) -> None:
        """Record one optimizer step; ``scale_before`` is the loss scale the step's loss was multiplied by."""
        if not skipped:
            self.consecutive = self._overflows_at_min = 0
            return
        self.consecutive += 1
        scaler = self.scaler
        if scaler is not None and scale_before <= scaler.config.min_scale:
            self._overflows_at_min += 1
            if self._overflows_at_min >= scaler.config.hysteresis:
                minimum = scaler.config.min_scale
                raise NonFiniteLossError(
                    f"fp16 gradients overflow even at the minimum loss scale (loss_scale_min={minimum}): "
                    f"{self.consecutive} consecutive optimizer steps were skipped and the scale cannot go lower. "
                    "The loss or the gradients are inf/nan (or exceed fp16's range) before scaling: check the data "
                    "and the loss for inf/nan, lower the learning rate, or use precision='bf16-mixed'."
                )
        if self.max_consecutive is not None and self.consecutive >= self.max_consecutive:
            scale = f" (loss scale now {scaler.scale:g})" if scaler is not None else ""
            raise NonFiniteLossError(
                f"{self.consecutive} consecutive optimizer steps were skipped because the gradients were inf/nan"
                f"{scale}, so the parameters stopped changing. Check the loss and the inputs for inf/nan, lower the "
                "learning rate or clip gradients; if fp16 needs more steps to find a loss scale, lower "
                "loss_scale_init. To allow longer runs of skipped steps set max_consecutive_skipped_steps "
                "(None never raises)."
            )
