"""``cpu_step="speculative"`` with parameters offloaded: each shard's CPU step starts when FSDP2 hands over
its reduced gradient, during backward, and is validated after it.

FSDP2 calls a sharded parameter's post-accumulate-grad hooks right after it assigned the parameter's
reduced gradient shard on the host (``foreach_reduce``; docs/design/offload-params-spike.md, section 2):
that is where the step of the shard is started, with the loss scale and no clip factor, on the update worker
(``overlap``) or in the hook itself. Before it runs, the shard's master and moments are copied aside (the
snapshot), and the gradient's sum of squares is kept for the global norm. After backward,
``ParamOffloadEngine.step`` validates: where clipping fires, a gradient is inf/nan, the hyperparameters
changed or user code changed the gradient, the shard is restored from its snapshot (bitwise) and stepped
again synchronously; otherwise the speculated step stands, bitwise what ``cpu_step="sync"`` computes.

Only a backward announced to end an accumulation window is speculated (``arm``), and only when nothing
reads or writes the parameters between that backward and the step: the sharded parameter is the master,
so a speculated step is visible in the parameters at once (``arm`` is not called otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.offload_params.shards import ShardSlot


class Speculation:
    """Speculated shard steps of one backward: which ran, the gradient sums they saw, taking them back.

    ``step_shard(slot, grad, hparams, grad_scale)`` is the engine's one-shard Adam step, shared with the
    synchronous path so that both give the same bits.
    """

    def __init__(
        self,
        step_shard: Callable[[ShardSlot, torch.Tensor, kernels.AdamArgs, float], None],
        worker: ThreadPoolExecutor | None,
        num_threads: int,
    ) -> None:
        self._step_shard = step_shard
        self._worker = worker
        self._num_threads = num_threads
        self._armed: Mapping[ShardSlot, kernels.AdamArgs] | None = None
        self._grad_scale = 1.0
        self._futures: list[Future[None]] = []
        self.sums: dict[ShardSlot, float] = {}  # the speculated shards' gradient sums of squares
        self.hparams: dict[ShardSlot, kernels.AdamArgs] = {}  # what each speculated step ran with
        self._fingerprints: dict[ShardSlot, torch.Tensor] = {}
        self.rollbacks = 0
        self.cpu_step_s = 0.0  # time of the speculated steps (and snapshots) since the last take()

    def arm(self, hparams: Mapping[ShardSlot, kernels.AdamArgs], grad_scale: float) -> None:
        """The coming backward ends the window: speculate the shards in ``hparams`` as their gradients land."""
        self._armed, self._grad_scale = hparams, grad_scale

    def on_gradient(self, slot: ShardSlot) -> None:
        """FSDP2 assigned ``slot``'s reduced gradient shard (its post-accumulate-grad hook)."""
        if self._armed is None or (hparams := self._armed.get(slot)) is None:
            return
        grad = slot.grad
        assert grad is not None, "FSDP2 calls the hook after assigning the gradient"
        if self._worker is None:
            self._speculate(slot, grad, hparams)
        else:
            self._futures.append(self._worker.submit(self._speculate, slot, grad, hparams))

    def _speculate(self, slot: ShardSlot, grad: torch.Tensor, hparams: kernels.AdamArgs) -> None:
        if slot in self.sums:  # a second gradient for it in one backward: its first step is void
            slot.restore()
            del self.sums[slot], self.hparams[slot]
            return
        sumsq, nonfinite = kernels.sum_of_squares(grad, num_threads=self._num_threads)
        if nonfinite:
            return  # the step is skipped after backward anyway
        start = time.perf_counter()
        slot.snapshot()
        self._step_shard(slot, grad, hparams, self._grad_scale)
        self.cpu_step_s += time.perf_counter() - start
        self.sums[slot], self.hparams[slot] = sumsq, hparams

    def finish_backward(self) -> None:
        """Wait for the speculated steps of this backward (raising a failure of one); disarm."""
        self._armed = None
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()

    def take(self) -> tuple[dict[ShardSlot, float], dict[ShardSlot, kernels.AdamArgs]]:
        """The speculated shards (their sums and hyperparameters), handed to the step, which settles them."""
        sums, hparams = self.sums, self.hparams
        self.sums, self.hparams, self._fingerprints = {}, {}, {}
        return sums, hparams

    def take_seconds(self) -> float:
        """The CPU step time spent speculating since the last call."""
        spent, self.cpu_step_s = self.cpu_step_s, 0.0
        return spent

    def take_back(self, slots: list[ShardSlot] | None = None) -> None:
        """Restore ``slots`` (all speculated shards when None) to their state before their speculated step."""
        chosen = list(self.sums) if slots is None else slots
        for slot in chosen:
            slot.restore()
            self.sums.pop(slot, None)
            self.hparams.pop(slot, None)
            self._fingerprints.pop(slot, None)
        self.rollbacks += bool(chosen)

    def before_user_code(self) -> None:
        """User code may now read and change ``p.grad``: remember what each speculated step saw."""
        for slot in self.sums:
            grad = slot.grad
            assert grad is not None
            self._fingerprints[slot] = kernels.fingerprint16(_words(grad), num_threads=self._num_threads)

    def after_user_code(self) -> None:
        """Take back the speculated steps whose gradient user code changed (or dropped)."""
        changed = [
            slot
            for slot, seen in self._fingerprints.items()
            if (grad := slot.grad) is None
            or not torch.equal(kernels.fingerprint16(_words(grad), num_threads=self._num_threads), seen)
        ]
        self._fingerprints = {}
        if changed:
            self.take_back(changed)


def _words(grad: torch.Tensor) -> torch.Tensor:
    """The gradient's bits as 16-bit words (fingerprint16's input)."""
    return grad.reshape(-1).view(torch.int16)
