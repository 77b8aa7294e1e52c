"""Where a step's gradients come from: the protocol the engine and the schedules drive backward through.

Two sources implement it:

- :class:`~lightning_zero_offload.engine.step.streamer.GradientStreamer` (the offload path): hooks copy each
  bucket of gradients off the device, [reduce-scatter them], and add them in fp32 into the CPU state's
  gradient buffer;
- :class:`~lightning_zero_offload.engine.step.in_place.InPlaceGradients` (nothing to offload): each gradient
  stays the tensor autograd made, and the step reads it there.

The engine never asks which one it holds (in place, the update itself may check the gradients for
inf/nan: engine/step/in_place.py's ``InPlaceUpdate.can_check_in_update``). News that a bucket's gradient has
landed in the CPU buffer flows one way, through the :class:`BucketArrivals` the engine gives the source
when it builds it (the speculative schedule listens there).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from lightning_zero_offload.engine.infra.collectives import all_reduce_sum
from lightning_zero_offload.engine.step.layout import Bucket

# Heard on the gradient worker as a bucket's gradient lands in the CPU buffer: (bucket, final: the bucket's
# last launch of this backward pass, any inf/nan in the bucket's gradient of the window).
BucketListener = Callable[[Bucket, bool, bool], None]


class BucketArrivals:
    """Where the gradient source reports each bucket whose gradient has landed, for one listener.

    Made by the engine before the parts that use it, and given to both: the gradient source reports
    (:meth:`report`), a schedule that acts on buckets as they land listens (:meth:`listen`).
    """

    def __init__(self) -> None:
        self._listener: BucketListener | None = None

    def listen(self, listener: BucketListener) -> None:
        if self._listener is not None:
            raise RuntimeError("a listener already hears these bucket arrivals")
        self._listener = listener

    def report(self, bucket: Bucket, final: bool, nonfinite: bool) -> None:
        if self._listener is not None:
            self._listener(bucket, final, nonfinite)


class GradientSource(Protocol):
    """One accumulation window's gradients, from the first backward after a step to the next step."""

    has_grad: list[bool]  # per trainable parameter: it got a gradient in this window (on this rank)

    def begin(self) -> None:
        """A backward pass starts."""

    def finish_backward(self) -> bool:
        """End the backward pass if one is open (:meth:`begin` was called or a gradient arrived since the last
        end): every gradient it produced is then in place for the step. Returns whether one was open; either
        way raises the error of work that failed in the background."""

    def wait(self) -> None:
        """Wait for background work on gradients that have arrived."""

    def take_timings(self) -> tuple[float, float]:
        """(seconds waited for transfers, seconds of transfer) since last asked."""

    def local_summary(self) -> tuple[float, bool]:
        """(sum of squares, any inf/nan) of this rank's gradients of the window."""

    def held(self) -> list[torch.Tensor | None] | None:
        """Each parameter's gradient as a tensor of its own, where the source holds them so (in place); None
        where they lie in the CPU state's flat gradient buffer."""

    def for_each_grad_range(self, fn: Callable[[torch.Tensor], None]) -> None:
        """Call ``fn`` on every stored gradient range of the window, in place."""

    def expect_clipping(self, clips: bool) -> None:
        """Whether the next window's step is expected to clip (as this one): it then needs the gradients'
        sums before its update, so they are taken as the gradients arrive."""

    def new_window(self) -> None:
        """``zero_grad()``: drop every gradient (a step keeps them, as torch keeps ``.grad``)."""

    def zero_window(self) -> None:
        """``zero_grad(set_to_none=False)``: every gradient that exists becomes zero; ``has_grad`` stays."""

    def set_gradients(self, values: dict[int, torch.Tensor | None]) -> None:
        """Replace some parameters' gradients (whole fp32 tensors, loss-scaled; None drops one)."""

    def refresh_sums(self) -> None:
        """The stored gradients were changed in place: :meth:`local_summary` must sum them again."""

    def fresh_buckets(self) -> list[bool] | None:
        """Per bucket of the state's gradient buffer, whether no gradient of this window was written there yet (None
        where gradients are tensors of their own)."""

    def carry_window(self, carried: dict[int, tuple[bool, torch.Tensor | None]], fresh: list[bool] | None) -> None:
        """After a re-plan (this source new): the window's gradients so far, per trainable parameter whether it has
        one and the tensor where the old source held them so (else they are in the state's gradient buffer, which
        the re-plan carried: only those, or, ``fresh`` given, the whole buffer moved, those buckets stale)."""

    def close(self) -> None:
        """Remove the hooks and release what the source holds."""


def global_summary(
    source: GradientSource, world: int, process_group: dist.ProcessGroup | None, device: torch.device
) -> tuple[float, bool, list[bool]]:
    """(sum of squares, overflow, has_grad per parameter) of the window over all ranks: one all-reduce."""
    sumsq, overflow = source.local_summary()
    has_grad = list(source.has_grad)
    if world > 1:
        summary = torch.tensor([sumsq, float(overflow), *map(float, has_grad)], dtype=torch.float64)
        summary = all_reduce_sum(summary, process_group, device)
        sumsq, overflow = float(summary[0]), bool(summary[1] > 0)
        has_grad = (summary[2:] > 0).tolist()
    overflow = overflow or not math.isfinite(sumsq)
    return sumsq, overflow, has_grad


def check_gradient(grad: torch.Tensor, seen: bool) -> None:
    """Refuse what neither data path can take: sparse gradients, and a gradient twice in one pass."""
    if grad.is_sparse:
        raise RuntimeError("zero_offload does not support sparse gradients (nn.Embedding(sparse=True))")
    if seen:
        raise RuntimeError(
            "A parameter received its gradient twice in one backward pass. This happens with reentrant "
            "activation checkpointing when a parameter is used inside and outside the checkpointed region: "
            "use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
        )


def register_grad_hooks(
    params: list[torch.nn.Parameter], on_grad: Callable[[int, torch.Tensor], None]
) -> list[torch.utils.hooks.RemovableHandle]:
    """Call ``on_grad(index, param)`` once each parameter's gradient of a backward pass is accumulated (none for
    a parameter frozen in the middle of a window, which gets no more)."""
    return [
        p.register_post_accumulate_grad_hook(functools.partial(_call_with_index, on_grad, i))
        for i, p in enumerate(params)
        if p.requires_grad
    ]


def _call_with_index(on_grad: Callable[[int, torch.Tensor], None], index: int, param: torch.Tensor) -> None:
    on_grad(index, param)
