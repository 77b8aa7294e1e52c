"""The offload engine: plain torch (no Lightning imports), usable and testable without a Trainer."""

from lightning_zero_offload.engine.engine import OffloadEngine
from lightning_zero_offload.engine.options import (
    DelayedOptions,
    OffloadOptions,
    Resolved,
    SpeculativeOptions,
    resolve,
)
from lightning_zero_offload.engine.scaler import DynamicLossScaler, LossScalerConfig
from lightning_zero_offload.engine.stats import StepStats

__all__ = [
    "DelayedOptions",
    "DynamicLossScaler",
    "LossScalerConfig",
    "OffloadEngine",
    "OffloadOptions",
    "Resolved",
    "SpeculativeOptions",
    "StepStats",
    "resolve",
]
