"""The CPU state: this rank's shard of the optimizer state, and the only place steps are counted.

It owns the fp32 master weights, the two Adam moments, the fp32 gradient buffer(s) backward
accumulates into (none in place: there the gradients stay where autograd left them), and each
parameter's step count. Everything else reads these buffers through it: the gradient source
accumulates into :attr:`CpuState.grad`, the schedules' updates write the master and moments, the
publisher copies from the master, and engine/state.py gathers or loads them for checkpoints.

The delayed schedule keeps a second gradient buffer so that backward t+1 can fill one while the
update of step t reads the other; :meth:`CpuState.swap_grad` is the one place the buffers trade
roles, so there is a single owner of "the buffer backward fills now".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_zero_offload.engine.layout import Layout
from lightning_zero_offload.engine.memory import host_zeros


class CpuState:
    """This rank's fp32 master, moments, gradient buffer and per-parameter step counts."""

    def __init__(self, layout: Layout, group_of: list[int], keeps_grad: bool) -> None:
        shard = layout.shard_numel
        self.layout = layout
        self.group_of = group_of  # param group of each trainable parameter, in optimizer order
        self.master = host_zeros(shard, torch.float32, False)  # model-sized: never pinned (see HostToDevice)
        self.exp_avg = host_zeros(shard, torch.float32, False)
        self.exp_avg_sq = host_zeros(shard, torch.float32, False)
        # The buffer backward accumulates into now (in place: gradients stay in the tensors autograd made).
        self.grad: torch.Tensor | None = host_zeros(shard, torch.float32, False) if keeps_grad else None
        self.steps = [0] * len(layout.slots)

    def count_steps(self, indices: Iterable[int]) -> None:
        """One optimizer step more for each of these parameters (those that got a gradient)."""
        for index in indices:
            self.steps[index] += 1

    def swap_grad(self, other: torch.Tensor) -> torch.Tensor:
        """Make ``other`` the buffer backward accumulates into; returns the one it replaces."""
        previous, self.grad = self.grad, other
        assert previous is not None, "in place there is no gradient buffer to swap"
        return previous

    def snapshot(self, window: slice, into: list[torch.Tensor]) -> None:
        """Copy the master and moments of ``window`` into ``into`` (three shard-sized buffers)."""
        for saved, buffer in zip(into, (self.master, self.exp_avg, self.exp_avg_sq)):
            saved[window].copy_(buffer[window])

    def restore(self, window: slice, saved: list[torch.Tensor]) -> None:
        """Undo everything since :meth:`snapshot` of ``window`` (bitwise)."""
        for kept, buffer in zip(saved, (self.master, self.exp_avg, self.exp_avg_sq)):
            buffer[window].copy_(kept[window])

    def param_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per-parameter views of (master, exp_avg, exp_avg_sq): one rank holds every parameter whole."""
        ranges = [self.layout.slot_range(index) for index in range(len(self.layout.slots))]
        master, exp_avg, exp_avg_sq = (
            [buffer[r] for r in ranges] for buffer in (self.master, self.exp_avg, self.exp_avg_sq)
        )
        return master, exp_avg, exp_avg_sq


class ParkedState:
    """Moments and step counts of parameters that left the trainable set, kept should they return.

    Survives re-planning (a new :class:`CpuState` is built for the new layout); keyed by parameter id.
    """

    def __init__(self) -> None:
        self._parked: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def park(
        self,
        params: list[torch.nn.Parameter],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[int],
    ) -> None:
        for p, exp_avg, exp_avg_sq, step in zip(params, exp_avgs, exp_avg_sqs, steps):
            self._parked[id(p)] = (exp_avg.clone(), exp_avg_sq.clone(), step)

    def unpark(self, params: list[torch.nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """(exp_avgs, exp_avg_sqs, steps) for ``params``: the parked ones, zeros and 0 for new ones."""
        moments = [self._parked.pop(id(p), None) for p in params]
        zeros = [torch.zeros(p.shape) for p in params]
        exp_avgs = [m[0] if m else z for m, z in zip(moments, zeros)]
        exp_avg_sqs = [m[1] if m else z for m, z in zip(moments, zeros)]
        return exp_avgs, exp_avg_sqs, [m[2] if m else 0 for m in moments]
