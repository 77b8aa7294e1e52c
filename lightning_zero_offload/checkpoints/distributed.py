"""The sharded checkpoints of ``offload_params=True``: ``torch.distributed.checkpoint`` (DCP) files inside the
versioned directory of the ZeRO-2 sharded format (checkpoints/sharded.py), published by its ``meta.pt``.

```
epoch=3-step=400.ckpt/
  v000007/
    __0_0.distcp, __1_0.distcp  DCP: each rank's shards of the model (parameters and buffers), of the moments
                                and the step counts, keyed by parameter name (engine/offload_params/sharded_state.py)
    .metadata                   DCP's index of them: which rows of what each file holds
    meta.pt                     rank 0, written last: the param groups (parameters by name), the engine's
                                counters, the front end's entries (``extra``), each file's size and CRC-32
```

A save makes a new version directory, every rank writes its DCP file, then rank 0 writes ``meta.pt`` and only
then deletes the older versions (sharded.py's helpers), so a save that fails or dies at any point leaves the
previous checkpoint the current one. Each rank writes and later reads only its own shards: nothing is gathered.
Loaded at any world size (DCP reads each rank's rows from whichever files hold them), in place into the
existing shards and moments; checked first against the recorded sizes and CRC-32s, and read without pickled
code (distributed_files.py). :func:`load_sharded_full` and the exports (:func:`model_placeholders`) read it in
one process without a process group, one tensor at a time. Local paths only (DCP's file writer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from lightning_zero_offload.checkpoints.distributed_files import (
    DCP_METADATA,
    MetadataReader,
    broadcast,
    file_records,
    gather,
    load_files,
    rank_and_world,
    read_tensor,
    save_files,
    tensor_entry,
    verify_files,
)
from lightning_zero_offload.checkpoints.files import CheckpointError, Location, PathLike, check_zip_checksums, load_file
from lightning_zero_offload.checkpoints.full import atomic_save
from lightning_zero_offload.checkpoints.keys import FORMAT_KEY
from lightning_zero_offload.checkpoints.sharded import (
    META_FILE,
    attempt,
    current_version,
    layout_checksum,
    new_version,
    no_complete_version,
    publish,
    raise_any,
    removed_unless_published,
)
from lightning_zero_offload.engine.offload_params import ParamOffloadEngine
from lightning_zero_offload.engine.offload_params.heap import release_free_heap
from lightning_zero_offload.engine.offload_params.sharded_state import (
    keep_saved_state,
    load_param_groups_by_name,
    load_sharded_state,
    param_groups_by_name,
    param_names,
    sharded_state,
)
from lightning_zero_offload.engine.state_dicts import note_state_conversion
from lightning_zero_offload.engine.step.cpu_state import STATE_DTYPES, STATE_NAMES

__all__ = [
    "OpenedCheckpoint",
    "export_fp32",
    "is_distributed_checkpoint",
    "load_as_full",
    "load_sharded",
    "load_sharded_full",
    "model_placeholders",
    "save_sharded",
]

FORMAT = "distributed"


def is_distributed_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` holds a complete checkpoint of this format (a DCP index in its current version)."""
    version = current_version(Location.of(path))
    return version is not None and (version / DCP_METADATA).is_file()


def save_sharded(
    path: PathLike,
    module: nn.Module,
    engine: ParamOffloadEngine,
    extra: dict[str, Any],
    with_optimizer: bool = True,
    model_state: dict[str, Any] | None = None,
) -> None:
    """Every rank writes its shards of ``module`` (and with ``with_optimizer`` of the moments and step counts),
    rank 0 the param groups, the engine's counters and ``extra`` (plain Python and tensors: it must load with
    ``weights_only=True``), as a new version under ``path`` that replaces the previous one when complete.
    ``model_state``: the module's entries to write (:func:`sharded_state`'s, some left out), else all of them.
    Call it on every rank, between steps. A failure on any rank raises on every rank and leaves the previous
    checkpoint at ``path`` as it was.
    """
    root = _local(path)
    rank, world = rank_and_world()
    state = {"model": model_state} if model_state is not None else {}
    state |= sharded_state(module, engine, with_optimizer, with_model=model_state is None)
    version_name, save_id = raise_any([broadcast(attempt(new_version, root) if rank == 0 else None)])[0]
    version = root / version_name
    with removed_unless_published(version, rank):  # DCP's writes and the collectives below return on every rank
        save_files(state, version, world)  # raises on every rank if one fails
        names = broadcast(version.children() if rank == 0 else None)
        records = raise_any(gather(attempt(file_records, version, names[rank::world])))
        meta: dict[str, Any] | None = None
        if rank == 0:
            info = {
                "format": FORMAT,
                "version": 1,
                "world_size": world,
                "save_id": save_id,
                "files": {name: record for part in records for name, record in part.items()},
                "model_keys": list(state["model"]),
                "tied": _tied_keys(module),
                "params": param_names(module, engine),
                "state_dtype": STATE_NAMES[engine.state_dtype],
                "with_optimizer": with_optimizer,
            }
            info["layout_crc32"] = layout_checksum(info)
            meta = {FORMAT_KEY: info, "engine": engine.state_dict(), "extra": extra}
            if with_optimizer:
                meta["param_groups"] = param_groups_by_name(module, engine.optimizer)
        publish(meta, root, version_name, rank, broadcast)


class OpenedCheckpoint:
    """A checkpoint of this format open for loading: its ``meta.pt`` read and every file checked once (every rank
    calls it). Its model and its optimizer state then load in place, together or one after the other: the Trainer
    loads the optimizer state after the callbacks' state, which may put param groups back first.
    ``weights_only=False`` admits pickled objects in meta.pt and DCP's index: only for files you trust."""

    def __init__(self, path: PathLike, weights_only: bool = True) -> None:
        self.path = path
        self.version, self.meta = read_meta(path, weights_only)
        self.info = self.meta[FORMAT_KEY]
        rank, self.world = rank_and_world()
        verify_files(self.version, self.info["files"], rank, self.world)
        self.reader = MetadataReader(self.version, weights_only)

    @property
    def extra(self) -> dict[str, Any]:
        """The front end's entries it was saved with (loops', callbacks', schedulers' state)."""
        return self.meta["extra"]

    def load(
        self,
        module: nn.Module,
        engine: ParamOffloadEngine,
        model: bool = True,
        optimizer: bool = True,
        strict: bool = True,
    ) -> None:
        """In place into ``module``'s shards (``model``), and into the engine's moments, step counts, the param
        groups' hyperparameters and the engine's counters (``optimizer``). Call it on every rank, between steps.

        As torch's ``load_state_dict``: a trainable parameter the checkpoint has no state for starts afresh, and a
        frozen one it has state for keeps it for its unfreezing; not ``strict``: the module keeps its values for
        the entries the checkpoint lacks."""
        if optimizer and not self.info["with_optimizer"]:
            raise CheckpointError(
                f"the checkpoint at {self.path} holds the model only (it was saved without optimizer state): "
                "load it with with_optimizer=False to start from its weights"
            )
        saved = set(self.info["params"]) if optimizer else set()
        if optimizer:
            keep_saved_state(module, engine, saved)
        keys = self._model_keys(module, strict) if model else None
        state = sharded_state(module, engine, with_optimizer=optimizer, with_model=model, saved=saved, model_keys=keys)
        _check_fits(self.reader, state, self.path)
        if optimizer:
            load_param_groups_by_name(module, engine.optimizer, self.meta["param_groups"])
            note_state_conversion(engine.state_dtype, [STATE_DTYPES[self.info["state_dtype"]]], stacklevel=3)
        load_files(state, self.reader, self.world, f"loading the checkpoint at {self.path}")  # in place
        load_sharded_state(module, engine, state)
        if optimizer:
            engine.load_state_dict(self.meta["engine"])

    def _model_keys(self, module: nn.Module, strict: bool) -> set[str]:
        """The module's entries the checkpoint has (a hook may have left some out); ``strict``, as torch's
        ``load_state_dict``, refuses any difference."""
        saved, held = set(self.info["model_keys"]), set(get_model_state_dict(module))
        if strict and saved != held:
            missing, unexpected = sorted(held - saved), sorted(saved - held)
            differences = [f"lacks {len(missing)} of the module's entries {missing[:4]}"] if missing else []
            differences += [f"has {len(unexpected)} the module lacks {unexpected[:4]}"] if unexpected else []
            raise CheckpointError(
                f"the checkpoint at {self.path} {' and '.join(differences)}. If it was saved without some entries on "
                "purpose (on_save_checkpoint), load with strict=False (the Trainer: self.strict_loading = False): the "
                "module keeps its own values for them; else build the model as it was when it was saved"
            )
        return saved & held


def load_sharded(
    path: PathLike,
    module: nn.Module,
    engine: ParamOffloadEngine,
    with_optimizer: bool = True,
    weights_only: bool = True,
    strict: bool = True,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` in place into ``module``'s shards (with ``with_optimizer`` also the
    moments, step counts, param groups' hyperparameters and the engine's counters), at any world size; returns
    the ``extra`` it was saved with. Call it on every rank (:class:`OpenedCheckpoint`)."""
    opened = OpenedCheckpoint(path, weights_only)
    opened.load(module, engine, optimizer=with_optimizer, strict=strict)
    return opened.extra


def load_sharded_full(path: PathLike, weights_only: bool = True, with_optimizer: bool = True) -> dict[str, Any]:
    """The checkpoint whole, in one process (no process group needed), read tensor by tensor:
    ``state_dict`` (the module's, as saved: fp32, or bf16 from ``cpu_state="bf16"``), ``optimizer_state``
    (torch AdamW's format: state by index in param_groups order; absent if saved without it, or not read without
    ``with_optimizer``), ``engine_state`` and ``extra``. What a run with ``offload_params=False`` resumes from."""
    version, meta = read_meta(path, weights_only)
    info = meta[FORMAT_KEY]
    verify_files(version, info["files"], 0, 1)
    reader = MetadataReader(version, weights_only)
    state_dict: dict[str, torch.Tensor] = {}
    for key in info["model_keys"]:
        tied = info["tied"].get(key)
        state_dict[key] = state_dict[tied] if tied is not None else read_tensor(reader, ("model", key))
    loaded = {"state_dict": state_dict, "engine_state": meta["engine"], "extra": meta["extra"]}
    if info["with_optimizer"] and with_optimizer:
        loaded["optimizer_state"] = _optimizer_state(reader, info["params"], meta["param_groups"])
    return loaded


def load_as_full(path: PathLike, weights_only: bool = True, with_optimizer: bool = True) -> dict[str, Any]:
    """The checkpoint whole as a full-format Lightning checkpoint dict: what a run without its shards loads
    (``validate``/``test``/``predict``, the ZeRO-2 mode). ``with_optimizer=False``: the moments are not read."""
    loaded = load_sharded_full(path, weights_only, with_optimizer)
    checkpoint = {**loaded["extra"], "state_dict": loaded["state_dict"], FORMAT_KEY: {"format": FORMAT}}
    if "optimizer_state" in loaded:
        checkpoint["optimizer_states"] = [loaded["optimizer_state"]]
    return checkpoint


def _optimizer_state(reader: MetadataReader, params: list[str], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The moments and steps in torch AdamW's format: by each parameter's place in the param groups."""
    index = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}
    state = {}
    for name in params:
        step = int(read_tensor(reader, ("optimizer", name, "step")))
        if step > 0:  # torch keeps no state for a parameter that never stepped
            moments = {m: read_tensor(reader, ("optimizer", name, m)) for m in ("exp_avg", "exp_avg_sq")}
            state[index[name]] = {"step": torch.tensor(float(step), dtype=torch.float32), **moments}
    torch_groups, counter = [], 0
    for group in groups:
        hyperparameters = {k: v for k, v in group.items() if k != "params"}
        torch_groups.append({**hyperparameters, "params": list(range(counter, counter + len(group["params"])))})
        counter += len(group["params"])
    return {"state": state, "param_groups": torch_groups}


def export_fp32(path: PathLike, output_path: PathLike) -> None:
    """Write the checkpoint's module state dict to ``output_path`` as one ``torch.save`` file (atomically),
    bf16 widened to fp32 (exactly), reading and holding one tensor at a time: the file is what
    ``torch.save`` writes for the whole dict, built without it in memory."""
    placeholders, stream = model_placeholders(path)
    atomic_save(placeholders, output_path, streamed=stream)


def model_placeholders(path: PathLike) -> tuple[dict[str, torch.Tensor], TensorByTensor]:
    """The module's state dict as meta tensors (in the module's order, a tied name sharing its first name's
    tensor, bf16 as fp32), and the reader of each one's values, from the checked files."""
    version, meta = read_meta(path, weights_only=True)
    info = meta[FORMAT_KEY]
    verify_files(version, info["files"], 0, 1)
    stream = TensorByTensor(MetadataReader(version))
    placeholders: dict[str, torch.Tensor] = {}
    for key in info["model_keys"]:
        tied = info["tied"].get(key)
        placeholders[key] = placeholders[tied] if tied is not None else stream.add(key)
    return placeholders, stream


class TensorByTensor:
    """The exports' placeholders (meta tensors standing for the model's tensors), each read from the checkpoint
    when a writer reaches it (checkpoints/writer.py's ``StreamedStorages``) into one buffer the size of the
    largest. The free heap is handed back before each read: DCP reads each tensor into a block of its own,
    which glibc's heap can keep pinned (docs/benchmarks.md, "Checkpoints of the parameter-offload mode")."""

    def __init__(self, reader: MetadataReader) -> None:
        self.reader = reader
        self.keys: list[str] = []
        self.numbers: dict[int, int] = {}
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def add(self, key: str) -> torch.Tensor:
        entry = tensor_entry(self.reader, ("model", key))
        placeholder = torch.empty(entry.size, dtype=_exported(entry.properties.dtype), device="meta")
        self.numbers[placeholder.untyped_storage()._cdata] = len(self.keys)
        self.keys.append(key)
        if placeholder.nbytes > self.buffer.nbytes:
            self.buffer = torch.empty(placeholder.nbytes, dtype=torch.uint8)
        return placeholder

    def number(self, storage: torch.UntypedStorage) -> int | None:
        return self.numbers.get(storage._cdata) if storage.device.type == "meta" else None

    def begin(self, order: list[int]) -> None:
        """Any order: each tensor is read on its own."""

    def fetch(self, number: int) -> torch.Tensor:
        """The values of placeholder ``number``, in the one buffer (valid until the next fetch)."""
        path = ("model", self.keys[number])
        entry = tensor_entry(self.reader, path)
        dtype = _exported(entry.properties.dtype)
        out = self.buffer[: entry.size.numel() * dtype.itemsize].view(dtype).view(entry.size)
        release_free_heap()  # what DCP's reads of the tensors before freed (see below)
        return read_tensor(self.reader, path, out)  # DCP converts a bf16 one as it copies it in


def _exported(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.bfloat16 else dtype


def read_meta(path: PathLike, weights_only: bool = True) -> tuple[Location, dict[str, Any]]:
    """The current version of the checkpoint at ``path`` and its ``meta.pt``, checked (zip CRC-32s, format,
    layout checksum); every failure is a :class:`CheckpointError` naming the file."""
    root = _local(path)
    version = current_version(root)
    if version is None:
        raise CheckpointError(no_complete_version(root))
    meta_file = version / META_FILE
    check_zip_checksums(meta_file, "metadata")
    meta = load_file(meta_file, "metadata", weights_only=weights_only)
    info = meta.get(FORMAT_KEY) if isinstance(meta, dict) else None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(
            f"{root} is not a checkpoint of offload_params=True (its {META_FILE} describes another format): "
            "load it with the mode that saved it, or through lightning_zero_offload.checkpoints.load_sharded"
        )
    if layout_checksum(info) != info.get("layout_crc32"):
        raise CheckpointError(f"metadata {meta_file} was modified after it was saved (its layout checksum differs)")
    return version, meta


def _check_fits(reader: MetadataReader, state: dict[str, Any], path: PathLike) -> None:
    """Every tensor of ``state`` is in the checkpoint, with the same global shape (before DCP reads any)."""
    saved = reader.read_metadata().state_dict_metadata
    for key, tensor in _flattened(state):
        entry = saved.get(key)
        if entry is None or not hasattr(entry, "size"):
            raise CheckpointError(
                f"the checkpoint at {path} has no {key!r}: it was saved from another model (or with other trainable "
                "parameters). Build the model and optimizer as they were when it was saved"
            )
        if tuple(entry.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"{key!r} has shape {tuple(entry.size)} in the checkpoint at {path} and {tuple(tensor.shape)} here: "
                "build the model as it was when it was saved"
            )


def _flattened(state: dict[str, Any], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) for each tensor of a nested dict, its keys joined with dots as DCP flattens them."""
    found = []
    for name, value in state.items():
        if isinstance(value, dict):
            found += _flattened(value, f"{prefix}{name}.")
        else:
            found.append((f"{prefix}{name}", value))
    return found


def _tied_keys(module: nn.Module) -> dict[str, str]:
    """State-dict keys of parameters listed under an earlier key too (tied weights): key -> the first one."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def _local(path: PathLike) -> Location:
    root = Location.of(path)
    if root.fs is not None:
        raise CheckpointError(
            f"{root}: checkpoints of offload_params=True are written by torch.distributed.checkpoint's file writer, "
            "to a local or mounted path only; save to a local path and copy it"
        )
    return root
