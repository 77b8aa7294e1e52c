"""What a schedule is: when the CPU step of the planned update runs relative to forward/backward.

The engine's parts own the data (the CPU state, the gradient source, the publisher) and the engine
makes the decisions shared by all schedules (global norm, overflow, clip factor, skip). A schedule
owns only *when* and *where* the update of each bucket runs, and the state that this timing needs (a
pending update, speculated buckets), including its part of a checkpoint. It gets the parts as a
:class:`~lightning_zero_offload.engine.step.parts.ScheduleParts`, never the engine itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lightning_zero_offload.engine.stats import StepStats
from lightning_zero_offload.engine.step.layout import Bucket

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.gradient_source import GradientSource
    from lightning_zero_offload.engine.step.parts import ScheduleParts, Update


@dataclass(frozen=True)
class StepInputs:
    """What the engine decided after backward for a step that is not skipped."""

    has_grad: list[bool]  # per trainable parameter, over all ranks
    clip_coef: float  # global-norm clip factor (1.0: clipping off or not triggered)
    multiplier: float  # clip_coef / loss scale: the factor the kernel applies to the stored gradients
    clamp_limit: float | None  # clip by value, in loss-scaled units
    scaled_grad_norm: float  # global norm of the stored (loss-scaled) gradients


class Schedule:
    """The synchronous default of every hook; subclasses override what their timing changes."""

    name: ClassVar[str]
    rollbacks = 0  # speculated work taken back (only the speculative schedule has any)
    updates_during_backward = False  # the master changes before step() is called
    # The step's gradients stay in the buffer backward fills, to be added to or stepped with again
    # (torch keeps .grad until zero_grad); the delayed schedule's update reads them behind the next forward.
    keeps_gradients_after_step = True

    def __init__(self, parts: ScheduleParts[Update]) -> None:
        self.parts = parts

    def before_forward(self) -> None:
        """A training forward is about to start: launch work meant to run behind it (nothing here: sync
        and speculative take writes to the parameters over where they next use the master)."""

    def on_backward_start(self, step_follows: bool, publish_early: bool) -> None:
        """A backward pass begins; ``step_follows``: the caller announced that a step() follows it;
        ``publish_early``: and that nothing reads the parameters before it (``engine.expect_step``)."""

    def on_backward_end(self) -> None:
        """The backward pass's gradients are all in the CPU buffer."""

    def before_step(self, stats: StepStats) -> None:
        """After backward, before the gradient summary (the delayed schedule publishes its update here)."""

    def apply(self, inputs: StepInputs, stats: StepStats) -> None:
        """Run the step (not skipped): clamp, plan, update and publish."""
        raise NotImplementedError

    def on_skip(self, stats: StepStats) -> None:
        """The step was skipped (inf/nan gradients): nothing may have changed."""

    @property
    def update_in_flight(self) -> bool:
        """An update is changing the master now: writes to the parameters are merged once it lands."""
        return False

    def published_chunk(self, bucket: Bucket) -> torch.Tensor | None:
        """What the device was last given for this rank's chunk of ``bucket``, where that is not the
        master rounded to the device dtype (None: it is)."""
        return None

    def before_param_writes_merge(self, buckets: list[int]) -> None:
        """User code wrote into these buckets' device parameters: the master is about to take the values."""

    def merge_param_writes(self, bucket: Bucket) -> int:
        """Make the elements user code wrote into ``bucket``'s device parameters the master's; returns how many."""
        return self.parts.publisher.writes.merge_into(bucket, self.parts.state.master, self.published_chunk(bucket))

    def settle(self) -> None:
        """Make the CPU state final and consistent (wait for running work, drop unvalidated work)."""

    def take_back_speculation(self) -> None:
        """The window's gradients are dropped or replaced (``zero_grad``, a write to ``p.grad``): steps taken
        from them during backward are taken back. None are where no step runs during backward."""

    def sync(self) -> None:
        """Make the device parameters fully up to date (evaluation, end of training)."""

    def on_weights_loaded(self) -> None:
        """The master weights were replaced (and published): drop anything computed from the old ones."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume this schedule bitwise (plain tensors and numbers)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, after the weights and optimizer state are loaded."""

    def close(self) -> None:
        self.settle()

    def abandon(self) -> None:
        """After a failure: finish or drop running work, keep nothing pending, issue no collective."""
        with contextlib.suppress(Exception):  # the first failure is the one being reported
            self.settle()


def apply_now(parts: ScheduleParts[Update], inputs: StepInputs, stats: StepStats) -> None:
    """The synchronous step: clamp, plan, then update and publish every bucket."""
    clamp_if_asked(parts.grads, inputs)
    update_s, stats.copy_back_s = parts.update.update_now(inputs.has_grad, inputs.multiplier)
    stats.cpu_step_s += update_s
    stats.cpu_step_after_backward_s += update_s


def clamp_if_asked(grads: GradientSource, inputs: StepInputs) -> None:
    """Clip by value (where the step does) on the stored gradients, before anything reads them for the update."""
    if inputs.clamp_limit is not None:
        clamp_grads(grads, inputs.clamp_limit)


def clamp_grads(grads: GradientSource, limit: float) -> None:
    """Clip by value on the stored (loss-scaled) gradients of this window."""
    grads.for_each_grad_range(lambda g: g.clamp_(-limit, limit))
