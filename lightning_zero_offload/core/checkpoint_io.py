"""The one checkpoint path of both front ends: which writer and reader a path gets, with every guard and
warning in one place (trainer/checkpoint_hooks.py and fabric/strategy.py call it alike).

- Saving: the strategy's own writer (checkpoints/full.py: atomic, streamed to rank 0 at several ranks,
  refusing a directory at the path with what it is) writes the full format, unless the user gave a
  ``CheckpointIO`` of their own or ``storage_options``: then that plugin writes it, on rank 0. The sharded
  format is always written by every rank through fsspec; a custom ``CheckpointIO`` cannot write it, which
  a warning says.
- Loading: a sharded directory is reassembled at this world size; a full file is read memory-mapped, any
  failure a :class:`~lightning_zero_offload.checkpoints.CheckpointError` naming the file, unless a custom
  ``CheckpointIO`` reads it.

The front ends' ``checkpoint_io`` is Lightning's plugin; this module only calls its ``save_checkpoint`` and
``load_checkpoint`` (core imports no Lightning).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_zero_offload.checkpoints import (
    PathLike,
    atomic_save,
    is_sharded_checkpoint,
    load_checkpoint_file,
    load_sharded,
)
from lightning_zero_offload.checkpoints.distributed import is_distributed_checkpoint, load_as_full
from lightning_zero_offload.warning import ZeroOffloadWarning

if TYPE_CHECKING:
    from lightning_zero_offload.core.session import OffloadSession


def uses_own_writer(checkpoint_io: Any, storage_options: Any | None = None) -> bool:
    """Whether a save goes through the strategy's own writer: Lightning's default ``TorchCheckpointIO`` (the
    same class under both front ends, exactly that class: a subclass is the user's) and no storage options.

    Only that writer is done when it returns, so only its checkpoints may hold views of the engine's
    buffers instead of copies: a user's plugin may write in the background (``AsyncCheckpointIO``).
    """
    cls = type(checkpoint_io)
    default = cls.__name__ == "TorchCheckpointIO" and cls.__module__.startswith("lightning.fabric.plugins.io")
    return default and storage_options is None


def save_checkpoint(
    session: OffloadSession | None,
    checkpoint: dict[str, Any],
    path: PathLike,
    *,
    checkpoint_io: Any,
    storage_options: Any | None,
    rank: int,
    broadcast: Callable[[Any], Any],
    sharded: bool,
) -> None:
    """Write ``checkpoint`` to ``path``; call it on every rank.

    ``sharded``: every rank writes its shard of the session's master weights and moments into a new
    version directory (``checkpoint`` in the Trainer's layout). Otherwise the full format: one file, whole
    before it replaces an existing one. ``broadcast(obj)``: rank 0's ``obj`` on every rank.
    """
    if sharded:
        assert session is not None
        if rank == 0 and not uses_own_writer(checkpoint_io):
            warnings.warn(
                'checkpoint_format="sharded" writes its shards through fsspec, not through '
                f'{type(checkpoint_io).__name__}; with checkpoint_format="full" your CheckpointIO writes the '
                "checkpoint",
                ZeroOffloadWarning,
                stacklevel=3,
            )
        session.save_sharded(checkpoint, path, rank, broadcast)
    elif uses_own_writer(checkpoint_io, storage_options):
        if session is not None:  # every rank: at several, the buckets stream to rank 0's writer
            session.save_full(checkpoint, rank, broadcast, lambda ckpt, streamed: atomic_save(ckpt, path, streamed))
        elif rank == 0:
            atomic_save(checkpoint, path)
    elif rank == 0:  # the user's CheckpointIO (remote storage, a background writer) decides how to write
        checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)


def load_checkpoint(
    path: PathLike, checkpoint_io: Any, weights_only: bool | None, with_optimizer: bool = True
) -> dict[str, Any]:
    """Either format (and offload_params' sharded one, read whole) as a Lightning checkpoint dict;
    ``weights_only=None`` means ``True`` (torch's default).

    ``with_optimizer=False``: a sharded checkpoint's moments are not read.
    """
    if is_distributed_checkpoint(path):
        return load_as_full(path, weights_only is not False, with_optimizer)
    if is_sharded_checkpoint(path):
        return load_sharded(path, with_optimizer=with_optimizer, weights_only=weights_only is not False)
    if uses_own_writer(checkpoint_io):
        return load_checkpoint_file(path, weights_only=weights_only is not False)
    if "weights_only" in inspect.signature(checkpoint_io.load_checkpoint).parameters:  # Lightning >= 2.6
        return checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    return checkpoint_io.load_checkpoint(path)
