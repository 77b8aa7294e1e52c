"""Writing a ``torch.save`` file into an open file object, with its size and CRC-32 as written.

The bytes are hashed as they pass (no second pass over the file; its cost: docs/checkpoints.md). A
checkpoint may hold placeholders whose bytes are not in memory (:class:`StreamedStorages`): the file
is then what ``torch.save`` writes for the tensors they stand for, each fetched when its record is
written. Where the file goes (local disk or fsspec, atomically) is checkpoints/files.py's job.
"""

from __future__ import annotations

import io
import pickle
import sys
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import torch


@dataclass(frozen=True)
class FileRecord:
    """Size and CRC-32 of a file as written: what a loader checks before trusting its bytes."""

    size: int
    crc32: int


class _ChecksumWriter:
    """A write-only file object that hashes the bytes passing through (torch.save writes sequentially)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.size, self.crc = f, 0, 0
        self.error: OSError | None = None  # torch.save reports a failed write as its own RuntimeError

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        try:
            return self.f.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.f.flush()


class StreamedStorages(Protocol):
    """Storages of ``obj`` whose bytes are not in memory: placeholders on the meta device, fetched one at a
    time while the file is written (see ``state.BucketStream``)."""

    def number(self, storage: torch.UntypedStorage) -> int | None:
        """Which placeholder ``storage`` is; ``None`` for a storage that holds its bytes."""

    def begin(self, order: list[int]) -> None:
        """Called once, before any record is written: the placeholders in the order they will be fetched."""

    def fetch(self, number: int) -> torch.Tensor:
        """The bytes of placeholder ``number`` (a CPU tensor, valid until the next call)."""


def _on_an_accelerator(tensor: torch.Tensor) -> bool:
    return tensor.device.type not in ("cpu", "meta")


class DeviceTensors:
    """Accelerator tensors of a dict to be saved, each copied to the host only when the writer reaches it, into one
    reused buffer: the host holds the largest of them at a time, not all (a sharded save's device share).

    :meth:`placed` gives the dict to save, each such tensor replaced by a placeholder on the meta device."""

    def __init__(self, tensors: dict[str, Any], streams: Callable[[torch.Tensor], bool] = _on_an_accelerator) -> None:
        self.sources: dict[int, torch.Tensor] = {}  # by the placeholder's storage
        self.placeholders: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if isinstance(tensor, torch.Tensor) and streams(tensor):
                placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
                self.sources[placeholder.untyped_storage()._cdata] = tensor.contiguous()
                self.placeholders[name] = placeholder
        self._numbers = {key: number for number, key in enumerate(self.sources)}
        self._tensors = list(self.sources.values())
        self._buffer: torch.Tensor | None = None

    def placed(self, tensors: dict[str, Any]) -> dict[str, Any]:
        return {**tensors, **self.placeholders}

    def number(self, storage: torch.UntypedStorage) -> int | None:
        return self._numbers.get(storage._cdata) if storage.device.type == "meta" else None

    def begin(self, order: list[int]) -> None:
        largest = max((self._tensors[number].nbytes for number in order), default=0)
        self._buffer = torch.empty(largest, dtype=torch.uint8)

    def fetch(self, number: int) -> torch.Tensor:
        tensor = self._tensors[number]
        assert self._buffer is not None
        host = self._buffer[: tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor)  # synchronous: the writer reads it next
        return host


def write_torch_file(obj: Any, f: BinaryIO, streamed: StreamedStorages | None = None) -> FileRecord:
    """Write ``obj`` as ``torch.save`` does into the open file ``f``; ``streamed``: its placeholders' source."""
    writer = _ChecksumWriter(f)
    try:
        if streamed is None:
            torch.save(obj, writer)
        else:
            _save_streaming(obj, writer, streamed)
    except Exception as error:
        if writer.error is None or writer.error is error:
            raise
        # A full disk midway reached the caller as torch's "unexpected pos 64 vs 0": the OSError says what to fix.
        raise writer.error from None
    writer.flush()
    return FileRecord(writer.size, writer.crc)


def _save_streaming(obj: Any, f: _ChecksumWriter, streamed: StreamedStorages) -> None:
    """What ``torch.save(obj, f)`` writes (torch 2.13's records, in its order: the same bytes), where the
    placeholders' bytes are fetched when their record is written rather than held beforehand.

    torch's own ``_save`` takes every storage's bytes from memory; this is its loop with that one change,
    and a placeholder tensor pickled as the CPU tensor it stands for.
    """
    storages: dict[str, torch.UntypedStorage] = {}
    keys: dict[int, str] = {}
    placeholders: dict[str, int] = {}
    dtypes: dict[int, torch.dtype] = {}

    def persistent_id(item: Any) -> tuple | None:
        if isinstance(item, torch.storage.TypedStorage):
            storage, dtype = item._untyped_storage, item.dtype
            storage_type, numel = getattr(torch, item._pickle_storage_type()), item._size()
        elif torch.is_storage(item):
            storage, dtype = item, torch.uint8
            storage_type, numel = torch.serialization.normalize_storage_type(type(item)), item.nbytes()
        else:
            return None
        number = streamed.number(storage)
        held = number is None and storage.device.type != "meta" and storage.data_ptr() != 0
        if held and dtypes.setdefault(storage.data_ptr(), dtype) != dtype:  # as torch.save refuses it
            raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
        key = keys.setdefault(storage._cdata, str(len(keys)))
        storages[key] = storage
        if number is not None:
            placeholders[key] = number
        location = "cpu" if number is not None else torch.serialization.location_tag(storage)
        return ("storage", storage_type, key, location, numel)

    class Pickler(pickle.Pickler):
        def persistent_id(self, item: Any) -> tuple | None:
            return persistent_id(item)

        def reducer_override(self, item: Any) -> Any:
            if type(item) is torch.Tensor and item.is_meta and streamed.number(item.untyped_storage()) is not None:
                return _reduce_as_cpu_tensor(item)
            return NotImplemented

    pickled = io.BytesIO()
    Pickler(pickled, protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    data = pickled.getvalue()
    streamed.begin([placeholders[key] for key in storages if key in placeholders])
    with torch.serialization._open_zipfile_writer(f) as archive:
        archive.write_record("data.pkl", data, len(data))
        archive.write_record(".format_version", "1", len("1"))
        alignment = str(torch.serialization._get_storage_alignment())
        archive.write_record(".storage_alignment", alignment, len(alignment))
        archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, storage in storages.items():
            nbytes = storage.nbytes()
            if key in placeholders:
                fetched = streamed.fetch(placeholders[key])
                source = fetched.untyped_storage()  # its first nbytes are written
                if fetched.nbytes != nbytes or fetched.data_ptr() != source.data_ptr() or not fetched.is_contiguous():
                    raise RuntimeError(f"placeholder {placeholders[key]}: got {fetched.nbytes} bytes for {nbytes}")
                archive.write_record(f"data/{key}", source, nbytes)
            else:
                archive.write_record(f"data/{key}", storage if storage.device.type == "cpu" else storage.cpu(), nbytes)


def _reduce_as_cpu_tensor(tensor: torch.Tensor) -> tuple:
    """``Tensor.__reduce_ex__`` of a plain CPU tensor with ``tensor``'s storage, offset, shape and strides."""
    backward_hooks: OrderedDict = OrderedDict()
    if tensor.dtype in torch.storage._new_dtypes():
        storage: Any = tensor.untyped_storage()
        args: tuple = (storage, tensor.storage_offset(), tuple(tensor.size()), tensor.stride())
        args += (tensor.requires_grad, backward_hooks, tensor.dtype)
        rebuild = torch._utils._rebuild_tensor_v3
    else:
        storage = torch.storage.TypedStorage(wrap_storage=tensor.untyped_storage(), dtype=tensor.dtype, _internal=True)
        args = (storage, tensor.storage_offset(), tuple(tensor.size()), tensor.stride())
        args += (tensor.requires_grad, backward_hooks)
        rebuild = torch._utils._rebuild_tensor_v2
    metadata = torch._utils.get_tensor_metadata(tensor)
    if metadata:
        args += (metadata,)
    return (rebuild, args)
