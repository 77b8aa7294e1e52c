"""Where checkpoint bytes go: the local disk (atomic, exclusive, fsynced) or any fsspec filesystem.

Local writes never follow a planted symlink: temporary files are created with ``O_EXCL | O_NOFOLLOW``
under a random name in the target's own directory and renamed into place; shard files are created with
``O_EXCL | O_NOFOLLOW`` in a directory this save just created. Every file gets the mode ``torch.save``
would give it (``0o666`` less the umask), so other users read them as they read plain checkpoints.
Remote paths (``s3://``, ``gs://``, ``memory://``...) go through fsspec, where one object appears
whole or not at all, so a sharded save writes every shard first and its metadata, the completion
marker, last.

Every write returns the size and CRC-32 of the bytes as written (checkpoints/writer.py writes
them), and every read error names the file and says what is wrong.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from lightning_zero_offload.checkpoints.writer import FileRecord, StreamedStorages, write_torch_file

PathLike = str | os.PathLike
TEMP_INFIX = ".tmp-"
# What open(path, "wb") (and so torch.save) asks for: the kernel applies the umask, as for plain files.
FILE_MODE = 0o666
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as it is: the message names the file and what is wrong."""


@dataclass(frozen=True)
class Location:
    """A path, and the fsspec filesystem it lives on (``None``: the local disk, written atomically)."""

    path: str
    fs: Any = None

    @classmethod
    def of(cls, path: PathLike) -> Location:
        path = os.fspath(path)
        if "://" not in path:
            return cls(path)
        from fsspec.core import url_to_fs  # only remote paths need fsspec

        fs, inner = url_to_fs(path)
        if "file" in _protocols(fs):
            return cls(inner)
        return cls(inner, fs)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def __truediv__(self, name: str) -> Location:
        return Location(f"{self.path.rstrip('/')}/{name}", self.fs)

    def __str__(self) -> str:
        if self.fs is None:
            return self.path
        return self.fs.unstrip_protocol(self.path)

    def parent(self) -> Location:
        return Location(os.path.dirname(self.path.rstrip("/")) or ".", self.fs)

    def is_dir(self) -> bool:
        return os.path.isdir(self.path) if self.fs is None else self.fs.isdir(self.path)

    def is_file(self) -> bool:
        return os.path.isfile(self.path) if self.fs is None else self.fs.isfile(self.path)

    def exists(self) -> bool:
        return os.path.lexists(self.path) if self.fs is None else self.fs.exists(self.path)

    def children(self) -> list[str]:
        if self.fs is None:
            return sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []
        if not self.fs.isdir(self.path):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False))

    def is_link(self) -> bool:
        return self.fs is None and os.path.islink(self.path)

    def make_dirs(self) -> None:
        if self.fs is None:
            os.makedirs(self.path, exist_ok=True)
        else:
            self.fs.makedirs(self.path, exist_ok=True)

    def make_dir_exclusive(self) -> bool:
        """Create this directory; ``False`` if the name is taken (by anything, a symlink included)."""
        if self.fs is not None:
            if self.fs.exists(self.path):
                return False
            self.fs.makedirs(self.path, exist_ok=True)
            return True
        try:
            os.mkdir(self.path)
        except FileExistsError:
            return False
        return True

    def remove(self) -> None:
        """Delete a file or a directory tree; a symlink is unlinked, never followed."""
        if self.fs is not None:
            if self.fs.exists(self.path):
                self.fs.rm(self.path, recursive=True)
        elif self.is_link() or os.path.isfile(self.path):
            os.unlink(self.path)
        elif os.path.isdir(self.path):
            import shutil

            shutil.rmtree(self.path)

    def fsync_dir(self) -> None:
        """Make a rename in this directory durable (local disk only)."""
        if self.fs is None:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def save_file(
    obj: Any, target: Location, exclusive: bool = False, streamed: StreamedStorages | None = None
) -> FileRecord:
    """Write ``obj`` with ``torch.save`` so that ``target`` never holds a partial file.

    Local: a temporary file next to ``target``, fsynced, then renamed over it. ``exclusive=True`` is for
    a fresh name in a directory this save created: the file is created with ``O_EXCL | O_NOFOLLOW`` and
    written in place (a partial file there is caught by its recorded size and checksum). Remote: one object.
    ``streamed``: ``obj`` holds placeholders whose bytes come from it as the file is written.
    """
    if target.fs is not None:
        with target.fs.open(target.path, "wb") as f:
            return write_torch_file(obj, f, streamed)
    if exclusive:
        fd = os.open(target.path, _CREATE, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            record = write_torch_file(obj, f, streamed)
            os.fsync(f.fileno())
        return record
    directory = target.parent()
    directory.make_dirs()
    remove_stale_temporaries(target)
    fd, tmp = _create_temporary(directory, f".{target.name}{TEMP_INFIX}")
    try:
        with os.fdopen(fd, "wb") as f:
            record = write_torch_file(obj, f, streamed)
            os.fsync(f.fileno())
        os.replace(tmp, target.path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    directory.fsync_dir()
    return record


def _create_temporary(directory: Location, prefix: str) -> tuple[int, str]:
    """``mkstemp`` with the mode a plain ``open`` would give (``mkstemp`` makes files owner-only)."""
    while True:
        path = os.path.join(directory.path, prefix + secrets.token_hex(8))
        try:
            return os.open(path, _CREATE, FILE_MODE), path
        except FileExistsError:  # taken (by anything, a planted link included): draw another name
            continue


def remove_stale_temporaries(target: Location) -> None:
    """Delete what interrupted saves of ``target`` left next to it (links are unlinked, not followed)."""
    if target.fs is not None:
        return
    directory = target.parent()
    prefixes = (f".{target.name}{TEMP_INFIX}", f".{target.name}.incomplete", f".{target.name}.old")
    for name in directory.children():
        if name.startswith(prefixes):
            (directory / name).remove()


def file_record(source: Location) -> FileRecord:
    """Size and CRC-32 of a file's bytes, read in 16 MB blocks."""
    crc, size = 0, 0
    with _open_read(source) as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return FileRecord(size, crc)


def check_zip_checksums(source: Location, what: str) -> None:
    """Check every record of a ``torch.save`` file against the CRC-32 the zip format stores with it.

    torch writes these checksums (in each record's header and the central directory) but never reads
    them, so a flipped bit loads as a wrong number; this reads the file once more and compares.
    """
    if not source.exists():
        raise CheckpointError(f"{what} {source} does not exist")
    try:
        with _open_read(source) as f, zipfile.ZipFile(f) as archive:
            bad = archive.testzip()
    except Exception:  # noqa: BLE001 - no readable zip structure: truncated, or not a torch file at all
        raise CheckpointError(_damaged(source, what)) from None
    if bad is not None:
        raise CheckpointError(
            f"{what} {source} is corrupt or was edited: its record {bad!r} does not match the CRC-32 stored with it"
        )


def file_size(source: Location) -> int:
    return os.path.getsize(source.path) if source.fs is None else source.fs.size(source.path)


def _open_read(source: Location) -> BinaryIO:
    if source.fs is None:
        return open(source.path, "rb")
    return source.fs.open(source.path, "rb")


def load_file(source: Location, what: str, weights_only: bool = True, mmap: bool = False) -> Any:
    """``torch.load`` that turns every failure into a :class:`CheckpointError` naming the file.

    ``what`` says what the file is (e.g. "checkpoint", "shard 3 of a sharded checkpoint"). ``mmap``: the
    tensors are views of the file mapped into memory, read only where used (a local file in torch's zip
    format; any other file is read whole).
    """
    if not source.exists():
        raise CheckpointError(f"{what} {source} does not exist")
    if source.is_dir():
        raise CheckpointError(f"{what} {source} is a directory, not a checkpoint file")
    try:
        if source.fs is None:
            mmap = mmap and _is_zip(source)  # torch maps only its zip format, not the legacy one
            return torch.load(source.path, map_location="cpu", weights_only=weights_only, mmap=mmap)
        with source.fs.open(source.path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=weights_only)
    except (PermissionError, IsADirectoryError) as error:
        raise CheckpointError(f"cannot read {what} {source}: {error.strerror or error}") from None
    except pickle.UnpicklingError as error:
        refused = _refused_globals(source, error) if weights_only else []
        if refused:
            raise CheckpointError(
                f"{what} {source} was refused by weights_only loading: it holds Python objects or code "
                f"({', '.join(refused)}), which unpickling would import and may run. Load only files you trust "
                "with weights_only=False: to resume, trainer.fit(..., weights_only=False) or fabric.load(..., "
                "weights_only=False); or allow the classes named with torch.serialization.add_safe_globals; or "
                "re-save the checkpoint holding only tensors, numbers, strings and containers of them"
            ) from None
        raise CheckpointError(_damaged(source, what)) from None
    except Exception as error:
        # Arbitrary bytes reach the legacy (non-zip) unpickler, which can fail with almost any
        # exception type (IndexError, KeyError, struct.error, ...); the cause stays chained.
        raise CheckpointError(_damaged(source, what)) from error


# Both ways torch's weights_only unpickler refuses a global name the message ("Unsupported global: GLOBAL
# x.y was not allowed", "Trying to load unsupported GLOBAL posix.system whose module posix is blocked").
_GLOBAL_IN_MESSAGE = re.compile(r"\bGLOBAL ([\w.]+)")


def _refused_globals(source: Location, error: Exception) -> list[str]:
    """The globals a ``weights_only`` load refused, ``[]`` if the pickle failed for another reason.

    torch's own scan of the pickle comes first: the wording of its errors changes between releases.
    """
    try:
        with _open_read(source) as f:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception:  # unreadable as a zip checkpoint: fall back to the error's text
        found = []
    return found or _GLOBAL_IN_MESSAGE.findall(str(error))[:1]


def _is_zip(source: Location) -> bool:
    with _open_read(source) as f:
        return f.read(4) == b"PK\x03\x04"


def _damaged(source: Location, what: str) -> str:
    with _open_read(source) as f:
        head = f.read(4)
    if head[:2] != b"PK":
        return f"{what} {source} is not a PyTorch checkpoint (corrupt, or some other kind of file)"
    return f"{what} {source} is truncated or corrupt (it cannot be read as a PyTorch checkpoint)"


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
