"""The session's side of checkpoints: the state dicts both front ends save and load, and the full and
sharded saves, written once (a part of :class:`~lightning_zero_offload.core.session.OffloadSession`).

- out: the master-weight state dict, the optimizer state in torch AdamW's format, the engine's own state
  (step counts, loss scaler, schedule) under ``ENGINE_STATE_KEY``; the full save (streamed to rank 0 at
  several ranks) and the sharded one (every rank its shard);
- in: weights into the master weights, the optimizer state, the engine's state.

Which writer and reader a path gets is core/checkpoint_io.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from lightning_zero_offload.checkpoints import FORMAT_KEY, PathLike, save_sharded, sharded_layout
from lightning_zero_offload.checkpoints.distributed_files import gather
from lightning_zero_offload.checkpoints.streamed import BucketStream, OneRankBuckets, serve_full_save
from lightning_zero_offload.checkpoints.writer import StreamedStorages
from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.state_dicts import buffers_shared_for_save, parked_state


class SessionCheckpoints:
    """State dicts out and in, and the saves, for a session holding ``module`` and its ``engine``."""

    module: nn.Module
    engine: OffloadEngine
    _param_keys: list[list[str]]
    training: bool  # the session's: the engine is set up and not closed yet
    _keyed_params: tuple[int, ...] = ()

    @property
    def param_keys(self) -> list[list[str]]:
        """For each of the engine's trainable parameters, every state-dict key it appears under (tied
        weights appear under several); follows the engine when it re-plans its trainable set."""
        params = self.engine.params
        if tuple(map(id, params)) != self._keyed_params:
            self._param_keys = state_dict_keys(self.module, params)
            self._keyed_params = tuple(map(id, params))
        return self._param_keys

    @property
    def sharded(self) -> bool:
        """Checkpoints are saved in the sharded format (``checkpoint_format="sharded"``)."""
        return self.engine.options.checkpoint_format == "sharded"

    # -- out -------------------------------------------------------------------------------------

    def shared_buffers(self, share: bool = True) -> AbstractContextManager[None]:
        """Inside: the master weights and moments come as views of the engine's buffers, not copies, for
        a writer that is done when it returns (``share=False``: copies, e.g. for a background writer); the
        placeholders among them are this package's writer's to fill (:meth:`save_full`)."""
        return buffers_shared_for_save(self.engine, share, streamed=True)

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
        """The optimizer state in torch AdamW's format; sharded, the param groups and the state of frozen parameters
        that have one (the trainable ones' moments are in the shards). A collective with several ranks (full format)."""
        if self.sharded:
            return {"state": parked_state(self.engine), "param_groups": self.engine.param_groups_state()}
        return self.engine.optimizer_state_dict()

    def engine_state_dict(self) -> dict[str, Any]:
        """What a resume needs besides weights and moments to continue bitwise (step counts, loss scaler,
        the schedule's state), saved under ``ENGINE_STATE_KEY``."""
        return self.engine.state_dict()

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
        if self.engine.layout.world_size == 1:  # placeholders only for a device share's buckets
            registry = self.engine.save_sharing.placeholders
            if rank == 0:
                write(checkpoint, OneRankBuckets(registry) if registry.sources else None)
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
        save_sharded(path, engine.shard_state_dict(), meta, rank, broadcast, gather)

    # -- in --------------------------------------------------------------------------------------

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

    def load_optimizer_state(self, state_dict: dict[str, Any]) -> None:
        """An optimizer state in torch Adam/AdamW's format (saved by this session, torch or ``CPUAdam``) into
        the engine's moments and step counts."""
        self.engine.load_optimizer_state_dict(state_dict)

    def load_engine_state(self, state: dict[str, Any]) -> None:
        """:meth:`engine_state_dict` back, after the weights and the optimizer state."""
        self.engine.load_state_dict(state)


def state_dict_keys(module: nn.Module, params: list[torch.nn.Parameter]) -> list[list[str]]:
    """For each of ``params``, every key ``module.state_dict()`` holds it under; refuses one of another module."""
    keys: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        keys.setdefault(id(p), []).append(name)
    if any(id(p) not in keys for p in params):
        raise ValueError(
            "The optimizer holds parameters that are not parameters of the module it trains; build the optimizer "
            "from the module's parameters (self.parameters() in configure_optimizers, model.parameters() for Fabric)"
        )
    return [keys[id(p)] for p in params]
