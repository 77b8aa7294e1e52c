"""When forward/backward run on the CPU in fp32 there is nothing to offload: train where the data lies.

With one process and the synchronous step, the device parameters can *be* the fp32 master weights
(views into the engine's master buffer) and each gradient can stay where autograd left it. The offload
data path (engine/step/streamer.py, engine/step/update.py) would copy every gradient into a device bucket, then into
a host staging buffer, add it into an fp32 buffer, and copy every updated weight back: about 60 bytes
of memory traffic per parameter and step against a plain fused AdamW's 28, all of it cost when "device"
and host are the same memory (docs/benchmarks.md, "CPU device, default settings").

Here the engine keeps only what it needs of a gradient stream: each parameter's gradient until the
step (the tensor autograd made, as plain training keeps it in ``.grad``), its sum of squares and inf/nan
flag, and accumulation over micro-batches (added in place into the first micro-batch's gradient, in
fp32, as the offload path does). The step (below) is one native Adam call per param group
over those tensors, with the kernels seeing exactly the numbers the offload path gives them: results
are bitwise equal. The sum of squares costs a pass over the gradients only when the step needs the
norm before it runs (clipping, which plain training pays for too); otherwise the step's kernel sums
each chunk of gradients as it reads it (``kernels.adam_step_multi_if_finite``), and a step with an
inf/nan gradient is taken back (to within about one fp32 ulp) instead of never starting.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.step.gradient_source import check_gradient, register_grad_hooks
from lightning_zero_offload.engine.step.update import CpuUpdate

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.cpu_state import CpuState


class InPlaceGradients:
    """Holds each parameter's gradient for the step; the in-place counterpart of ``GradientStreamer``."""

    def __init__(self, params: list[torch.nn.Parameter], num_threads: int) -> None:
        self.params = params
        self.num_threads = num_threads
        n = len(params)
        self.grads: list[torch.Tensor | None] = [None] * n
        self.has_grad = [False] * n
        self._sumsq = [0.0] * n
        self._nonfinite = [False] * n
        self._summed = [False] * n
        self._seen = [False] * n
        self._open = False  # a backward pass began or produced gradients and was not finished yet
        # Sum each gradient as it arrives (the last step clipped, so the next one needs the norm first);
        # otherwise leave it to the step's kernel. Either way local_summary() can sum what is missing.
        self.eager_sums = True
        self._hooks = register_grad_hooks(params, self._on_grad)

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        check_gradient(grad, self._seen[index])
        self._seen[index] = True
        self._open = True
        # Taken out of .grad, as the offload path does: the next micro-batch's gradient then arrives as a
        # fresh tensor instead of being added into this one by autograd (a second pass over memory).
        param.grad = None
        held = self.grads[index]
        if held is None:
            # Autograd hands over a tensor nobody else holds (it clones one that is shared), so it is ours.
            held = grad if grad.dtype == torch.float32 and grad.is_contiguous() else grad.float().contiguous()
            self.grads[index] = held
            self._summed[index] = False
            if self.eager_sums:
                self._sum(index)
        else:
            source = grad.contiguous().view(-1)
            sumsq, nonfinite = kernels.grad_accumulate(held.view(-1), source, num_threads=self.num_threads)
            self._sumsq[index], self._nonfinite[index], self._summed[index] = sumsq, nonfinite, True
        self.has_grad[index] = True

    def _sum(self, index: int) -> None:
        self._sumsq[index], self._nonfinite[index] = kernels.sum_of_squares(
            self.grads[index], num_threads=self.num_threads
        )
        self._summed[index] = True

    # -- the GradientSource protocol (engine/step/gradient_source.py) --------------------------------

    def begin(self) -> None:
        """A backward pass starts (nothing to prepare: gradients are taken as they come)."""
        self._open = True

    def finish_backward(self) -> bool:
        """End the open backward pass, if any (each gradient is in place as it arrives: nothing to wait for)."""
        was_open, self._open = self._open, False
        self._seen = [False] * len(self.params)
        return was_open

    def wait(self) -> None:
        """Nothing runs in the background."""

    def take_timings(self) -> tuple[float, float]:
        return 0.0, 0.0  # no transfer

    @property
    def sums_pending(self) -> bool:
        """Some gradient of this window has not been summed yet (it will be by the step's kernel)."""
        return any(grad is not None and not summed for grad, summed in zip(self.grads, self._summed))

    def local_summary(self) -> tuple[float, bool]:
        """(sum of squares, any inf/nan) of this window's gradients, summing those not summed yet."""
        for index, grad in enumerate(self.grads):
            if grad is not None and not self._summed[index]:
                self._sum(index)
        return sum(self._sumsq), any(self._nonfinite)

    def expect_clipping(self, clips: bool) -> None:
        """Sum the next window's gradients as they arrive only if its step needs the norm first (it clips)."""
        self.eager_sums = clips

    def for_each_grad_range(self, fn: Callable[[torch.Tensor], None]) -> None:
        for grad in self.grads:
            if grad is not None:
                fn(grad)

    def new_window(self) -> None:
        """``zero_grad()``: drop the gradients."""
        n = len(self.params)
        self.grads = [None] * n
        self.has_grad = [False] * n
        self._sumsq = [0.0] * n
        self._nonfinite = [False] * n
        self._summed = [False] * n

    def zero_window(self) -> None:
        """``zero_grad(set_to_none=False)``: every gradient held is zero (``has_grad`` stays)."""
        for index, grad in enumerate(self.grads):
            if grad is not None:
                grad.zero_()
                self._sumsq[index], self._nonfinite[index], self._summed[index] = 0.0, False, True

    def held(self) -> list[torch.Tensor | None]:
        """The gradients the step will read, as they are (changes to them are the step's input)."""
        return list(self.grads)

    def set_gradients(self, values: dict[int, torch.Tensor | None]) -> None:
        """Replace held gradients (fp32, already scaled) with copies of ``values``; None drops one."""
        for index, value in values.items():
            held = self.grads[index]
            if value is not None and held is not None and value.data_ptr() == held.data_ptr():
                self._summed[index] = False  # the held tensor itself, changed in place
                continue
            self.grads[index] = None if value is None else value.reshape(self.params[index].shape).clone()
            self.has_grad[index] = value is not None
            self._summed[index] = False

    def refresh_sums(self) -> None:
        """The held gradients were changed in place: their sums are taken again when next needed."""
        self._summed = [False] * len(self.params)

    def fresh_buckets(self) -> None:
        """None: no buckets (each gradient is a tensor of its own)."""
        return None

    def carry_window(self, carried: dict[int, tuple[bool, torch.Tensor | None]], fresh: None = None) -> None:
        """After a re-plan: hold the gradients the old source held (its own tensors: no copy)."""
        for index, (has_grad, grad) in carried.items():
            self.grads[index], self.has_grad[index], self._summed[index] = grad, has_grad, False

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.new_window()


# -- the in-place step (the engine's update when its gradient source is InPlaceGradients) -------


class InPlaceUpdate(CpuUpdate):
    """The in-place step: one native Adam call per param group over the gradients autograd left.

    Per parameter, the kernel sees what the offload path's plan would give it: the group's
    hyperparameters, the parameter's own step number and the clip x unscale multiplier.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group_of: list[int],
        state: CpuState,
        grads: InPlaceGradients,
        num_threads: int,
    ) -> None:
        super().__init__(optimizer, group_of, state, num_threads)
        self.grads = grads
        # Per-parameter views of master and moments (fixed: the buffers are never replaced).
        self.param_views = state.param_views()

    def calls(self) -> dict[int, tuple[list[torch.Tensor], ...]]:
        """The step's kernel arguments per param group: (params, grads, exp_avgs, exp_avg_sqs, indices),
        for every parameter that got a gradient; its step number is ``state.steps[i] + 1``."""
        calls: dict[int, tuple[list[torch.Tensor], ...]] = {}
        masters, exp_avgs, exp_avg_sqs = self.param_views
        for index, grad in enumerate(self.grads.grads):
            if grad is None:  # no gradient this step: torch leaves the parameter alone
                continue
            p, g, m, v, indices = calls.setdefault(self.group_of[index], ([], [], [], [], []))
            p.append(masters[index])
            g.append(grad.view(-1))
            m.append(exp_avgs[index])
            v.append(exp_avg_sqs[index])
            indices.append(index)
        return calls

    def update_now(self, has_grad: list[bool], multiplier: float) -> tuple[float, float]:
        """The step (every parameter's gradient is where autograd left it); returns (update seconds, 0):
        nothing is published, the parameters are the master."""
        hparams = self.hyperparams()
        t = time.perf_counter()
        for group, (p, g, m, v, indices) in self.calls().items():
            steps = [self.state.steps[i] + 1 for i in indices]
            kernels.adam_step_multi(
                p, g, m, v, steps, hparams=hparams[group], grad_scale=multiplier, num_threads=self.num_threads
            )
            self.state.count_steps(indices)
        return time.perf_counter() - t, 0.0

    def can_check_in_update(self, clips: bool) -> bool:
        """Whether the step's kernel may sum the gradients and check them for inf/nan as it reads them
        (:meth:`update_checked`), undoing the update on inf/nan: only without clipping (which needs the norm
        first), with gradients not summed yet, and where every param group's update can be undone."""
        return not clips and self.grads.sums_pending and all(kernels.can_undo(hp) for hp in self.hyperparams())

    def update_checked(self) -> tuple[bool, float, float]:
        """The step without clipping, with the norm and inf/nan check inside the update; returns
        (applied, sum of squares of the gradients, seconds).

        The gradients were not read since backward (``InPlaceGradients.eager_sums``): a separate pass for
        their norm would cost 4 of the step's 28 bytes per parameter. If one holds inf/nan, every group
        already updated is taken back (to within about one fp32 ulp) and nothing counts as a step.
        """
        hparams = self.hyperparams()
        t = time.perf_counter()
        done: list[tuple[int, tuple[list[torch.Tensor], ...]]] = []
        sumsq = 0.0
        for group, call in self.calls().items():
            p, g, m, v, indices = call
            steps = [self.state.steps[i] + 1 for i in indices]
            group_sumsq, applied = kernels.adam_step_multi_if_finite(
                p, g, m, v, steps, hparams=hparams[group], num_threads=self.num_threads
            )
            if not applied:
                for earlier, applied_call in done:
                    for param, grad, exp_avg, exp_avg_sq, index in zip(*applied_call):
                        kernels.adam_undo(
                            param,
                            grad,
                            exp_avg,
                            exp_avg_sq,
                            hparams=hparams[earlier],
                            step=self.state.steps[index] + 1,
                            num_threads=self.num_threads,
                        )
                return False, math.inf, time.perf_counter() - t
            sumsq += group_sumsq
            done.append((group, call))
        self.state.count_steps(i for _, (*_, indices) in done for i in indices)
        return True, sumsq, time.perf_counter() - t
