"""Lightning glue for the Trainer's checkpoints: its checkpoint hooks, which writer/reader a path gets,
and ``fit(weights_only=...)``.

:class:`TrainerCheckpoints` translates the Trainer's checkpoint hooks into calls on the strategy's
:class:`~lightning_zero_offload.core.OffloadSession` (fp32 master weights, torch AdamW optimizer format,
full or sharded). The default ``TorchCheckpointIO`` is replaced by the engine's writer (atomic and
streaming on the local disk, one object per file on fsspec filesystems such as ``s3://`` or
``memory://``); a custom ``CheckpointIO`` given to the Trainer, or ``storage_options``, hand the full
format to that plugin.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_zero_offload.checkpoints import (
    atomic_save,
    is_sharded_checkpoint,
    load_checkpoint_file,
    load_sharded,
)
from lightning_zero_offload.checkpoints.writer import StreamedStorages
from lightning_zero_offload.core import OffloadSession


def _is_default(checkpoint_io: CheckpointIO) -> bool:
    return type(checkpoint_io) is TorchCheckpointIO


def writes_before_returning(checkpoint_io: CheckpointIO) -> bool:
    """Whether a save through ``checkpoint_io`` is done writing when it returns (the strategy's own writer).

    Only then can the checkpoint hold views of the engine's buffers instead of copies: a user's plugin
    may write in the background (``AsyncCheckpointIO``) or keep the tensors.
    """
    return _is_default(checkpoint_io)


def save_full_checkpoint(
    checkpoint_io: CheckpointIO,
    checkpoint: dict[str, Any],
    filepath: Any,
    storage_options: Any | None,
    streamed: StreamedStorages | None = None,
) -> None:
    if storage_options is not None or not _is_default(checkpoint_io):
        checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        return
    atomic_save(checkpoint, filepath, streamed)  # refuses a directory at filepath, saying what it is


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


def _weights_only_resume_message(path: Any) -> str:
    """Why ``fit(ckpt_path=path)`` cannot resume from a weights-only checkpoint, and the ways on.

    A ``KeyError``'s message, as Lightning raises for it (which names neither the strategy nor a fix).
    """
    return (
        f"zero_offload cannot resume trainer.fit(ckpt_path={str(path)!r}): the checkpoint holds only the model "
        "weights, no optimizer state. This is probably due to `ModelCheckpoint.save_weights_only` being set to "
        "`True` (or trainer.save_checkpoint(..., weights_only=True)). To resume training, save with "
        "save_weights_only=False. To start a new fit from these weights, load them into the model with "
        "model.load_state_dict(lightning_zero_offload.convert_checkpoint_to_fp32_state_dict(path)) (either "
        "checkpoint_format) and call trainer.fit without ckpt_path; validate/test/predict(ckpt_path=...) load them as "
        "they are"
    )


class TrainerCheckpoints(Strategy):
    """The Trainer's checkpoint hooks for a strategy whose ``session`` (set up by ``fit``) holds the weights
    and the optimizer state. Mixed in before the strategy's base class."""

    session: OffloadSession | None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the master weights and moments live in the engine, which setup() creates

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict with the fp32 master weights in place of the device copies.

        Sharded: the trainable weights are left out here; each rank writes its shard of them instead.
        """
        assert self.lightning_module is not None
        if self.session is None:
            return self.lightning_module.state_dict()
        # Lightning calls this to save: views of the engine's buffers (as a plain module's state_dict
        # holds its live parameters), not a second copy, when the writer is done when it returns; at
        # several ranks views of placeholders that save_checkpoint fills as it writes.
        with self.session.shared_buffers(writes_before_returning(self.checkpoint_io)):
            return self.session.module_state_to_save()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.session is None:
            return super().optimizer_state(optimizer)
        with self.session.shared_buffers(writes_before_returning(self.checkpoint_io)):
            return self.session.optimizer_state_to_save()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Full: rank 0 writes one file. Sharded: every rank writes its shard into a new version directory.

        Either way the new checkpoint is complete before it replaces an existing one (docs/checkpoints.md).
        """
        if self.session is not None and self.session.sharded:
            warn_if_custom_io_sharded(self.checkpoint_io)
            self.session.save_sharded(checkpoint, filepath, self.global_rank, self.broadcast)
        elif self.session is not None and storage_options is None and writes_before_returning(self.checkpoint_io):
            # Every rank: at several, the buckets stream to rank 0's writer (placeholders in the dict).
            self.session.save_full(
                checkpoint,
                self.global_rank,
                self.broadcast,
                lambda ckpt, streamed: save_full_checkpoint(self.checkpoint_io, ckpt, filepath, None, streamed),
            )
        elif self.is_global_zero:
            save_full_checkpoint(self.checkpoint_io, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Either format, on any filesystem; ``weights_only`` as passed to ``fit`` (Lightning 2.4+ alike)."""
        if weights_only is None:
            weights_only = getattr(self, "_weights_only", None)
        checkpoint = load_checkpoint_with(self.checkpoint_io, checkpoint_path, weights_only)
        if "optimizer_states" not in checkpoint and self._fitting():
            raise KeyError(_weights_only_resume_message(checkpoint_path))
        return checkpoint

    def _fitting(self) -> bool:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.session is not None:
            self.session.load_master_weights(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self.session is None or not self.session.training:
            return super().load_optimizer_state_dict(checkpoint)
        states = checkpoint["optimizer_states"]
        if len(states) != 1:
            raise ValueError(f"expected one optimizer state in the checkpoint, found {len(states)}")
        self.session.engine.load_optimizer_state_dict(states[0])
