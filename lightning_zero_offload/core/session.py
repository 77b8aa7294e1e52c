"""What both front ends do, written once: one module and its optimizer trained by the offload engine.

Plain torch and the engine; no Trainer and no Fabric. The session is the one door to the engine: the
Trainer strategy (``trainer/strategy.py`` with ``trainer/precision.py`` and ``trainer/callbacks.py``) and
the Fabric strategy (``fabric/strategy.py``) translate Lightning's hooks into calls on an
:class:`OffloadSession` and read what the engine did through it, as Lightning's own
``pytorch/strategies/fsdp.py`` imports its helpers from ``fabric/strategies/fsdp.py``; users reach it
through the strategies (:class:`SessionStrategy`):

- setup: :func:`move_untrained_to`, then :meth:`OffloadSession.start` (model checks, host-memory
  pre-flight, the engine);
- training: re-planning before a training forward, the loss scale, the announced step, the pending clip,
  the step, ``zero_grad``, bringing the device parameters up to date before evaluation;
- what the engine is and did: its resolved options, the last step's statistics, step counts, memory;
- checkpoints (``core/session_checkpoints.py``): the master-weight state dict, the optimizer and engine
  state to save and load, the full save (streamed to rank 0 at several ranks), the sharded save;
- the end: :meth:`OffloadSession.close`.

Around it: the optimizer for a loop that calls ``step()`` itself (``core/optimizer.py``), the end of a
run after a failure or at exit (``core/teardown.py``) and Fabric's checkpoint layout
(``fabric/checkpoints.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_zero_offload.checkpoints import ENGINE_STATE_KEY
from lightning_zero_offload.core.gradients import GradientView
from lightning_zero_offload.core.model_rules import check_model
from lightning_zero_offload.core.options import STRATEGY_DESCRIPTION, resolve_precision
from lightning_zero_offload.core.session_base import EngineSession, the_optimizer
from lightning_zero_offload.core.session_checkpoints import SessionCheckpoints, state_dict_keys
from lightning_zero_offload.engine import OffloadEngine, OffloadOptions, StepStats
from lightning_zero_offload.engine.infra.collectives import broadcast_tensors_
from lightning_zero_offload.engine.meta_init.blockwise import BlockwiseInit
from lightning_zero_offload.engine.meta_init.initialization import on_meta
from lightning_zero_offload.engine.offload_params.materialize import materialize
from lightning_zero_offload.engine.offload_params.placement import init_units
from lightning_zero_offload.planner import check_host_memory


class OffloadSession(EngineSession, SessionCheckpoints):
    """The engine training ``module``'s parameters through one optimizer, and what the front ends ask of it.

    Built by :meth:`start`. The engine stays after :meth:`close` (closed), so the optimizer state can
    still be saved after training, as with a plain torch optimizer. ``engine`` is for the engine's own
    tests and for reading its parts; the front ends and users go through the session's methods.
    """

    engine: OffloadEngine

    def __init__(self, module: nn.Module, engine: OffloadEngine) -> None:
        super().__init__(module, engine)
        self.gradients = GradientView(engine)  # what p.grad says between backward and zero_grad
        # Refuses, now, an optimizer holding parameters of another module.
        self._param_keys = state_dict_keys(module, engine.params)
        self._keyed_params = tuple(map(id, engine.params))

    @classmethod
    def start(
        cls,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        device: torch.device,
        precision: str,
        options: OffloadOptions,
        world_size: int,
        local_world_size: int,
        blockwise: BlockwiseInit | None = None,
    ) -> OffloadSession:
        """Check the model and the host memory, then build the engine (the module's trainable weights go
        to ``device`` as low-precision views of one flat buffer).

        Everything that can be refused is refused before the engine allocates. With several ranks the
        ranks first check that they hold the same model and options, then take rank 0's weights and
        buffers; the engine shards over torch.distributed's default group. ``blockwise``: the model was built
        on the meta device (:meth:`placeholders`); the engine is built over the placeholders, then takes each
        block's values as it is initialized.
        """
        optimizer = the_optimizer(optimizers)
        precision, param_dtype = resolve_precision(precision)
        placeholders = blockwise.placeholder_ids if blockwise is not None else ()
        check_model(module, optimizer, param_dtype, precision, options, device, world_size > 1, placeholders)
        share_floor = check_host_memory(
            module, options, param_dtype, world_size, local_world_size, device, blockwise=blockwise is not None
        )
        if world_size > 1:  # rank 0's weights (a model built on the meta device: those built outside it)
            broadcast_tensors_(
                list(module.state_dict().values()) if blockwise is None else blockwise.real_tensors(), None, device
            )
        # process_group None: the default group to torch.distributed; holding the group object itself would keep
        # it alive past destroy_process_group (see release_process_group).
        engine = OffloadEngine(optimizer, device, param_dtype, options, None, local_world_size, share_floor)
        if blockwise is not None:
            try:
                blockwise.fill(engine.load_master_param, _from_rank0(world_size, device))
            except BaseException:
                engine.close(after_failure=True)
                raise
            engine.master_loaded()
        return cls(module, engine)

    @staticmethod
    def placeholders(
        module: nn.Module, device: torch.device, optimizers: Sequence[torch.optim.Optimizer] = ()
    ) -> BlockwiseInit | None:
        """A model built on the meta device (``configure_model``, ``init_module(empty_init=True)``) with
        placeholders for parameters (in ``optimizers`` built before too), for :meth:`start` to fill block by
        block; None for a model whose parameters are real (its buffers left on the meta device, by a load with
        ``assign=True``, are computed here, on ``device``)."""
        if not on_meta(module, partly=True):
            return None
        if not any(p.is_meta for p in module.parameters()):
            materialize(module, device)  # the buffers alone
            return None
        return BlockwiseInit(module, device, init_units(module), optimizers)

    @staticmethod
    def give_placeholders_memory(blockwise: BlockwiseInit, world_size: int, device: torch.device) -> None:
        """The model of ``blockwise`` used before an engine takes it (evaluated, or loaded into: ``device`` the
        host): each parameter gets its own memory there, with the values the engine would get (rank 0's)."""
        blockwise.fill(lambda param, value: False, _from_rank0(world_size, blockwise.device), device)

    # -- what the engine is and did --------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """The ranks the optimizer state is sharded over."""
        return self.engine.layout.world_size

    @property
    def rollbacks(self) -> int:
        """Speculated CPU steps taken back so far (``cpu_step="speculative"``: a clip or an overflow)."""
        return self.engine.schedule.rollbacks

    # -- training --------------------------------------------------------------------------------

    def expect_step(self, publish_early: bool = False) -> None:
        """The next backward ends an accumulation window: a step follows it, so the speculative schedule
        may run the CPU step during that backward (without this, after it, as in sync).

        ``publish_early``: nothing reads or writes the parameters between that backward and the step, so
        each speculated bucket may be copied to the device during backward too.
        """
        self.engine.expect_step(publish_early=publish_early)

    def before_training_forward(self) -> None:
        """Re-plan if parameters were unfrozen or param groups added, before the forward uses them, and
        start the delayed update behind it (``engine.before_training_forward``)."""
        if self.training:
            self.engine.before_training_forward()

    def begin_backward(self) -> None:
        """Before every backward: what user code did to ``p.grad`` goes to the engine, then backward adds
        to the engine's gradients (not to ``p.grad``)."""
        self.check_no_clip_before_backward()
        self.gradients.take_back()
        self.gradients.clear()
        self.engine.begin_backward()

    def finish_backward(self) -> None:
        """After every backward: the engine has the gradients; ``p.grad`` says which parameters have one."""
        self.engine.finish_backward()
        self.gradients.mark()

    def show_gradients(self) -> bool:
        """The real gradients in ``p.grad`` for user code that may read or change them before the step
        (a collective at several ranks); False where they cannot be shown exactly: fp16, where unscaled
        gradients would underflow in the parameters' dtype (``p.grad`` then refuses to be read)."""
        if not self.training or self.loss_scale is not None:
            return False
        self.gradients.show()
        return True

    def hide_gradients(self) -> None:
        """After user code that saw the gradients: what it did goes to the engine, placeholders return."""
        self.gradients.take_back()
        self.gradients.mark()

    def grad_norm(self, error_if_nonfinite: bool = False) -> float:
        """The total 2-norm of this window's unscaled gradients; its all-reduce is the coming step's.

        ``error_if_nonfinite``: raise on inf/nan, as ``torch.nn.utils.clip_grad_norm_`` does, except under
        fp16 loss scaling, where an overflow is routine (the step is skipped and the scale lowered).
        """
        self.gradients.take_back()
        return self._checked_norm(self.engine.grad_norm(), error_if_nonfinite)

    def step(self) -> StepStats:
        """The optimizer step on the CPU with the clip recorded since the last step. As torch's, it keeps
        the gradients (clipped) until :meth:`zero_grad`."""
        clip, self._clip = self._clip, {}
        self.gradients.take_back()
        stats = self.engine.step(**clip, keep_grads=True)
        self.gradients.mark()
        return stats

    def skip_step(self) -> None:
        """No step for this backward (fp16's rule for a training step that returned None): its clip is
        dropped too; the gradients stay until ``zero_grad``, as under AMP."""
        self._clip = {}
        self.engine.expect_step(False)
        self.finish_backward()

    def sync(self) -> None:
        """Bring the device parameters fully up to date (before evaluation; a delayed update too)."""
        self.engine.sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: drop the gradients (``set_to_none=False``: make them zero, so their
        parameters are still stepped), and the clip recorded for them."""
        self._clip = {}
        if self.training:
            self.gradients.clear()
            self.engine.zero_grad(set_to_none)
            self.gradients.mark()

    def close(self, after_failure: bool = False) -> None:
        """Hand the module back holding the trained fp32 master weights (the optimizer state is kept) and
        no gradients. ``after_failure``: without any collective (the other ranks may be gone)."""
        try:
            if self.training:
                self.gradients.clear()
        finally:
            self.engine.close(after_failure=after_failure)


def training_session(session: OffloadSession | None) -> OffloadSession | None:
    """``session`` while it trains (set up and not closed); None before setup and after teardown.

    The one "is it training" guard of both front ends, the callbacks and the optimizer.
    """
    return session if session is not None and session.training else None


class SessionStrategy:
    """Mixed into both front ends' strategies (before Lightning's base class): the session once set up,
    what users read and announce through it, and the ``zero_offload`` registry entry."""

    strategy_name = "zero_offload"
    session: OffloadSession | None = None

    @property
    def engine(self) -> OffloadEngine | None:
        """The offload engine once set up (after training: closed, still holding the optimizer state).

        For the engine's own tests and advanced reading of its parts; the supported route is the strategy's
        methods below and :attr:`session`, which stay when the engine's insides change.
        """
        return self.session.engine if self.session is not None else None

    def expect_step(self, publish_early: bool = False) -> None:
        """Say, before the backward that ends an accumulation window, that ``optimizer.step()`` follows it:
        the speculative schedule may then run the CPU step during that backward (Fabric loops; the Trainer
        says it itself). ``publish_early``: nothing reads or writes the weights between that backward and
        the step, so the updated weights may also reach the device during backward."""
        session = training_session(self.session)
        if session is None:
            raise RuntimeError("zero_offload is not training (not set up yet, or torn down): no step to announce")
        session.expect_step(publish_early)

    def sync(self) -> None:
        """Bring the module's parameters up to date with every step taken. Only ``cpu_step="delayed"`` leaves them
        a step behind between steps (its update runs behind the next forward): the Trainer syncs before each
        evaluation and at the end of fit, Fabric (one rank) before a forward in eval mode without gradients; call it
        before reading the weights yourself (``model.state_dict()`` in a Fabric loop). At several ranks a collective:
        call it on every rank. Nothing to do when not training."""
        if (session := training_session(self.session)) is not None:
            session.sync()

    @property
    def last_step_stats(self) -> StepStats | None:
        """What the last optimizer step did and where its time went (gradient norm, loss scale, skipped,
        time breakdown); None before setup."""
        return self.session.last_step if self.session is not None else None

    def memory_report(self) -> dict[str, int]:
        """Bytes the engine holds on the device and the host, by kind, and the trainable parameter count
        (``params``); also after training."""
        if self.session is None:
            raise RuntimeError("zero_offload is not set up yet: no memory to report")
        return self.session.memory_report()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=STRATEGY_DESCRIPTION, override=True)
        strategy_registry.register(
            f"{cls.strategy_name}_params",
            cls,
            description=f"{STRATEGY_DESCRIPTION}; parameters offloaded too (torch FSDP2)",
            override=True,
            offload_params=True,
        )


def _from_rank0(world_size: int, device: torch.device) -> Callable[[list[torch.Tensor]], None] | None:
    """What makes tensors rank 0's on every rank (through ``device`` where the backend needs it); None alone."""
    return partial(broadcast_tensors_, group=None, device=device) if world_size > 1 else None


def move_untrained_to(module: nn.Module, device: torch.device) -> None:
    """Move what the engine will not own to ``device`` (frozen parameters, buffers), before the engine is
    built: the trainable fp32 weights would otherwise pass through device memory at 4 bytes per parameter."""
    with torch.no_grad():
        for p in module.parameters():
            if not p.requires_grad:
                p.data = p.data.to(device)
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None:
                    sub._buffers[name] = buffer.to(device)


__all__ = [
    "ENGINE_STATE_KEY",
    "BlockwiseInit",
    "OffloadSession",
    "SessionStrategy",
    "materialize",
    "move_untrained_to",
    "on_meta",
    "training_session",
]
