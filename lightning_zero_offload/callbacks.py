"""Kept so that the old import path works (LightningCLI configs saved with it, for one): the code is in
:mod:`lightning_zero_offload.trainer.callbacks`."""

from lightning_zero_offload.trainer.callbacks import OffloadMetrics

__all__ = ["OffloadMetrics"]
