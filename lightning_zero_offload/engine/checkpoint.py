"""Checkpoint formats: the layout a sharded save records, the fp32 export and its command line.

The bytes themselves are written and read by :mod:`.checkpoint_files` (local disk or fsspec, atomic,
checksummed) and :mod:`.checkpoint_sharded` (the versioned directory format). Everything is plain
tensors, lists and numbers (``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from lightning_zero_offload.engine.checkpoint_files import (
    CheckpointError,
    Location,
    PathLike,
    load_file,
    save_file,
)
from lightning_zero_offload.engine.checkpoint_sharded import (
    FORMAT_KEY,
    META_FILE,
    DirectoryKind,
    current_version,
    directory_kind,
    is_sharded_checkpoint,
    load_sharded,
    save_sharded,
    shard_file,
)
from lightning_zero_offload.engine.checkpoint_writer import StreamedStorages
from lightning_zero_offload.engine.engine import OffloadEngine

# Fabric checkpoints name their entries freely: this entry says which one holds the model's state dict
# (and, sharded, the optimizer's), e.g. {"model": "model", "optimizer": "optimizer"}.
FABRIC_KEY = "zero_offload_fabric"

__all__ = [
    "FABRIC_KEY",
    "FORMAT_KEY",
    "META_FILE",
    "CheckpointError",
    "atomic_save",
    "convert_checkpoint_to_fp32_state_dict",
    "current_version",
    "is_sharded_checkpoint",
    "load_checkpoint_file",
    "load_sharded",
    "save_sharded",
    "shard_file",
    "sharded_layout",
]


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


def sharded_layout(engine: OffloadEngine, keys: list[list[str]]) -> dict[str, Any]:
    """What a loader needs to reassemble full tensors from the shards, at any world size."""
    layout = engine.layout
    return {
        "format": "sharded",
        "version": 2,
        "world_size": layout.world_size,
        "buckets": [{"shard_start": b.shard_start, "shard_numel": b.shard_numel} for b in layout.buckets],
        "params": [
            {
                "keys": keys[slot.index],
                "shape": list(slot.shape),
                "bucket": slot.bucket,
                "offset": slot.bucket_offset,
                "step": engine.steps[slot.index],
                "torch_index": engine.torch_index[slot.index],
            }
            for slot in layout.slots
        ],
    }


def convert_checkpoint_to_fp32_state_dict(
    checkpoint_path: PathLike, output_path: PathLike | None = None, overwrite: bool = False
) -> dict:
    """Write (and return) a plain fp32 ``state_dict`` for ``model.load_state_dict`` from either format.

    Refuses, as ``zero-offload-convert`` does and with the same message, to write over the checkpoint
    itself (also through a symlink or another spelling of its path), over a directory, or over an
    existing training checkpoint or other file that is not an earlier export unless ``overwrite=True``.
    """
    if output_path is not None:
        refusal = _refuse_output(os.fspath(checkpoint_path), os.fspath(output_path), overwrite, "overwrite=True")
        if refusal is not None:
            raise CheckpointError(f"refusing to write {os.fspath(output_path)}: {refusal}")
    if is_sharded_checkpoint(checkpoint_path):  # meta.pt uses the Trainer's keys, also when Fabric saved it
        checkpoint, model_key = load_sharded(checkpoint_path, with_optimizer=False), "state_dict"
    else:
        checkpoint = load_checkpoint_file(checkpoint_path)
        model_key = checkpoint.get(FABRIC_KEY, {}).get("model", "state_dict")
    if not isinstance(checkpoint.get(model_key), dict):
        raise CheckpointError(f"{checkpoint_path} is not a Lightning checkpoint (it has no {model_key!r})")
    # A cpu_state="bf16" run saves its bf16 master weights as they are; the export widens them (exactly).
    state_dict = {
        key: value.float() if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else value
        for key, value in checkpoint[model_key].items()
    }
    if output_path is not None:
        atomic_save(state_dict, output_path)
    return state_dict


def _same_file(a: PathLike, b: PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _refuse_output(checkpoint_path: str, output_path: str, overwrite: bool, override: str) -> str | None:
    """Why writing ``output_path`` would destroy something, or ``None``; ``override`` names the way out."""
    if "://" in checkpoint_path or "://" in output_path:
        if checkpoint_path.rstrip("/") == output_path.rstrip("/"):
            return "the output path is the checkpoint itself"
        return None
    if _same_file(checkpoint_path, output_path):
        return "the output path is the checkpoint itself"
    if overwrite or not os.path.lexists(output_path):
        return None
    if is_sharded_checkpoint(output_path) or os.path.isdir(output_path):
        return f"{output_path} is a directory (a sharded training checkpoint?)"
    try:
        existing = torch.load(output_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        existing = None
    if isinstance(existing, dict) and ("optimizer_states" in existing or "loops" in existing):
        return f"{output_path} is a training checkpoint (it has optimizer or loop state); {override} replaces it"
    if isinstance(existing, dict) and all(isinstance(v, torch.Tensor) for v in existing.values()):
        return None  # an earlier export
    return f"{output_path} exists and is not an fp32 state dict (a training checkpoint?); {override} replaces it"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="zero-offload-convert",
        description="Export a zero_offload checkpoint (full file or sharded directory) to a plain fp32 state_dict.",
    )
    parser.add_argument("checkpoint_path", help="a .ckpt file or a sharded checkpoint directory")
    parser.add_argument("output_path", help="where to write the state_dict (torch.save format)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace output_path even if it is an existing training checkpoint"
    )
    args = parser.parse_args(argv)
    refusal = _refuse_output(args.checkpoint_path, args.output_path, args.overwrite, "--overwrite")
    if refusal is not None:  # checked here too, so that the flag the message names is the CLI's own
        parser.exit(2, f"zero-offload-convert: error: refusing to write {args.output_path}: {refusal}\n")
    try:
        state_dict = convert_checkpoint_to_fp32_state_dict(args.checkpoint_path, args.output_path, args.overwrite)
    except CheckpointError as error:
        parser.exit(1, f"zero-offload-convert: error: {error}\n")
    except OSError as error:
        parser.exit(1, f"zero-offload-convert: error: {error}\n")
    numel = sum(t.numel() for t in state_dict.values() if isinstance(t, torch.Tensor))
    print(f"wrote {len(state_dict)} tensors ({numel:,} elements) to {args.output_path}")
