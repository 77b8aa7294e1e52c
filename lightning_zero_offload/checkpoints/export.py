"""The exports, from any of the formats (full, sharded, and the sharded one of ``offload_params=True``, streamed
tensor by tensor): a plain fp32 ``state_dict`` for ``model.load_state_dict``, or a Hugging Face weights folder
(checkpoints/hugging_face.py); and their command line (``zero-offload-convert``)."""

from __future__ import annotations

import argparse
import os

import torch

from lightning_zero_offload.checkpoints.distributed import (
    export_fp32,
    is_distributed_checkpoint,
    load_sharded_full,
    model_placeholders,
)
from lightning_zero_offload.checkpoints.files import CheckpointError, PathLike
from lightning_zero_offload.checkpoints.full import atomic_save, load_checkpoint_file
from lightning_zero_offload.checkpoints.hugging_face import check_folder, write_safetensors_folder
from lightning_zero_offload.checkpoints.keys import FABRIC_KEY
from lightning_zero_offload.checkpoints.sharded import is_sharded_checkpoint, load_sharded

__all__ = ["convert_checkpoint_to_fp32_state_dict", "export_hugging_face", "main"]


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
    state_dict = _widened(_module_state(checkpoint_path))
    if output_path is not None:
        atomic_save(state_dict, output_path)
    return state_dict


def _module_state(checkpoint_path: PathLike) -> dict:
    """The module's state dict of a full or ZeRO-2 sharded checkpoint, as saved (a full file memory-mapped)."""
    if is_sharded_checkpoint(checkpoint_path):  # meta.pt uses the Trainer's keys, also when Fabric saved it
        checkpoint, model_key = load_sharded(checkpoint_path, with_optimizer=False), "state_dict"
    else:
        checkpoint = load_checkpoint_file(checkpoint_path)
        model_key = checkpoint.get(FABRIC_KEY, {}).get("model", "state_dict")
    if not isinstance(checkpoint.get(model_key), dict):
        raise CheckpointError(f"{checkpoint_path} is not a Lightning checkpoint (it has no {model_key!r})")
    return checkpoint[model_key]


def export_hugging_face(
    checkpoint_path: PathLike,
    output_dir: PathLike,
    *,
    prefix: str = "",
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> dict[str, str]:
    """Write the checkpoint's module weights into ``output_dir`` as ``save_pretrained`` does (``model.safetensors``,
    or numbered shards of at most ``max_shard_size`` and ``model.safetensors.index.json``); return the
    ``weight_map``, each written name and its file.

    ``prefix``: the names under it, without it, are written (the rest left out): ``"model."`` for a LightningModule
    holding the Hugging Face model as ``self.model``. ``dtype``: floating-point weights are written in it (the fp32
    master weights by default; ``torch.bfloat16`` halves the files). A checkpoint of ``offload_params=True`` is
    read one tensor at a time, a full file memory-mapped, a ZeRO-2 sharded one whole, each cast as written. The
    folder's other files (``config.json``, a tokenizer) are kept; weights already there are replaced only with
    ``overwrite=True``.
    """
    check_folder(output_dir, overwrite)  # before reading anything
    if is_sharded_checkpoint(output_dir) or _same_file(checkpoint_path, output_dir):
        raise CheckpointError(f"refusing to write into {os.fspath(output_dir)}: it is a checkpoint; name a new folder")
    if is_distributed_checkpoint(checkpoint_path):
        placeholders, stream = model_placeholders(checkpoint_path)

        def read(key: str) -> torch.Tensor:
            return stream.fetch(stream.number(placeholders[key].untyped_storage()))

    else:  # cast tensor by tensor as written: a full file's memory-mapped bf16 weights are never widened whole
        state_dict = _module_state(checkpoint_path)
        others = [key for key, value in state_dict.items() if not isinstance(value, torch.Tensor)]
        if others:
            raise CheckpointError(
                f"{checkpoint_path}: {', '.join(others)} not tensors (safetensors holds only tensors)"
            )
        placeholders, read = {key: value.to("meta") for key, value in state_dict.items()}, state_dict.__getitem__
    keys = {key.removeprefix(prefix): key for key in placeholders if key.startswith(prefix)}
    if not keys:
        raise CheckpointError(
            f"no name in {os.fspath(checkpoint_path)} starts with prefix {prefix!r}; its first names: "
            f"{', '.join(list(placeholders)[:4])}"
        )
    return write_safetensors_folder(
        {name: placeholders[key] for name, key in keys.items()},
        lambda name: read(keys[name]),
        output_dir,
        dtype=dtype,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
    )


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


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="zero-offload-convert",
        description="Export a zero_offload checkpoint (full file or sharded directory) to a plain fp32 state_dict, "
        "or with --safetensors to a Hugging Face weights folder.",
    )
    parser.add_argument("checkpoint_path", help="a .ckpt file or a sharded checkpoint directory")
    parser.add_argument(
        "output_path", help="where to write the state_dict (torch.save format), or the folder with --safetensors"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace output_path even if it is a training checkpoint (with --safetensors: the folder's weights)",
    )
    hugging_face = parser.add_argument_group("--safetensors: a Hugging Face weights folder, as save_pretrained writes")
    hugging_face.add_argument("--safetensors", action="store_true", help="write safetensors files into output_path")
    hugging_face.add_argument(
        "--prefix", default="", help="write the names under this prefix, without it (model. for self.model)"
    )
    hugging_face.add_argument("--dtype", choices=list(_DTYPES), default="float32", help="of the floating-point weights")
    hugging_face.add_argument("--max-shard-size", default="5GB", help="bytes per file, as 5GB or 500MB (default 5GB)")
    args = parser.parse_args(argv)
    if not args.safetensors:
        given = [f for f, v in (("--prefix", args.prefix), ("--max-shard-size", args.max_shard_size != "5GB")) if v]
        if given or args.dtype != "float32":
            parser.error(f"{', '.join(given) or '--dtype'} applies to --safetensors exports only")
        refusal = _refuse_output(args.checkpoint_path, args.output_path, args.overwrite, "--overwrite")
        if refusal is not None:  # checked here too, so that the flag the message names is the CLI's own
            parser.exit(2, f"zero-offload-convert: error: refusing to write {args.output_path}: {refusal}\n")
    try:
        if args.safetensors:
            options = {"prefix": args.prefix, "dtype": _DTYPES[args.dtype], "max_shard_size": args.max_shard_size}
            weight_map = export_hugging_face(
                args.checkpoint_path, args.output_path, **options, overwrite=args.overwrite
            )
        else:
            state_dict = convert_checkpoint_to_fp32_state_dict(args.checkpoint_path, args.output_path, args.overwrite)
    except (CheckpointError, OSError, ValueError) as error:
        parser.exit(1, f"zero-offload-convert: error: {error}\n")
    if args.safetensors:
        files = sorted(set(weight_map.values()))
        names = ", ".join(list(weight_map)[:3])
        print(f"wrote {len(weight_map)} tensors in {len(files)} file(s) to {args.output_path} ({names}, ...)")
        return
    numel = sum(t.numel() for t in state_dict.values() if isinstance(t, torch.Tensor))
    print(f"wrote {len(state_dict)} tensors ({numel:,} elements) to {args.output_path}")
