"""Pretrained weights into a sharded (or plain) model, streamed tensor by tensor, never the whole model.

    load_pretrained(model, "path/to/hf_checkpoint_dir")   # model.safetensors or model.safetensors.index.json
    load_pretrained(model, "weights.safetensors")
    load_pretrained(model, "state_dict.pt")               # torch.save of a state dict: torch.load(mmap=True)

Each tensor of the checkpoint goes to the parameter or persistent buffer of the same name (the names of
``module.state_dict()``), cast to its dtype. A sharded parameter (a DTensor of ``fully_shard``) gets only
this rank's rows, read from the file alone (no collective; each rank reads its own 1/N); a plain one the
whole tensor; a parameter a ZeRO-2 engine trains (engine/engine.py) goes to its master weights, in the
checkpoint's precision, and the device copy follows (written into the parameter, its low-precision device copy,
it would reach the master rounded). Safetensors files are read by this module (their format is a JSON header and raw
little-endian bytes: ~30 lines, no dependency), only the bytes of this rank's rows, one tensor at a time:
the host holds one tensor's rows at once beyond the model. A state-dict file is memory-mapped by
``torch.load(mmap=True, weights_only=True)``: its pages are read as their rows are copied and stay
mapped (reclaimable page cache, not anonymous memory) until the load returns.

Names: a checkpoint's names may carry one prefix more or less than the model's (a LightningModule
holding the Hugging Face model as ``self.model``, a base-model checkpoint loaded into a ``...ForCausalLM``):
the one prefix to add or remove that matches the most names is applied. A tied weight stored once
(Hugging Face drops ``lm_head.weight`` when it is the embedding's) fills every name it has in the model.
A PEFT model takes its base model's checkpoint: a layer PEFT wrapped holds its weights as ``base_layer.*``,
and the adapters, which a base checkpoint has none of, keep their initialization (not counted missing).
Missing and unexpected names are refused before anything is read, as ``load_state_dict(strict=True)``
does; ``strict=False`` loads the rest and returns them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_zero_offload.engine.lifecycle import engine_training
from lightning_zero_offload.engine.meta_init.peft_adapters import adapter_layers, adapter_modules

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class LoadResult(NamedTuple):
    """The model's names the checkpoint did not fill, and the checkpoint's names the model does not have."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_pretrained(module: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> LoadResult:
    """Copy the checkpoint at ``path`` into ``module``'s parameters and persistent buffers, in place (see
    the module's docstring). ``path``: a Hugging Face checkpoint directory, a ``.safetensors`` file, or a
    file of ``torch.save(state_dict)``. The module's tensors must exist (``materialize`` a model built on
    the meta device first, with ``initialize=False``)."""
    targets = module.state_dict(keep_vars=True)  # FSDP2 reshards before this: targets are the shards
    if on_meta := [name for name, t in targets.items() if t.is_meta]:
        raise ValueError(
            f"{on_meta[0]} (and {len(on_meta) - 1} more) are on the meta device: load once the model has memory. "
            "Under the Trainer or Fabric that is after setup (in on_fit_start, or after fabric.setup), not in "
            "configure_model or under init_module(empty_init=True); in plain torch, materialize(module, device, "
            "initialize=False) or shard_model(..., initialize=False) first."
        )
    # PEFT's adapters (their modules' own tensors: the layer's base_layer is the model's)
    adapters = {
        id(t) for layer, _ in adapter_layers(module) for m in adapter_modules(layer) for t in m._parameters.values()
    }
    with open_checkpoint(path) as checkpoint:
        rename = _prefix_rule(list(targets), list(checkpoint.shapes))
        names = {key: _into_wrapped(rename(key), targets) for key in checkpoint.shapes}
        unexpected = sorted(key for key, name in names.items() if name not in targets)
        filled = {id(targets[name]) for name in names.values() if name in targets}
        missing = [name for name, t in targets.items() if id(t) not in filled and id(t) not in adapters]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"the checkpoint at {path} does not match the model: missing {missing or 'nothing'}; "
                f"unexpected {unexpected or 'nothing'}. Fix: load the checkpoint of this model, or pass "
                "strict=False to load the names that match."
            )
        for key, name in names.items():
            if name in targets and tuple(checkpoint.shapes[key]) != tuple(targets[name].shape):
                raise ValueError(
                    f"{key}: {tuple(checkpoint.shapes[key])} in the checkpoint, {tuple(targets[name].shape)} in "
                    "the model: a checkpoint of another configuration of this model?"
                )
        written: set[int] = set()
        with torch.no_grad(), contextlib.ExitStack() as stack:
            into_engine = _engines_writers(targets.values(), stack)
            for key in checkpoint.shapes:
                target = targets.get(names[key])
                if target is None or id(target) in written:
                    continue
                written.add(id(target))
                if (write := into_engine.get(id(target))) is not None:  # the ZeRO-2 engine's master weight
                    write(target, checkpoint.read(key, None, None))  # the whole tensor
                    continue
                index = local_index(target) if isinstance(target, DTensor) else _everything(target)
                local = target.to_local() if isinstance(target, DTensor) else target
                if all(part == slice(0, size) for part, size in zip(index[1:], target.shape[1:])):
                    checkpoint.read_into(key, index[0].start, local)  # whole rows: straight into the shard
                else:
                    rows = checkpoint.read(key, index[0].start, index[0].stop)
                    local.copy_(rows[(slice(None), *index[1:])])
    return LoadResult(missing, unexpected)


def _engines_writers(
    targets: Iterable[torch.Tensor], stack: contextlib.ExitStack
) -> dict[int, Callable[[torch.Tensor, torch.Tensor], bool]]:
    """For each target whose master weight a ZeRO-2 engine holds, that engine's writer (entered on ``stack``):
    the checkpoint's value goes to the master in its precision and the device copy follows, where a write into
    the parameter (its low-precision device copy) would reach the master rounded."""
    writers: dict[int, Callable] = {}
    by_engine: dict[int, Callable] = {}
    for target in targets:
        if (engine := engine_training(target)) is not None:
            if id(engine) not in by_engine:
                by_engine[id(engine)] = stack.enter_context(engine.writing_master())
            writers[id(target)] = by_engine[id(engine)]
    return writers


def local_index(tensor: DTensor) -> tuple[slice, ...]:
    """The part of the whole tensor this rank holds, one slice per dimension: ``Shard(d)`` splits the
    current range of dimension ``d`` as ``torch.chunk`` does (the last chunks may be short or empty), in
    mesh-dimension order; ``Replicate`` keeps it."""
    ranges = [[0, size] for size in tensor.shape]
    coordinate = tensor.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(tensor.placements):
        if type(placement) is Shard:
            low, high = ranges[placement.dim]
            step = math.ceil((high - low) / tensor.device_mesh.size(mesh_dim))
            start = min(low + coordinate[mesh_dim] * step, high)
            ranges[placement.dim] = [start, min(start + step, high)]
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(f"loading into a DTensor placed {placement}: only Shard and Replicate")
    index = tuple(slice(low, high) for low, high in ranges)
    if tuple(high - low for low, high in ranges) != tuple(tensor.to_local().shape):
        raise AssertionError(f"rows {index} do not match the local shard {tuple(tensor.to_local().shape)}")
    return index


def _everything(tensor: torch.Tensor) -> tuple[slice, ...]:
    return tuple(slice(0, size) for size in tensor.shape) or (slice(None),)


def _prefix_rule(model_names: list[str], checkpoint_names: list[str]) -> Callable[[str], str]:
    """The renaming of checkpoint names (remove one prefix, or add one) that matches the most model names;
    no renaming where that matches as many."""
    known = set(model_names)
    heads: dict[str, set[str]] = {}  # the rest of a model name after a prefix -> those prefixes
    for name in model_names:
        for cut in _cuts(name):
            heads.setdefault(name[cut:], set()).add(name[:cut])
    votes: dict[tuple[str, str], int] = {("", ""): sum(name in known for name in checkpoint_names)}
    for name in checkpoint_names:
        rules = {(name[:cut], "") for cut in _cuts(name) if name[cut:] in known}
        rules |= {("", prefix) for prefix in heads.get(name, ())}
        for rule in rules:
            votes[rule] = votes.get(rule, 0) + 1
    strip, add = max(votes, key=lambda rule: (votes[rule], rule == ("", "")))
    return lambda name: add + name.removeprefix(strip)


def _into_wrapped(name: str, targets: dict[str, torch.Tensor]) -> str:
    """A layer PEFT wrapped holds its own weights as ``base_layer.*``: a base checkpoint's ``...q_proj.weight`` is
    the model's ``...q_proj.base_layer.weight``."""
    head, _, leaf = name.rpartition(".")
    wrapped = f"{head}.base_layer.{leaf}"
    return wrapped if name not in targets and wrapped in targets else name


def _cuts(name: str) -> Iterator[int]:
    """Where a prefix can end in a dotted name (after each dot)."""
    return (i + 1 for i, char in enumerate(name) if char == ".")


class Checkpoint:
    """One or more files of tensors: their names and shapes (``shapes``), and on request rows
    ``start:stop`` of one tensor (``read``; all of them with None), read from the file then. Close it (or
    use it in a ``with``) when done."""

    def __init__(self) -> None:
        self.shapes: dict[str, list[int]] = {}
        self.readers: dict[str, Callable[[str, int | None, int | None], torch.Tensor]] = {}
        self.direct: dict[str, Callable[[str, int | None, torch.Tensor], bool]] = {}  # False: not possible
        self.files: list = []

    def read(self, key: str, start: int | None, stop: int | None) -> torch.Tensor:
        return self.readers[key](key, start, stop)

    def read_into(self, key: str, start: int | None, out: torch.Tensor) -> None:
        """Rows ``start:`` of ``key``, as many as ``out`` has (the whole tensor for a 0-dim one), into
        ``out``, cast to its dtype; a safetensors file reads them straight into ``out`` where it can."""
        stop = None if out.dim() == 0 else (start or 0) + out.shape[0]
        if key in self.direct and self.direct[key](key, start, out):
            return
        out.copy_(self.read(key, start, stop))

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        for file in self.files:
            file.close()


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The tensors at ``path`` (a Hugging Face checkpoint directory, a ``.safetensors`` file, or a
    ``torch.save`` of a state dict), listed, none read yet."""
    path, checkpoint = Path(path), Checkpoint()
    try:
        _add_files(checkpoint, path)
    except BaseException:
        checkpoint.__exit__()
        raise
    return checkpoint


def _add_files(checkpoint: Checkpoint, path: Path) -> None:
    if path.is_dir():
        index, single = path / "model.safetensors.index.json", path / "model.safetensors"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif single.exists():
            files = [single.name]
        else:
            raise FileNotFoundError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")
        for file in files:
            _add_safetensors(checkpoint, path / file)
    elif path.suffix == ".safetensors":
        _add_safetensors(checkpoint, path)
    else:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise ValueError(f"{path} is not a state dict (names to tensors): save model.state_dict() itself")
        for key, tensor in state.items():
            checkpoint.shapes[key] = list(tensor.shape)
            checkpoint.readers[key] = lambda name, start, stop: _rows(state[name], start, stop)


def _rows(tensor: torch.Tensor, start: int | None, stop: int | None) -> torch.Tensor:
    return tensor[start:stop] if tensor.dim() else tensor


def _add_safetensors(checkpoint: Checkpoint, path: Path) -> None:
    """The tensors of one safetensors file: an 8-byte little-endian header length, a JSON header (each
    tensor's dtype, shape and byte range after the header), then the bytes, row-major."""
    if sys.byteorder != "little":
        raise NotImplementedError("reading safetensors (little-endian) on a big-endian host")
    file = open(path, "rb")  # noqa: SIM115 (closed with the checkpoint)
    checkpoint.files.append(file)
    length = int.from_bytes(file.read(8), "little")
    header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    base = 8 + length

    def place(key: str, start: int | None, stop: int | None) -> tuple[torch.dtype, list[int], range]:
        """The tensor's dtype, shape, and the rows asked for; the file positioned at the first."""
        entry = header[key]
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
        rows = range(shape[0] if shape else 1)[slice(start, stop) if shape else slice(0, 1)]
        file.seek(base + entry["data_offsets"][0] + rows.start * math.prod(shape[1:]) * dtype.itemsize)
        return dtype, shape, rows

    def fill(buffer: memoryview, key: str) -> None:
        if buffer.nbytes and file.readinto(buffer) != buffer.nbytes:
            raise ValueError(f"{path} ends inside {key}: a truncated file?")

    def read(key: str, start: int | None, stop: int | None) -> torch.Tensor:
        dtype, shape, rows = place(key, start, stop)
        out = torch.empty((len(rows), *shape[1:]) if shape else (), dtype=dtype)
        fill(_bytes_of(out), key)
        return out

    def read_into(key: str, start: int | None, out: torch.Tensor) -> bool:
        dtype, shape, rows = place(key, start, None if out.dim() == 0 else (start or 0) + out.shape[0])
        if out.device.type != "cpu" or out.dtype != dtype or not out.is_contiguous():
            return False
        fill(_bytes_of(out), key)
        return True

    for key, entry in header.items():
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise NotImplementedError(f"{path}: {key} is {entry['dtype']}, a dtype this reader does not know")
        if key in checkpoint.shapes:
            raise ValueError(f"{key} is in two files of the checkpoint ({path} and another)")
        checkpoint.shapes[key] = entry["shape"]
        checkpoint.readers[key] = read
        checkpoint.direct[key] = read_into


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place (what ``readinto`` fills)."""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B") if nbytes else memoryview(b"")
