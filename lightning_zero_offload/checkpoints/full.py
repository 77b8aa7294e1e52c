"""The full format: one ``torch.save`` file holding the whole Lightning checkpoint, written atomically and
loaded memory-mapped.

Every front end writes a full checkpoint with :func:`atomic_save` (the directory guard: a path that is a
directory, a sharded checkpoint's among them, is refused with what it is) and reads one with
:func:`load_checkpoint_file` (any failure is a :class:`CheckpointError` naming the file).
"""

from __future__ import annotations

from typing import Any

from lightning_zero_offload.checkpoints.files import CheckpointError, Location, PathLike, load_file, save_file
from lightning_zero_offload.checkpoints.sharded import DirectoryKind, directory_kind
from lightning_zero_offload.checkpoints.writer import StreamedStorages

__all__ = ["atomic_save", "load_checkpoint_file"]


def atomic_save(obj: Any, path: PathLike, streamed: StreamedStorages | None = None) -> None:
    """Write ``obj`` so that ``path`` holds either its previous content or all of ``obj`` (any fsspec URL too).

    ``streamed``: ``obj`` holds placeholders whose bytes it supplies as the file is written. A directory at
    ``path`` is refused, saying what it is (a file cannot replace a directory in one rename).
    """
    target = Location.of(path)
    kind = directory_kind(target)
    if kind != "not a directory":
        raise CheckpointError(_full_save_over(target, kind))
    save_file(obj, target, streamed=streamed)


def _full_save_over(directory: Location, kind: DirectoryKind) -> str:
    cannot = f'zero_offload cannot save a full-format checkpoint (checkpoint_format="full", one file) to {directory}'
    if kind in ("sharded", "interrupted"):
        what = "a sharded checkpoint directory" + (" left by an interrupted save" if kind == "interrupted" else "")
        return (
            f"{cannot}: it is {what}, and a file cannot replace a directory in place. Save under another name, "
            'delete the directory first, or keep checkpoint_format="sharded" for this path'
        )
    return (
        f"{cannot}: it is an existing {'empty ' if kind == 'empty' else ''}directory, not a file path. "
        f"Give the checkpoint a file name, such as {directory / 'last.ckpt'}, or remove the directory"
    )


def load_checkpoint_file(path: PathLike, weights_only: bool = True) -> dict[str, Any]:
    """Load a full-format checkpoint file; any failure is a :class:`CheckpointError` naming the file.

    A local file is memory-mapped: each rank reads the weights it copies and only its own shard of the
    moments, not 12 bytes per parameter of fp32 state (6 of bf16 state) into memory of its own.
    """
    checkpoint = load_file(Location.of(path), "checkpoint", weights_only=weights_only, mmap=True)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(checkpoint).__name__}, not a checkpoint dict")
    return checkpoint
