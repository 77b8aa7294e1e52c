"""What both front ends do, written once: one module and its optimizer trained by the offload engine.

Plain torch and the engine; no Trainer and no Fabric. The Trainer strategy (``trainer/strategy.py`` with
``trainer/precision.py``) and the Fabric strategy (``fabric/strategy.py``) translate Lightning's hooks
into calls on an :class:`OffloadSession`, as Lightning's own ``pytorch/strategies/fsdp.py`` imports its helpers from
``fabric/strategies/fsdp.py``:

- setup: :func:`move_untrained_to`, then :meth:`OffloadSession.start` (model checks, host-memory
  pre-flight, the engine);
- training: re-planning before a training forward, the pending clip, the step, ``zero_grad``;
- checkpoints: the master-weight state dict, the optimizer state to save, the full save (streamed to
  rank 0 at several ranks), the sharded save, loading weights back;
- the end: :meth:`OffloadSession.close`.

Around it: the optimizer for a loop that calls ``step()`` itself (``core/optimizer.py``), the end of a
run after a failure or at exit (``core/teardown.py``) and Fabric's checkpoint layout
(``fabric/checkpoints.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_zero_offload.checkpoints import ENGINE_STATE_KEY, FORMAT_KEY, PathLike, save_sharded, sharded_layout
from lightning_zero_offload.checkpoints.streamed import BucketStream, serve_full_save
from lightning_zero_offload.checkpoints.writer import StreamedStorages
from lightning_zero_offload.core.gradients import GradientView
from lightning_zero_offload.core.model_rules import (
    check_param_dtypes,
    check_same_on_all_ranks,
    check_unique_params,
    describe_model,
)
from lightning_zero_offload.core.options import STRATEGY_DESCRIPTION, resolve_precision
from lightning_zero_offload.engine import OffloadEngine, OffloadOptions, StepStats
from lightning_zero_offload.engine.infra.collectives import broadcast_tensors_
from lightning_zero_offload.engine.state_dicts import buffers_shared_for_save
from lightning_zero_offload.planner import check_host_memory


class OffloadSession:
    """The engine training ``module``'s parameters through one optimizer, and what the front ends ask of it.

    Built by :meth:`start`. ``engine`` stays after :meth:`close` (closed), so the optimizer state can
    still be saved after training, as with a plain torch optimizer.
    """

    def __init__(self, module: nn.Module, engine: OffloadEngine) -> None:
        self.module = module
        self.engine = engine
        self.gradients = GradientView(engine)  # what p.grad says between backward and zero_grad
        self._clip: dict[str, float] = {}  # recorded between backward and the step, applied by step()
        # Refuses, now, an optimizer holding parameters of another module.
        self._param_keys = _state_dict_keys(module, engine.params)
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
    ) -> OffloadSession:
        """Check the model and the host memory, then build the engine (the module's trainable weights go
        to ``device`` as low-precision views of one flat buffer).

        Everything that can be refused is refused before the engine allocates. With several ranks the
        ranks first check that they hold the same model and options, then take rank 0's weights and
        buffers; the engine shards over torch.distributed's default group.
        """
        if len(optimizers) != 1:
            raise ValueError(
                f"zero_offload takes exactly one optimizer, got {len(optimizers)}. "
                "Put the parameters in param groups of one optimizer instead."
            )
        (optimizer,) = optimizers
        precision, param_dtype = resolve_precision(precision)
        _check_model(module, optimizer, param_dtype, precision, options, device, world_size > 1)
        check_host_memory(module, options, param_dtype, world_size, local_world_size, device)
        if world_size > 1:
            broadcast_tensors_(list(module.state_dict().values()), None, device)
        # process_group=None means the default group to torch.distributed; holding the group object itself
        # would keep it alive past destroy_process_group (see release_process_group).
        engine = OffloadEngine(
            optimizer, device, param_dtype, options, process_group=None, local_world_size=local_world_size
        )
        return cls(module, engine)

    @property
    def param_keys(self) -> list[list[str]]:
        """For each of the engine's trainable parameters, every state-dict key it appears under (tied
        weights appear under several); follows the engine when it re-plans its trainable set."""
        params = self.engine.params
        if tuple(map(id, params)) != self._keyed_params:
            self._param_keys = _state_dict_keys(self.module, params)
            self._keyed_params = tuple(map(id, params))
        return self._param_keys

    @property
    def training(self) -> bool:
        """The engine is set up and not closed yet."""
        return not self.engine.closed

    # -- training --------------------------------------------------------------------------------

    def before_training_forward(self) -> None:
        """Re-plan if parameters were unfrozen or param groups added, before the forward uses them, and
        start the delayed update behind it (``engine.before_training_forward``)."""
        if self.training:
            self.engine.before_training_forward()

    def begin_backward(self) -> None:
        """Before every backward: what user code did to ``p.grad`` goes to the engine, then backward adds
        to the engine's gradients (not to ``p.grad``)."""
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
        if not self.training or self.engine.scaler is not None:
            return False
        self.gradients.show()
        return True

    def hide_gradients(self) -> None:
        """After user code that saw the gradients: what it did goes to the engine, placeholders return."""
        self.gradients.take_back()
        self.gradients.mark()

    def clip_norm(self, max_norm: float) -> None:
        """Clip the global gradient norm in the coming step (on the CPU, fused into it)."""
        self._clip["clip_norm"] = float(max_norm)

    def clip_value(self, limit: float) -> None:
        """Clip each gradient element to ``[-limit, limit]`` in the coming step."""
        self._clip["clip_value"] = float(limit)

    def grad_norm(self, error_if_nonfinite: bool = False) -> float:
        """The total 2-norm of this window's unscaled gradients; its all-reduce is the coming step's.

        ``error_if_nonfinite``: raise on inf/nan, as ``torch.nn.utils.clip_grad_norm_`` does, except under
        fp16 loss scaling, where an overflow is routine (the step is skipped and the scale lowered).
        """
        self.gradients.take_back()
        norm = self.engine.grad_norm()
        if error_if_nonfinite and math.isinf(norm) and self.engine.scaler is None:
            raise RuntimeError(
                "The total norm of the gradients is non-finite, so it cannot be clipped. "
                "Pass error_if_nonfinite=False to clip_gradients to skip this step instead."
            )
        return norm

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad()``: drop the gradients (``set_to_none=False``: make them zero, so their
        parameters are still stepped), and the clip recorded for them."""
        self._clip = {}
        if self.training:
            self.gradients.clear()
            self.engine.zero_grad(set_to_none)
            self.gradients.mark()

    # -- checkpoints -----------------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        return self.engine.options.checkpoint_format == "sharded"

    def shared_buffers(self, share: bool = True) -> AbstractContextManager[None]:
        """Inside: the master weights and moments come as views of the engine's buffers, not copies, for
        a writer that is done when it returns (``share=False``: copies, e.g. for a background writer)."""
        return buffers_shared_for_save(self.engine, share)

    def master_state_dict(self) -> dict[str, Any]:
        """``module.state_dict()`` with the fp32 master weights in place of the low-precision device copies.

        A collective with several ranks: call it on every rank.
        """
        state = self.module.state_dict()
        if not self.training:
            return state  # closed: the module holds the master weights itself
        for keys, weight in zip(self.param_keys, self.engine.master_params()):
            for key in keys:
                state[key] = weight
        return state

    def module_state_to_save(self) -> dict[str, Any]:
        """The master state dict; sharded, without the trainable weights (each rank saves its shard)."""
        if not (self.sharded and self.training):
            return self.master_state_dict()
        state = self.module.state_dict()
        for key in (key for keys in self.param_keys for key in keys):
            state.pop(key, None)
        return state

    def optimizer_state_to_save(self) -> dict[str, Any]:
        """The optimizer state in torch AdamW's format; sharded, only the param groups (the moments are
        in the shards)."""
        if self.sharded:
            return {"state": {}, "param_groups": self.engine.param_groups_state()}
        return self.engine.optimizer_state_dict()

    def save_full(
        self,
        checkpoint: dict[str, Any],
        rank: int,
        broadcast: Callable,
        write: Callable[[dict[str, Any], StreamedStorages | None], None],
    ) -> None:
        """Rank 0 writes ``checkpoint`` with ``write(checkpoint, streamed)``; call it on every rank.

        At several ranks a checkpoint built inside :meth:`shared_buffers` holds placeholders for the
        gathered buckets of the master weights and moments: while rank 0 writes, every other rank sends
        its part of each bucket as the file reaches it (one bucket at a time), and every rank raises if
        rank 0's write failed. ``broadcast(obj)``: rank 0's ``obj`` on every rank.
        """
        if self.engine.layout.world_size == 1:
            if rank == 0:
                write(checkpoint, None)
            return
        if rank != 0:
            serve_full_save(self.engine, broadcast, "the full-format checkpoint")
            return
        stream = BucketStream(self.engine, broadcast)
        try:
            write(checkpoint, stream)
        except BaseException as error:
            with contextlib.suppress(Exception):  # the write's error is the one to report
                stream.finish(error)  # the other ranks return and raise too, instead of waiting for buckets
            raise
        stream.finish(None)

    def save_sharded(self, checkpoint: dict[str, Any], path: PathLike, rank: int, broadcast: Callable) -> None:
        """Every rank writes its shard of the master weights and moments, rank 0 also ``checkpoint`` (with
        the layout a loader needs at any world size) as ``meta.pt``: a new version directory, complete
        before it replaces an existing one. ``broadcast(obj)``: rank 0's ``obj`` on every rank."""
        engine = self.engine
        if rank == 0:
            checkpoint[FORMAT_KEY] = sharded_layout(engine.layout, self.param_keys, engine.steps, engine.torch_index)
        meta = checkpoint if rank == 0 else None
        save_sharded(path, engine.shard_state_dict(), meta, rank, broadcast, all_gather_objects)

    def load_master_weights(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """The trainable weights of a module state dict into the master weights (and the device copies).

        A weight the state dict lacks keeps its value; with ``strict`` that is a ``KeyError``.
        """
        if not self.training:
            return
        keys = [keys[0] for keys in self.param_keys]
        missing = [key for key in keys if key not in state_dict]
        if missing and strict:
            raise KeyError(f"The checkpoint has no weights for {missing[:5]}")
        current = self.engine.master_params() if missing else []
        self.engine.load_master_params([state_dict[k] if k in state_dict else current[i] for i, k in enumerate(keys)])

    def close(self) -> None:
        """Hand the module back holding the trained fp32 master weights (the optimizer state is kept) and
        no gradients."""
        if self.training:
            self.gradients.clear()
        self.engine.close()


class SessionStrategy:
    """Mixed into both front ends' strategies (before Lightning's base class): the session once set up,
    its engine (what users, callbacks and tests read), and the ``zero_offload`` registry entry."""

    strategy_name = "zero_offload"
    session: OffloadSession | None = None

    @property
    def engine(self) -> OffloadEngine | None:
        """The offload engine once set up (after training: closed, still holding the optimizer state)."""
        return self.session.engine if self.session is not None else None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=STRATEGY_DESCRIPTION, override=True)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


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


def _check_model(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    param_dtype: torch.dtype,
    precision: str,
    options: OffloadOptions,
    device: torch.device,
    distributed: bool,
) -> None:
    """Refuse what the engine would train wrongly, and models or options that differ between ranks
    (before the first collective that depends on them)."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    check_unique_params(optimizer, names)
    trainable = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    check_param_dtypes(trainable, names, param_dtype)
    if distributed:
        check_same_on_all_ranks(describe_model(module, optimizer, options, precision), device)


def _state_dict_keys(module: nn.Module, params: list[torch.nn.Parameter]) -> list[list[str]]:
    keys: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        keys.setdefault(id(p), []).append(name)
    if any(id(p) not in keys for p in params):
        raise ValueError(
            "The optimizer holds parameters that are not parameters of the module it trains; build the optimizer "
            "from the module's parameters (self.parameters() in configure_optimizers, model.parameters() for Fabric)"
        )
    return [keys[id(p)] for p in params]


__all__ = [
    "ENGINE_STATE_KEY",
    "OffloadSession",
    "SessionStrategy",
    "all_gather_objects",
    "move_untrained_to",
]
