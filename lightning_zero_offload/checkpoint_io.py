"""Lightning glue for checkpoint files: which writer/reader a path gets, and ``fit(weights_only=...)``.

The default ``TorchCheckpointIO`` is replaced by the engine's writer (atomic and streaming on the local
disk, one object per file on fsspec filesystems such as ``s3://`` or ``memory://``); a custom
``CheckpointIO`` given to the Trainer, or ``storage_options``, hand the full format to that plugin.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch.distributed
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from lightning_zero_offload.engine.checkpoint import (
    CheckpointError,
    atomic_save,
    is_sharded_checkpoint,
    load_checkpoint_file,
    load_sharded,
)
from lightning_zero_offload.engine.checkpoint_files import Location


def _is_default(checkpoint_io: CheckpointIO) -> bool:
    return type(checkpoint_io) is TorchCheckpointIO


def writes_before_returning(checkpoint_io: CheckpointIO) -> bool:
    """Whether a save through ``checkpoint_io`` is done writing when it returns (the strategy's own writer).

    Only then can the checkpoint hold views of the engine's buffers instead of copies: a user's plugin
    may write in the background (``AsyncCheckpointIO``) or keep the tensors.
    """
    return _is_default(checkpoint_io)


def save_full_checkpoint(
    checkpoint_io: CheckpointIO, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None
) -> None:
    if storage_options is not None or not _is_default(checkpoint_io):
        checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    if Location.of(filepath).is_dir():
        raise CheckpointError(
            f"{filepath} is a sharded checkpoint directory; a single-file checkpoint cannot replace it in place. "
            "Delete it or save under another name"
        )
    atomic_save(checkpoint, filepath)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` without a process group)."""
    if not _distributed_is_initialized():
        return [obj]
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


def warn_if_custom_io_sharded(checkpoint_io: CheckpointIO) -> None:
    if not _is_default(checkpoint_io):
        rank_zero_warn(
            'checkpoint_format="sharded" writes its shards through fsspec, not through '
            f'{type(checkpoint_io).__name__}; with checkpoint_format="full" your CheckpointIO writes the checkpoint'
        )


def load_checkpoint_with(checkpoint_io: CheckpointIO, path: Any, weights_only: bool | None) -> dict[str, Any]:
    """Load either format; ``weights_only=None`` means ``True`` (what ``torch.load`` defaults to)."""
    if is_sharded_checkpoint(path):
        return load_sharded(path, weights_only=weights_only is not False)
    if _is_default(checkpoint_io):
        return load_checkpoint_file(path, weights_only=weights_only is not False)
    if "weights_only" in inspect.signature(checkpoint_io.load_checkpoint).parameters:  # Lightning >= 2.6
        return checkpoint_io.load_checkpoint(path, weights_only=weights_only)
    return checkpoint_io.load_checkpoint(path)


class _RemembersWeightsOnly:
    """Keeps the ``weights_only`` given to ``fit``/``validate``/... on the strategy.

    Lightning drops it before ``load_checkpoint`` for strategies that restore after setup (as this one
    must: the optimizer state lives in the engine that setup builds), and 2.4/2.5 have no such argument.
    """

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            try:
                bound = inspect.signature(function).bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = {}
            trainer.strategy._weights_only = bound.get("weights_only")
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class SubprocessScriptLauncher(_RemembersWeightsOnly, _SubprocessScriptLauncher):
    """Lightning's script launcher (``start_method="popen"``), remembering ``weights_only``."""


class MultiProcessingLauncher(_RemembersWeightsOnly, _MultiProcessingLauncher):
    """Lightning's multiprocessing launcher (spawn/fork), remembering ``weights_only``."""
