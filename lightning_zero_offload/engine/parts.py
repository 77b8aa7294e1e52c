"""The narrow interface schedules, the update pipeline (engine/update.py) and the state in and out
(engine/state.py) get instead of the engine.

A schedule decides *when* each bucket's update runs; what it acts on are the engine's parts: the
layout, the CPU state (engine/cpu_state.py), the gradient source (engine/gradient_source.py), the
publisher (engine/publisher.py) and the worker thread, plus the few engine decisions it must follow
(the loss scale, how many steps were taken, clipping by value, merging writes into the master).
:class:`OffloadEngine` satisfies this protocol; nothing under engine/schedules/ imports it.
"""

from __future__ import annotations

from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_zero_offload.engine.cpu_state import CpuState
    from lightning_zero_offload.engine.gradient_source import GradientSource
    from lightning_zero_offload.engine.layout import Bucket, Layout
    from lightning_zero_offload.engine.options import Resolved
    from lightning_zero_offload.engine.publisher import NullPublisher, Publisher
    from lightning_zero_offload.engine.save_sharing import SaveSharing


class EngineParts(Protocol):
    """The parts a schedule acts on, and the engine callbacks it may call."""

    # the parts
    layout: Layout
    state: CpuState
    grads: GradientSource
    publisher: Publisher | NullPublisher
    updater: ThreadPoolExecutor  # the one worker thread updates run on
    # what the parts were built for
    optimizer: torch.optim.Optimizer  # hyperparameters are read live from its param groups
    params: list[torch.nn.Parameter]
    group_of: list[int]
    resolved: Resolved
    device: torch.device
    param_dtype: torch.dtype
    num_threads: int
    overlap: bool
    step_calls: int
    process_group: dist.ProcessGroup | None  # the ranks sharing the state (gathers for checkpoints)
    torch_index: list[int]  # each trainable parameter's number in the optimizer's state dict
    save_sharing: SaveSharing  # views or placeholders for a full save (engine/state.py)
    # in place only: per-parameter views of (master, exp_avg, exp_avg_sq)
    param_views: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]

    @property
    def loss_scale(self) -> float: ...

    # engine callbacks
    def publish(self, bucket: Bucket, out: torch.Tensor | None, pooled: bool = True) -> None: ...

    def wait_publish(self) -> None: ...

    def refresh_device_params(self) -> None: ...

    def absorb_param_writes(self) -> int: ...

    def clamp_grads(self, limit: float) -> None: ...

    def refuse_after_failure(self, what: str) -> None: ...

    def update_now(
        self,
        has_grad: list[bool],
        multiplier: float,
        done: Collection[int] = (),
        done_out: torch.Tensor | None = None,
    ) -> tuple[float, float]: ...
