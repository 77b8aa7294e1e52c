"""The files of a ``torch.distributed.checkpoint`` (DCP) save, read without pickled code and checked byte for byte.

DCP writes each rank's tensors into ``__<rank>_<n>.distcp`` and an index of them into ``.metadata``. It reads
the tensors with ``torch.load(weights_only=True)``, but unpickles ``.metadata`` with plain ``pickle.load``
(which imports and runs whatever the file names) and every non-tensor value with ``torch.load(weights_only=
False)``. So the checkpoints of this package keep non-tensor values out of DCP (meta.pt holds them), and
:class:`MetadataReader` reads ``.metadata`` with an unpickler that admits DCP's own metadata classes only.

The sizes and CRC-32s of the files, recorded in meta.pt when the save ends, are checked on load: at several
ranks each rank reads every world-th file, and a failure is raised on every rank.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_zero_offload.checkpoints.files import CheckpointError, Location, file_record, file_size

DCP_METADATA = ".metadata"  # the name DCP's FileSystemWriter gives its index

# What DCP (torch 2.13) pickles into .metadata: its dataclasses, torch.Size, dtypes, a layout by name, paths.
_METADATA_CLASSES = (
    "Metadata",
    "StorageMeta",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "_MEM_FORMAT_ENCODING",
)
_ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _Refused(pickle.UnpicklingError):
    """A global the metadata may not name: the message is its ``module.name``."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


class MetadataReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` without running pickled code (``weights_only``), once."""

    def __init__(self, version: Location, weights_only: bool = True) -> None:
        super().__init__(version.path)
        self.version, self.weights_only = version, weights_only
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = _read_metadata(self.version / DCP_METADATA, self.weights_only)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def _read_metadata(source: Location, weights_only: bool) -> Metadata:
    data = pathlib.Path(source.path).read_bytes()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load() if weights_only else pickle.loads(data)
    except _Refused as refused:
        raise CheckpointError(
            f"checkpoint index {source} was refused by weights_only loading: it holds {refused}, which is not "
            "part of torch.distributed.checkpoint's metadata, and unpickling would import it and may run it. "
            "Load only files you trust with weights_only=False"
        ) from None
    except Exception as error:  # arbitrary bytes fail the unpickler in many ways
        raise CheckpointError(f"checkpoint index {source} is truncated or corrupt") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint index {source} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def tensor_entry(reader: MetadataReader, path: Sequence[str]) -> Any:
    """DCP's record of a tensor of the checkpoint (``size``, ``properties.dtype``); ``path``: its keys in the
    saved dict, e.g. ``("model", "head.weight")``."""
    key = ".".join(path)  # how DCP flattens nested dicts
    entry = reader.read_metadata().state_dict_metadata.get(key)
    if entry is None or not hasattr(entry, "size"):
        raise CheckpointError(f"the checkpoint at {reader.version} holds no tensor {key!r}")
    return entry


def read_tensor(reader: MetadataReader, path: Sequence[str], out: torch.Tensor | None = None) -> torch.Tensor:
    """One tensor of the checkpoint, whole, read from the files by this process alone, into ``out`` (its shape;
    converted to its dtype) or a new tensor in the saved dtype."""
    entry = tensor_entry(reader, path)
    tensor = torch.empty(entry.size, dtype=entry.properties.dtype) if out is None else out
    target: dict[str, Any] = {path[-1]: tensor}
    for name in reversed(path[:-1]):
        target = {name: target}
    load_files(target, reader, 1, f"reading {'.'.join(path)!r} from the checkpoint at {reader.version}")
    return tensor


def save_files(state: dict[str, Any], version: Location, world: int) -> None:
    """DCP writes ``state`` into ``version`` (every rank its shards; a collective when ``world`` > 1)."""
    with failures_named("saving the sharded checkpoint"), _alone(world):
        dcp.save(state, storage_writer=FileSystemWriter(version.path), no_dist=world == 1)


def load_files(state: dict[str, Any], reader: MetadataReader, world: int, what: str) -> None:
    """DCP fills ``state`` in place from the checkpoint (a collective when ``world`` > 1)."""
    with failures_named(what), _alone(world):
        dcp.load(state, storage_reader=reader, no_dist=world == 1)


@contextmanager
def _alone(world: int) -> Iterator[None]:
    """One process reads or writes without collectives (also in a forked child, whose process group is not
    usable): what DCP's no_dist is meant for, so its notice about it says nothing here."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


@contextmanager
def failures_named(what: str) -> Iterator[None]:
    """DCP's failures as a :class:`CheckpointError` naming the first failed rank and its error (DCP raises
    them on every rank as a ``BaseException`` holding each failed rank's traceback)."""
    try:
        yield
    except CheckpointException as error:
        rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
        raise CheckpointError(f"{what} failed on rank {rank}: {type(cause).__name__}: {cause}") from cause


# -- integrity --------------------------------------------------------------------------------------


def file_records(version: Location, names: Sequence[str]) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of each of the files ``names`` of ``version`` (read once more, from the page cache)."""
    records = {}
    for name in names:
        record = file_record(version / name)
        records[name] = {"size": record.size, "crc32": record.crc32}
    return records


def verify_files(version: Location, records: dict[str, dict[str, int]], rank: int, world: int) -> None:
    """Check the files against their records, each rank every ``world``-th file; every rank raises the first
    failure (a collective when ``world`` > 1)."""
    names = sorted(records)
    failure = next((f for name in names[rank::world] if (f := _check_file(version / name, records[name]))), None)
    failures = gather(failure) if world > 1 else [failure]
    first = next((f for f in failures if f is not None), None)
    if first is not None:
        raise CheckpointError(first)


def _check_file(source: Location, expected: dict[str, int]) -> str | None:
    if not source.is_file():
        return f"file {source} of the checkpoint is missing"
    if (size := file_size(source)) != expected["size"]:
        return (
            f"file {source} of the checkpoint has {size} bytes, its record in meta.pt says {expected['size']}: "
            "truncated or replaced"
        )
    if file_record(source).crc32 != expected["crc32"]:
        return (
            f"file {source} of the checkpoint does not match its checksum in meta.pt: corrupt, edited or "
            "from another save"
        )
    return None


# -- the ranks --------------------------------------------------------------------------------------


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if rank_and_world()[1] == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if rank_and_world()[1] == 1:
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
