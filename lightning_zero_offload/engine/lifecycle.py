"""The engine's life around the training step: views of its parts, the trainable set, state in and
out, teardown and the failure path.

:class:`EngineLifecycle` is a base of :class:`~lightning_zero_offload.engine.engine.OffloadEngine`
(engine/engine.py keeps construction and the step); it holds no state of its own. Every method here
settles the schedule first where it reads or replaces the CPU state, so what it sees is final.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from lightning_zero_offload.engine import state_dicts
from lightning_zero_offload.engine.failures import NonFinitePolicy
from lightning_zero_offload.engine.infra.ledger import MemoryLedger
from lightning_zero_offload.engine.optimizer_support import check_optimizer
from lightning_zero_offload.engine.options import OffloadOptions, Resolved
from lightning_zero_offload.engine.scaler import DynamicLossScaler
from lightning_zero_offload.engine.schedules import Schedule
from lightning_zero_offload.engine.stats import StepStats
from lightning_zero_offload.engine.step import device_share
from lightning_zero_offload.engine.step.cpu_state import DEVICE_PART, STATE_NAMES, CpuState, ParkedState
from lightning_zero_offload.engine.step.gradient_source import GradientSource
from lightning_zero_offload.engine.step.layout import Layout
from lightning_zero_offload.engine.step.publisher import NullPublisher, Publisher
from lightning_zero_offload.engine.step.shard_buffer import ShardBuffer
from lightning_zero_offload.engine.window import CarriedGradients

LIVE_ENGINES: weakref.WeakSet[EngineLifecycle] = weakref.WeakSet()  # every engine built, for engine_training


def engine_training(param: torch.Tensor) -> EngineLifecycle | None:
    """The open engine that trains ``param`` (its master weights are the engine's), or None."""
    return next((e for e in LIVE_ENGINES if not e.closed and id(param) in e._param_index), None)


class EngineLifecycle:
    """Re-planning, checkpoints' state, teardown: what the engine does besides the step."""

    # Built by OffloadEngine.__init__/_build.
    optimizer: torch.optim.Optimizer
    device: torch.device
    params: list[torch.nn.Parameter]
    _param_index: dict[int, int]  # id of a parameter -> its index in params
    layout: Layout
    state: CpuState
    grads: GradientSource
    publisher: Publisher | NullPublisher
    schedule: Schedule
    scaler: DynamicLossScaler | None
    nonfinite: NonFinitePolicy
    ledger: MemoryLedger
    step_calls: int
    skipped_steps: int
    steps_taken: int
    failed: bool
    _closed: bool
    _signature: tuple[tuple[int, bool], ...]
    parked: ParkedState
    weights_on_device: bool
    _carried: CarriedGradients | None
    _original_dtypes: list[torch.dtype]
    _rounding_seed: int
    options: OffloadOptions
    resolved: Resolved
    in_place: bool
    cpu_step: str
    last: StepStats
    share_choice: device_share.ShareChoice | None  # device_share="auto": what it chose after a measured step, and why
    share_floor: device_share.ShareChoice | None  # device_share="auto": the share the host needs, taken at construction

    # OffloadEngine's, used here: _build (lay out and build the parts), _grow_share, sync, absorb_param_writes.

    def wait_publish(self) -> None:
        """Wait for the copies to the device that read host memory about to change."""
        self.publisher.wait()

    def refresh_device_params(self) -> None:
        """Write the master weights (rounded to the device dtype) into the device parameters."""
        self.publisher.refresh(self.state.master)
        self.weights_on_device = True

    def full_tensors(self, shard: ShardBuffer | torch.Tensor) -> list[torch.Tensor]:
        """Full per-parameter tensors of a flat shard-sized buffer (a collective when sharded: state_dicts.py)."""
        return state_dicts.full_tensors(self, shard)

    # -- the CPU state (engine/step/cpu_state.py owns it; read-only views for readers of one rank's shard) --

    @property
    def master(self) -> ShardBuffer:
        """This rank's master weights (fp32, or bf16 with ``cpu_state="bf16"``), flat (owned by :attr:`state`; with a
        device share its last buckets lie on the device)."""
        return self.state.master

    @property
    def exp_avg(self) -> ShardBuffer:
        return self.state.exp_avg

    @property
    def exp_avg_sq(self) -> ShardBuffer:
        return self.state.exp_avg_sq

    @property
    def grad(self) -> ShardBuffer | None:
        """The buffer backward accumulates into now, in the state's dtype (None in place)."""
        return self.state.grad

    @property
    def steps(self) -> tuple[int, ...]:
        """Each trainable parameter's step count, as of now (the CPU state owns them: engine/step/cpu_state.py)."""
        return tuple(self.state.steps)

    # -- the trainable set ---------------------------------------------------------------------

    def trainable_signature(self) -> tuple[tuple[int, bool], ...]:
        """Which parameters each param group holds and which are trainable (cheap: ids and flags)."""
        return tuple(
            (id(p), p.requires_grad) if i else (-group_index - 1, True)  # a group boundary
            for group_index, group in enumerate(self.optimizer.param_groups)
            for i, p in enumerate([None, *group["params"]])
        )

    def replan_if_changed(self) -> bool:
        """Re-plan the layout if parameters became trainable or frozen, or param groups were added.

        Call before a forward (the front ends do, for every training step; ``begin_backward`` too). Every
        parameter that stays keeps its master weights, moments, step count and the window's gradient bitwise; one
        that comes starts from its current value with the moments it had (parked) or fresh ones, as torch's AdamW
        would. A pass over the whole state (one buffer at a time), and rare. Every rank re-plans at the same step,
        as every rank changes its trainable set alike.
        """
        if self._closed or self.failed or self.trainable_signature() == self._signature:
            return False
        check_optimizer(self.optimizer)
        self._replan()
        return True

    def take_device_share(self, share: float) -> None:
        """Re-plan with ``device_share=share`` (the ZeRO-2 mode: the last buckets, whole, within it, keep their
        state on the device); every parameter keeps its master weights, moments and step count bitwise."""
        if self.resolved.offload_params or self.in_place:
            raise ValueError("take_device_share re-plans the ZeRO-2 mode's offload data path only")
        grows, self.resolved = self.state.takes_more(share), replace(self.resolved, device_share=share)
        self._replan(in_place=grows)

    def choose_device_share(self) -> device_share.ShareChoice | None:
        """``device_share="auto"``: after this engine's second step not skipped (engine/step/device_share.py), choose
        from it and re-plan; the choice (None before). The device's peak counts from that step's last forward."""
        if self.options.device_share != "auto" or self.share_choice is not None:
            return self.share_choice
        if self.steps_taken < device_share.AUTO_MEASURED_STEP or self.last.skipped or self._closed or self.failed:
            if self.steps_taken == device_share.AUTO_MEASURED_STEP - 1:
                device_share.reset_peak_memory(self.device)
            return None
        speculative = self.cpu_step == "speculative"
        landings = None if self.in_place else self.grads.landings  # in place: no bucket lands (and a CPU device)
        self.share_choice = choice = device_share.auto_bucket_share(
            self.layout, self.state, self.last, speculative, self.device, landings, self.share_floor is not None
        )
        if self.state.takes_more(choice.share):  # never fewer: it starts from none, or from a short host's floor
            self.take_device_share(choice.share)
        return choice

    def _replan(self, in_place: bool = False) -> None:
        """Lay the state out again (``_build``), carrying every parameter's master, moments, step count and this
        window's gradient one buffer at a time (``in_place``: more buckets on the device, moved by ``_grow_share``)."""
        self.sync()  # an update in flight lands and is published
        # Nothing stays pending: the device holds the master (a delayed update's weights are of the old layout).
        self.schedule.on_weights_loaded()
        self._settle()  # writes to the parameters absorbed
        schedule_state = self.schedule.state_dict()
        old_params, has_grad, held = self.params, list(self.grads.has_grad), self.grads.held()
        fresh = self.grads.fresh_buckets() if in_place else None  # growing moves the gradient buffer whole, stale too
        self.schedule.close()
        self.grads.close()
        if in_place:
            self._grow_share(self.resolved.device_share)
        else:
            carried = self._carried  # what the last step did to the gradients it kept (torch's .grad), if kept
            self._build(state_dicts.Replaced(self.layout, self.state, old_params, self._original_dtypes, has_grad))
            self._carried = carried
            self.refresh_device_params()
        moved = [(self._param_index.get(id(p)), i) for i, p in enumerate(old_params)]
        self.grads.carry_window({j: (has_grad[i], held[i] if held else None) for j, i in moved if j is not None}, fresh)
        self.schedule.load_state_dict({"name": self.schedule.name, **schedule_state})

    # -- state in and out ----------------------------------------------------------------------

    def _settle(self) -> None:
        """Before reading or replacing the CPU state: nothing running, nothing unvalidated, copies done."""
        self.schedule.settle()
        self.wait_publish()
        self.absorb_param_writes()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs besides weights and moments to resume bitwise: the step count, the
        loss scaler and the schedule's state (plain tensors and numbers: ``weights_only`` loads)."""
        state: dict[str, Any] = {
            "step_calls": self.step_calls,
            "skipped_steps": self.skipped_steps,
            "nonfinite": self.nonfinite.state_dict(),  # a resumed run raises after the same skipped steps
            "schedule": {"name": self.schedule.name, **self.schedule.state_dict()},
            # bf16 state: the seed of its stochastic rounding, so a resumed run draws the same bits.
            "cpu_state": {"dtype": STATE_NAMES[self.state.dtype], "seed": self.state.seed},
        }
        if self.scaler is not None:
            state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after the weights and the optimizer state have been loaded).

        The schedule's state is restored if the checkpoint was written with the same schedule. From
        another one, a pending delayed update is simply applied: the device already holds the master.
        """
        self._settle()
        self.step_calls = int(state.get("step_calls", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.nonfinite.load_state_dict(state.get("nonfinite", {}))
        if state.get("loss_scaler") is not None and self.scaler is not None:
            self.scaler.load_state_dict(state["loss_scaler"])
        schedule = state.get("schedule") or {}
        if schedule.get("name") == self.schedule.name:
            self.schedule.load_state_dict(schedule)
        saved_state = state.get("cpu_state") or {"dtype": "fp32"}
        if self.state.compact and saved_state["dtype"] == "bf16":
            self.state.seed = self._rounding_seed = int(saved_state["seed"])

    def master_params(self) -> list[torch.Tensor]:
        """Full master weights, one tensor per trainable parameter, in the state's dtype (fp32, or bf16 with
        ``cpu_state="bf16"``; collective when sharded)."""
        self._settle()
        return state_dicts.full_tensors(self, self.master)

    def load_master_params(self, tensors: list[torch.Tensor]) -> None:
        for p, t in zip(self.params, tensors):
            if t.shape != p.shape:
                raise ValueError(f"master weight of shape {tuple(t.shape)} does not fit parameter {tuple(p.shape)}")
        self._settle()
        state_dicts.load_shard(self.layout, self.master, list(tensors))  # converted segment by segment: no full copy
        self.master_loaded()

    @contextmanager
    def writing_master(self) -> Iterator[Callable[[torch.nn.Parameter, torch.Tensor], bool]]:
        """Inside: :meth:`load_master_param`, parameter by parameter (the step in flight finished first); on
        leaving, the device copy and the schedule follow (:meth:`master_loaded`)."""
        self._settle()
        try:
            yield self.load_master_param
        finally:  # a load that failed part-way: the device copy still shows the master as it now is
            self.master_loaded()

    def load_master_param(self, param: torch.nn.Parameter, value: torch.Tensor) -> bool:
        """``value``, the whole tensor, into this rank's rows of ``param``'s master weight (converted to the
        state's dtype); False for a parameter the engine does not train. Inside :meth:`writing_master`."""
        index = self._param_index.get(id(param))
        if index is None:
            return False
        if value.shape != param.shape:
            raise ValueError(f"a value of shape {tuple(value.shape)} for a parameter of shape {tuple(param.shape)}")
        state_dicts.load_param_shard(self.layout, self.master, index, value)
        return True

    def master_loaded(self) -> None:
        """After master weights were written: the device copy takes their values, and the schedule drops what it
        computed from the old ones."""
        self.refresh_device_params()
        self.schedule.on_weights_loaded()

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer state in ``torch.optim.AdamW``'s format (full tensors, collective when sharded)."""
        self._settle()
        return state_dicts.optimizer_state_dict(self)

    def param_groups_state(self) -> list[dict[str, Any]]:
        """The optimizer's hyperparameters, numbered as in ``torch.optim.Optimizer.state_dict``."""
        return state_dicts.param_groups_state(self)

    def shard_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's flat master and moments (in the state's dtype), as stored in a sharded checkpoint: views,
        not copies (a caller that keeps them past the next step clones them)."""
        self.refuse_after_failure("sharded checkpoint")
        self._settle()
        # Each part as it is: the device share's on the device (the sharded writer copies it to the host when it
        # reaches it, one buffer's part at a time: checkpoints/writer.py's DeviceTensors).
        buffers = {name: getattr(self.state, name) for name in ("master", "exp_avg", "exp_avg_sq")}
        tensors = {name: buffer.host for name, buffer in buffers.items()}
        return tensors | {name + DEVICE_PART: b.device_part for name, b in buffers.items() if b.device_part.numel()}

    def load_optimizer_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state in torch Adam/AdamW format (from this engine, torch, or CPUAdam), numbered by the param
        groups as they are now (laid out again first if they changed: a finetuning callback restored its groups)."""
        self.replan_if_changed()
        self._settle()
        state_dicts.load_optimizer_state_dict(self, state_dict)

    def moment_view(self, index: int, name: str) -> torch.Tensor:
        """A trainable parameter's ``exp_avg`` or ``exp_avg_sq``, a live view in its shape (``optimizer.state``)."""
        self._settle_one_rank("no rank holds a parameter's moments whole")
        return self.state.moment_view(index, name)

    def set_moment(self, index: int, name: str, value: torch.Tensor) -> None:
        self._settle_one_rank("set moments through load_state_dict")
        self.state.set_moment(index, name, value)

    def set_param_step(self, index: int, step: int) -> None:
        """Set a parameter's step count; 0 also zeroes its moments (torch's fresh state for that parameter)."""
        self._settle_one_rank("set step counts through load_state_dict")
        self.state.set_step(index, step)

    def _settle_one_rank(self, fix: str) -> None:
        """Before ``optimizer.state`` reads or changes a parameter's state: one rank, where every parameter is
        whole, and nothing in flight changes it after."""
        if self.layout.world_size != 1:
            raise RuntimeError(f"the moments are sharded across ranks: {fix}")
        self._settle()

    # -- accounting and teardown ---------------------------------------------------------------

    def memory_report(self) -> dict[str, int]:
        """Bytes held by the engine, as recorded where each buffer was allocated (see ledger.MemoryLedger), and
        ``device_share_params``: the trainable parameters whose state is on the device."""
        return {
            **self.ledger.report(sum(p.numel() for p in self.params)),
            "device_share_params": self.state.device_share_numel,
        }

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, after_failure: bool = False) -> None:
        """Detach from the module and hand the parameters back as CPU tensors holding the master weights.

        Each parameter gets its original dtype back, so a module that came in fp32 leaves with the exact
        fp32 trained weights, not their low-precision device copy. The CPU optimizer state is kept, so
        the optimizer state can still be saved after training (as with a plain torch optimizer).
        ``after_failure``: issue no collective (the other ranks may be gone); see ``_close_after_failure``.
        """
        if self._closed:
            return
        if after_failure:
            self._close_after_failure()
            return
        self._settle()
        self.schedule.close()
        self.update_worker.shutdown(wait=True)
        self.grads.close()
        for p, weight, dtype in zip(self.params, self.master_params(), self._original_dtypes):
            p.data = weight.to(dtype)
        self.publisher.drop()
        self._closed = True

    def _close_after_failure(self) -> None:
        """Detach from the module after an exception, issuing no collective and never blocking on a peer.

        What the module's parameters hold afterwards (each in its original dtype, on the device):

        - one process: the master weights (as after a normal close; they are complete on this rank);
        - several ranks: this rank's device copy of the parameters (the low-precision values the last
          forward used, upcast), because the full master weights are spread over the ranks and gathering
          them needs peers that may be gone. The engine keeps only this rank's shard of the optimizer
          state; asking it for the full state raises instead of hanging (:meth:`refuse_after_failure`).
          Failed inside a re-plan, between freeing the old device copy and filling the new one, there are none:
          the parameters are empty (0 elements), so nothing computes with or saves weights that are not there.

        A failure inside the optimizer step itself can leave some buckets updated and others not; resume
        from the last checkpoint rather than saving these weights as a training checkpoint.
        """
        # Stop the worker threads first: they are not daemons, so one left waiting for a buffer that the
        # failed main thread will never return would keep the process from exiting (and its peers waiting).
        self.update_worker.shutdown(wait=False, cancel_futures=True)
        self.publisher.release_waiters()  # unblock an update waiting for a free buffer
        self.update_worker.shutdown(wait=True)
        self.grads.close()
        self.schedule.abandon()  # host-side only: a running update finishes, unvalidated work is dropped
        single = self.layout.world_size == 1
        with torch.no_grad():
            if single:
                masters = state_dicts.full_tensors(self, self.master)  # one rank: no collective involved
            for index, (p, dtype) in enumerate(zip(self.params, self._original_dtypes)):
                kept = masters[index] if single else p.detach() if self.weights_on_device else p.new_empty(0)
                p.data = kept.to(dtype, copy=not single)  # one rank: the masters are copies already
        self.publisher.drop()
        self.failed = True
        self._closed = True

    def refuse_after_failure(self, what: str) -> None:
        """Raise instead of gathering ``what`` from peers that a failure may have taken down."""
        if self.failed and self.layout.world_size > 1:
            raise RuntimeError(
                f"Cannot assemble the {what}: training failed and the engine was closed without gathering it "
                "from the other ranks (they may be gone). Resume from the last checkpoint instead."
            )
