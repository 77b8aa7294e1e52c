"""The engine's settings, validated once, with errors that name the strategy option to change."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from lightning_zero_offload.engine.scaler import LossScalerConfig

CheckpointFormat = Literal["full", "sharded"]


def default_cpu_threads(local_world_size: int = 1) -> int:
    """Cores this process may use, shared evenly between the ranks of one node.

    Deliberately ignores ``OMP_NUM_THREADS``: torchrun sets it to 1, which would silently make the
    CPU optimizer single-threaded.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_world_size))


@dataclass
class OffloadOptions:
    bucket_size_mb: float = 25.0
    pin_memory: bool = True
    overlap: bool = True
    cpu_threads: int | None = None
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    delayed_param_update: bool = False
    dpu_warmup_steps: int = 40
    dpu_weight_prediction: bool = False
    checkpoint_format: CheckpointFormat = "full"

    def validate(self) -> None:
        if not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {self.bucket_size_mb}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1 or None (all cores of this rank), got {self.cpu_threads}")
        if self.dpu_warmup_steps < 0:
            raise ValueError(f"dpu_warmup_steps must be >= 0, got {self.dpu_warmup_steps}")
        if self.dpu_weight_prediction and not self.delayed_param_update:
            raise ValueError(
                "dpu_weight_prediction=True only changes the delayed update; set delayed_param_update=True too"
            )
        if self.checkpoint_format not in ("full", "sharded"):
            raise ValueError(f"checkpoint_format must be 'full' or 'sharded', got {self.checkpoint_format!r}")
        self.loss_scaler.validate()

    def bucket_numel(self, element_size: int) -> int:
        return max(1, int(self.bucket_size_mb * 2**20) // element_size)
