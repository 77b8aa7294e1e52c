"""Kept so that the old import path works (LightningCLI configs saved with it, for one): the code is in
:mod:`lightning_zero_offload.trainer.strategy`."""

from lightning_zero_offload.trainer.strategy import ZeroOffloadStrategy

__all__ = ["ZeroOffloadStrategy"]
