"""What the schedules get instead of the engine (:class:`ScheduleParts`), and the engine's state I/O
interface (:class:`ShardedState`, for engine/state_dicts.py).

A schedule decides *when* each bucket's update runs; what it acts on are the engine's parts: the
layout, the CPU state (engine/step/cpu_state.py), the gradient source (engine/step/gradient_source.py), the
publisher (engine/step/publisher.py) and the update (engine/step/update.py's pipeline, or engine/step/in_place.py's
step), plus the two engine decisions it must follow (:class:`StepControl`: how many steps were
taken, the loss scale) and the gather of a shard for its checkpoint. Nothing under engine/schedules/
imports the engine.

The parts are generic in the update they carry: every schedule can run a whole step now
(:class:`Update`); the speculative and delayed schedules, which run on the offload path only, get its
pipeline (``ScheduleParts[UpdatePipeline]``: plans, one bucket's update, publishing), so none of them
has to ask which update it was given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_zero_offload import kernels
    from lightning_zero_offload.engine.options import Resolved
    from lightning_zero_offload.engine.save_sharing import SaveSharing
    from lightning_zero_offload.engine.step.cpu_state import CpuState, ParkedState
    from lightning_zero_offload.engine.step.gradient_source import BucketArrivals, GradientSource
    from lightning_zero_offload.engine.step.layout import Layout
    from lightning_zero_offload.engine.step.publisher import NullPublisher, Publisher


class Update(Protocol):
    """The CPU update of a whole step: step/update.py's ``UpdatePipeline`` or step/in_place.py's ``InPlaceUpdate``."""

    def hyperparams(self) -> list[kernels.AdamArgs]: ...

    def update_now(self, has_grad: list[bool], multiplier: float) -> tuple[float, float]:
        """Plan, count and run the step of every parameter that got a gradient, and put the result on the
        device; returns (update, publish) seconds."""
        ...


class StepControl(Protocol):
    """The engine's decisions a schedule follows."""

    @property
    def step_calls(self) -> int:
        """step() calls so far, skipped ones included (the delayed warm-up counts them)."""
        ...

    @property
    def loss_scale(self) -> float: ...

    def full_tensors(self, shard: torch.Tensor) -> list[torch.Tensor]: ...


U = TypeVar("U", bound=Update, covariant=True)


@dataclass(frozen=True)
class ScheduleParts(Generic[U]):
    """The parts a schedule acts on (made by the engine with them, again after every re-plan)."""

    layout: Layout
    state: CpuState
    grads: GradientSource
    arrivals: BucketArrivals  # the buckets whose gradient has landed, as the gradient source reports them
    publisher: Publisher | NullPublisher
    # engine/step/update.py's UpdatePipeline; in place (the sync schedule only) engine/step/in_place.py's InPlaceUpdate
    update: U
    params: list[torch.nn.Parameter]  # the device parameters
    device: torch.device
    param_dtype: torch.dtype
    num_threads: int
    resolved: Resolved  # the schedule's own settings (resolved.delayed, resolved.speculation_rollback)
    control: StepControl


class ShardedState(Protocol):
    """What engine/state_dicts.py's conversions between flat shards and full tensors read of the engine."""

    layout: Layout
    state: CpuState
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    device: torch.device
    process_group: dist.ProcessGroup | None  # the ranks sharing the state (gathers for checkpoints)
    torch_index: list[int]  # each trainable parameter's number in the optimizer's state dict
    save_sharing: SaveSharing  # views or placeholders for a full save
    parked: ParkedState  # the state of parameters that left the trainable set

    def refuse_after_failure(self, what: str) -> None: ...
