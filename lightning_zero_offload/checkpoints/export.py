"""The fp32 export: a plain ``state_dict`` for ``model.load_state_dict`` from any of the formats (full, sharded,
and the sharded one of ``offload_params=True``, streamed tensor by tensor), and its command line
(``zero-offload-convert``)."""

from __future__ import annotations

import argparse
import os

import torch

from lightning_zero_offload.checkpoints.distributed import export_fp32, is_distributed_checkpoint, load_sharded_full
from lightning_zero_offload.checkpoints.files import CheckpointError, PathLike
from lightning_zero_offload.checkpoints.full import atomic_save, load_checkpoint_file
from lightning_zero_offload.checkpoints.keys import FABRIC_KEY
from lightning_zero_offload.checkpoints.sharded import is_sharded_checkpoint, load_sharded

__all__ = ["convert_checkpoint_to_fp32_state_dict", "main"]


def convert_checkpoint_to_fp32_state_dict(
    checkpoint_path: PathLike, output_path: PathLike | None = None, overwrite: bool = False
) -> dict:
    """Write (and return) a plain fp32 ``state_dict`` for ``model.load_state_dict`` from any format.

    A checkpoint of ``offload_params=True`` is written one tensor at a time and returned memory-mapped from the
    written file, so the whole model is never in memory (without ``output_path`` it is built in memory).

    Refuses, as ``zero-offload-convert`` does and with the same message, to write over the checkpoint
    itself (also through a symlink or another spelling of its path), over a directory, or over an
    existing training checkpoint or other file that is not an earlier export unless ``overwrite=True``.
    """
    if output_path is not None:
        refusal = _refuse_output(os.fspath(checkpoint_path), os.fspath(output_path), overwrite, "overwrite=True")
        if refusal is not None:
            raise CheckpointError(f"refusing to write {os.fspath(output_path)}: {refusal}")
    if is_distributed_checkpoint(checkpoint_path):  # offload_params=True: streamed, one tensor at a time
        if output_path is None:
            return _widened(load_sharded_full(checkpoint_path)["state_dict"])
        export_fp32(checkpoint_path, output_path)
        return torch.load(output_path, map_location="cpu", weights_only=True, mmap=True)
    if is_sharded_checkpoint(checkpoint_path):  # meta.pt uses the Trainer's keys, also when Fabric saved it
        checkpoint, model_key = load_sharded(checkpoint_path, with_optimizer=False), "state_dict"
    else:
        checkpoint = load_checkpoint_file(checkpoint_path)
        model_key = checkpoint.get(FABRIC_KEY, {}).get("model", "state_dict")
    if not isinstance(checkpoint.get(model_key), dict):
        raise CheckpointError(f"{checkpoint_path} is not a Lightning checkpoint (it has no {model_key!r})")
    state_dict = _widened(checkpoint[model_key])
    if output_path is not None:
        atomic_save(state_dict, output_path)
    return state_dict


def _widened(state_dict: dict) -> dict:
    """A cpu_state="bf16" run saves its bf16 master weights as they are; the export widens them (exactly)."""
    return {
        key: value.float() if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 else value
        for key, value in state_dict.items()
    }


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
