"""Weights as a Hugging Face weights folder: ``model.safetensors``, or numbered shards and
``model.safetensors.index.json`` beyond ``max_shard_size`` (the files ``save_pretrained`` writes, so
``from_pretrained``, vLLM and safetensors' own loader read them), each tensor read when its shard is written.

Each shard is written under a temporary name and fsynced, and all are renamed into place only once every one
is complete, then the index, so an export that fails leaves the folder's earlier weights as they were. Other
files in the folder (``config.json``, a tokenizer) are left alone.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_zero_offload.checkpoints.files import CheckpointError, Location, PathLike
from lightning_zero_offload.engine.lifecycle import engine_training
from lightning_zero_offload.engine.offload_params.pretrained import SAFETENSORS_DTYPES

__all__ = ["INDEX", "check_folder", "save_hugging_face", "write_safetensors_folder"]

INDEX = "model.safetensors.index.json"
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")
_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
_TEMPORARY = ".export-"


def write_safetensors_folder(
    tensors: dict[str, torch.Tensor],
    read: Callable[[str], torch.Tensor],
    output_dir: PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> dict[str, str]:
    """Write ``tensors`` (each name's meta tensor: shape and dtype) into ``output_dir``, each one's values from
    ``read(name)`` when its shard is written; return the ``weight_map`` (each name and its file).

    Floating-point tensors are written in ``dtype`` (rounded to nearest), the others as they are.
    ``max_shard_size``: bytes, or a string as ``save_pretrained`` takes it (``"5GB"``, ``"500MB"``). Weights
    already in the folder are replaced only with ``overwrite=True``.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    if sys.byteorder != "little":
        raise NotImplementedError("writing safetensors (little-endian) on a big-endian host")
    limit = _bytes(max_shard_size)
    old = check_folder(output_dir, overwrite)
    folder = Path(output_dir)
    written_as = {name: tensor.to(_written(tensor.dtype, dtype)) for name, tensor in tensors.items()}
    shards = _plan({name: tensor.nbytes for name, tensor in written_as.items()}, limit)
    files = [
        "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        for i in range(len(shards))
    ]
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(f"{_TEMPORARY}*"):  # what an interrupted export left
        stale.unlink()
    done: list[Path] = []  # the temporaries, removed unless renamed into place
    try:
        for number, names in enumerate(shards):
            done.append(folder / f"{_TEMPORARY}{number}")
            _write_shard(done[-1], {name: written_as[name] for name in names}, read)
        for temporary, file in zip(done, files):
            os.replace(temporary, folder / file)
    finally:
        for temporary in done:
            temporary.unlink(missing_ok=True)
    weight_map = {name: file for names, file in zip(shards, files) for name in names}
    if len(files) > 1:
        total = sum(tensor.nbytes for tensor in written_as.values())
        _write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        files.append(INDEX)
    for name in old:  # weights of an earlier export that these do not replace
        if name not in files:
            (folder / name).unlink()
    Location(os.fspath(folder)).fsync_dir()
    return weight_map


def save_hugging_face(
    module: nn.Module,
    output_dir: PathLike,
    *,
    prefix: str = "",
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> dict[str, str] | None:
    """Write a module's weights (its ``state_dict()``; ``prefix`` and the rest as :func:`write_safetensors_folder`
    takes them) into a Hugging Face weights folder, from the live module: after ``fit``, where
    ``save_pretrained`` cannot read ``offload_params``' sharded parameters (refused during a ZeRO-2 fit with a
    low-precision device copy, whose parameters are not the master weights). Each sharded tensor is gathered whole
    when its shard is written, one at a time: a collective, so call it on every rank; rank 0 writes and returns the
    ``weight_map``, the others None."""
    copied = [p for p in module.parameters() if (e := engine_training(p)) is not None and p.dtype != e.state.dtype]
    if copied:  # the ZeRO-2 mode during fit: the parameters are the device copy the forward uses
        raise CheckpointError(
            f"the module is training: its parameters are the {copied[0].dtype} device copy of the engine's "
            f"{engine_training(copied[0]).state.dtype} master weights. Call save_hugging_face after fit, or save a "
            "checkpoint (trainer.save_checkpoint on every rank) and export it: export_hugging_face(path, folder)"
        )
    state = module.state_dict()
    keys = {key.removeprefix(prefix): key for key in state if key.startswith(prefix)}
    if not keys:
        raise CheckpointError(
            f"no name of the module starts with prefix {prefix!r}; its first: {', '.join(state)[:200]}"
        )
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    writer = not distributed or dist.get_rank() == 0
    refusal = [None]
    if writer:
        try:
            check_folder(output_dir, overwrite)
        except CheckpointError as error:
            refusal = [str(error)]
    if distributed:  # every rank refuses, or none: the others would wait in the gathers
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise CheckpointError(refusal[0])
    unread = list(keys)  # the writer reads in this order; every rank gathers in it

    def whole(name: str) -> torch.Tensor:
        if name != unread.pop(0):
            raise RuntimeError(f"{name} read out of the module's order: the ranks' gathers would not match")
        tensor = state[keys[name]].detach()
        return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).cpu()

    try:
        if not writer:
            return None
        placeholders = {
            name: torch.empty(state[key].shape, dtype=state[key].dtype, device="meta") for name, key in keys.items()
        }
        return write_safetensors_folder(
            placeholders, whole, output_dir, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite
        )
    finally:  # the rest of the gathers (all of them on the other ranks; the writer's, if it failed)
        while unread:
            whole(unread[0])


def check_folder(output_dir: PathLike, overwrite: bool) -> list[str]:
    """The names of the weight files already in ``output_dir`` (which the export replaces); refused (a
    :class:`CheckpointError` naming the fix) where it is not a local folder or holds weights and not ``overwrite``."""
    if "://" in os.fspath(output_dir):
        raise CheckpointError(f"{os.fspath(output_dir)}: the Hugging Face export writes to a local folder only")
    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise CheckpointError(f"refusing to write into {folder}: it is a file, not a folder")
    old = sorted(p.name for p in folder.iterdir() if _WEIGHT_FILE.fullmatch(p.name)) if folder.is_dir() else []
    if old and not overwrite:
        raise CheckpointError(
            f"refusing to write into {folder}: it holds weights already ({', '.join(old)}); overwrite=True "
            "(--overwrite) replaces them and keeps the folder's other files"
        )
    return old


def _written(stored: torch.dtype, asked: torch.dtype) -> torch.dtype:
    """Floating-point tensors in the dtype asked for; integer buffers (step counters, position ids) as they are."""
    return asked if stored.is_floating_point else stored


def _plan(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Tensors in order into shards of at most ``limit`` bytes (a bigger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for key, size in sizes.items():
        if shards[-1] and filled + size > limit:
            shards.append([])
            filled = 0
        shards[-1].append(key)
        filled += size
    return shards


def _write_shard(temporary: Path, tensors: dict[str, torch.Tensor], read: Callable[[str], torch.Tensor]) -> None:
    """One safetensors file: an 8-byte little-endian header length, the JSON header (each tensor's dtype, shape
    and byte range after it), padded to 8 bytes, then each tensor's bytes in that order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(temporary, "xb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, placeholder in tensors.items():
            tensor = read(name)
            if tensor.shape != placeholder.shape:
                raise CheckpointError(f"{name}: read {tuple(tensor.shape)}, its shape is {tuple(placeholder.shape)}")
            f.write(tensor.to(placeholder.dtype).contiguous().reshape(-1).view(torch.uint8).numpy().data)
        os.fsync(f.fileno())


def _write_json(path: Path, content: dict) -> None:
    temporary = path.with_name(f"{_TEMPORARY}{path.name}")
    with open(temporary, "x") as f:
        json.dump(content, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def _bytes(size: int | str) -> int:
    """``save_pretrained``'s sizes: an int of bytes (a string of digits too: the command line's), or "5GB" (10**9),
    "5GiB" (2**30), "500MB", "200KB"."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", str(size), re.IGNORECASE)
    if not match or (match.group(2) is None and not match.group(1).isdigit()) or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a number of bytes or a size like '5GB' or '500MB', got {size!r}")
    if match.group(2) is None:
        return int(match.group(1))
    unit = match.group(2).upper()
    scale = (1024 if "I" in unit else 1000) ** ("KMGT".index(unit[0]) + 1)
    return int(float(match.group(1)) * scale)
