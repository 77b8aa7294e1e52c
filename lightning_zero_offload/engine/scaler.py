"""Dynamic loss scaling for fp16 training.

The overflow check itself is free: the CPU accumulate kernel reports inf/nan while it copies the
gradients, so the scaler only has to turn that flag into a decision. A host-side float is enough
(no device tensor, no sync), because the decision is made on the CPU anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero_offload.engine.option_values import check_int, check_real


@dataclass(frozen=True)
class LossScalerConfig:
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0

    def __post_init__(self) -> None:
        # Named as the strategy's options, which is where a user sets them.
        check_real("loss_scale_init", self.init_scale, "> 0", lambda v: v > 0)
        check_real("loss_scale_growth_factor", self.growth_factor, "> 1", lambda v: v > 1)
        check_real("loss_scale_backoff_factor", self.backoff_factor, "in (0, 1)", lambda v: 0 < v < 1)
        check_int("loss_scale_growth_interval", self.growth_interval, 1)
        check_int("loss_scale_hysteresis", self.hysteresis, 1)
        check_real(
            "loss_scale_min",
            self.min_scale,
            f"in (0, loss_scale_init={self.init_scale}]",
            lambda v: 0 < v <= self.init_scale,
        )


class DynamicLossScaler:
    """Multiplies the loss by ``scale``; shrinks it on overflow, grows it after a run of good steps.

    ``hysteresis`` is the number of overflows tolerated before the scale is lowered (DeepSpeed's
    meaning): a single fp16 spike does not halve the scale, but every overflowing step is skipped.
    """

    def __init__(self, config: LossScalerConfig) -> None:
        self.config = config
        self.scale = config.init_scale
        self._good_steps = 0
        self._hysteresis_left = config.hysteresis

    def update(self, overflow: bool) -> None:
        cfg = self.config
        if overflow:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
                self._hysteresis_left = cfg.hysteresis
            return
        self._good_steps += 1
        if self._good_steps % cfg.growth_interval == 0:
            self.scale *= cfg.growth_factor
            self._hysteresis_left = cfg.hysteresis

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """:meth:`state_dict` back, or torch's ``GradScaler.state_dict()`` (a run resumed from AMP keeps its
        scale and its run of good steps; this scaler's own options stay the ones it was built with)."""
        self.scale = float(state["scale"])
        if "_growth_tracker" in state:
            self._good_steps = int(state["_growth_tracker"])
            self._hysteresis_left = self.config.hysteresis
            return
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])

    def grad_scaler_state_dict(self) -> dict[str, float | int]:
        """This state as torch's ``GradScaler.state_dict()`` holds its own, for a run resumed under AMP."""
        cfg = self.config
        return {
            "scale": self.scale,
            "growth_factor": cfg.growth_factor,
            "backoff_factor": cfg.backoff_factor,
            "growth_interval": cfg.growth_interval,
            # GradScaler counts good steps since its last growth; this one since the last overflow.
            "_growth_tracker": self._good_steps % cfg.growth_interval,
        }
