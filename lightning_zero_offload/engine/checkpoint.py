"""Checkpoint formats: crash-safe writes, the sharded directory format, and the fp32 export.

Sharded format (a directory, named like a checkpoint file):

```
epoch=3-step=400.ckpt/
  meta.pt           rank 0: the Lightning checkpoint minus the sharded tensors, plus "zero_offload":
                    world size, bucket table, per-parameter keys/shapes/offsets and Adam step counts
  shard_00000.pt    rank r: its flat fp32 master, exp_avg and exp_avg_sq (1/world of each)
  ...
```

Everything is plain tensors, lists and numbers (``torch.load(weights_only=True)``). Loading
assembles full per-parameter tensors by name, so a checkpoint resumes at any world size with no
conversion step; shard files are memory-mapped, so only the pages that are read are loaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from lightning_zero_offload.engine.engine import OffloadEngine

FORMAT_KEY = "zero_offload"
# Fabric checkpoints name their entries freely: this entry says which one holds the model's state dict
# (and, sharded, the optimizer's), e.g. {"model": "model", "optimizer": "optimizer"}.
FABRIC_KEY = "zero_offload_fabric"
META_FILE = "meta.pt"
PathLike = str | os.PathLike


def shard_file(rank: int) -> str:
    return f"shard_{rank:05d}.pt"


def atomic_save(obj: Any, path: PathLike) -> None:
    """Write ``obj`` next to ``path`` and rename it into place: a crash never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def staging_dir(path: PathLike) -> Path:
    """Where a sharded checkpoint is assembled before it replaces ``path`` (same filesystem)."""
    path = Path(path)
    return path.with_name(f".{path.name}.incomplete")


def publish_dir(staging: Path, path: PathLike) -> None:
    """Swap a complete checkpoint directory into place; the previous one is removed only afterwards."""
    path = Path(path)
    old = path.with_name(f".{path.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.replace(path, old)
    os.replace(staging, path)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def sharded_layout(engine: OffloadEngine, keys: list[list[str]]) -> dict[str, Any]:
    """What a loader needs to reassemble full tensors from the shards, at any world size."""
    layout = engine.layout
    return {
        "format": "sharded",
        "version": 1,
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


def is_sharded_checkpoint(path: PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def load_sharded(path: PathLike, with_optimizer: bool = True) -> dict[str, Any]:
    """Read a sharded checkpoint directory as an ordinary full Lightning checkpoint dict.

    ``state_dict`` gets the fp32 master weights and ``optimizer_states`` a torch AdamW state dict, so
    the rest of the loading path is the same as for the full format, whatever the world size now.
    """
    path = Path(path)
    checkpoint = torch.load(path / META_FILE, weights_only=True, map_location="cpu")
    info = checkpoint[FORMAT_KEY]
    if info.get("format") != "sharded":
        raise ValueError(f"{path} is not a zero_offload sharded checkpoint")
    world = info["world_size"]
    files = [path / shard_file(rank) for rank in range(world)]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"Sharded checkpoint {path} is incomplete: missing {missing}")
    shards = [torch.load(f, weights_only=True, map_location="cpu", mmap=True) for f in files]
    names = ("master", "exp_avg", "exp_avg_sq") if with_optimizer else ("master",)
    full: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    buckets = info["buckets"]
    for param in info["params"]:
        bucket = buckets[param["bucket"]]
        shape = torch.Size(param["shape"])
        for name in names:
            full[name].append(_assemble(shards, name, bucket, param["offset"], shape))

    state_dict = checkpoint.setdefault("state_dict", {})
    for param, weight in zip(info["params"], full["master"]):
        for key in param["keys"]:
            state_dict[key] = weight
    if with_optimizer:
        saved = checkpoint["optimizer_states"][0]
        state = {}
        for param, m, v in zip(info["params"], full["exp_avg"], full["exp_avg_sq"]):
            if param["step"] > 0:
                step = torch.tensor(float(param["step"]), dtype=torch.float32)
                state[param["torch_index"]] = {"step": step, "exp_avg": m, "exp_avg_sq": v}
        checkpoint["optimizer_states"] = [{"state": state, "param_groups": saved["param_groups"]}]
    return checkpoint


def _assemble(
    shards: list[dict[str, torch.Tensor]], name: str, bucket: dict[str, int], offset: int, shape: torch.Size
) -> torch.Tensor:
    """Cut one parameter out of a bucket whose chunk ``r`` lives in shard ``r``."""
    chunk, start = bucket["shard_numel"], bucket["shard_start"]
    out = torch.empty(shape.numel(), dtype=torch.float32)
    position = 0
    while position < shape.numel():
        global_index = offset + position  # index inside the padded bucket
        rank, inside = divmod(global_index, chunk)
        take = min(chunk - inside, shape.numel() - position)
        out[position : position + take] = shards[rank][name][start + inside : start + inside + take]
        position += take
    return out.view(shape)


def convert_checkpoint_to_fp32_state_dict(checkpoint_path: PathLike, output_path: PathLike | None = None) -> dict:
    """Write (and return) a plain fp32 ``state_dict`` for ``model.load_state_dict`` from either format."""
    if is_sharded_checkpoint(checkpoint_path):
        state_dict = load_sharded(checkpoint_path, with_optimizer=False)["state_dict"]
    else:
        checkpoint = torch.load(checkpoint_path, weights_only=True, map_location="cpu")
        state_dict = checkpoint[checkpoint.get(FABRIC_KEY, {}).get("model", "state_dict")]
    if output_path is not None:
        atomic_save(state_dict, output_path)
    return state_dict


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="zero-offload-convert",
        description="Export a zero_offload checkpoint (full file or sharded directory) to a plain fp32 state_dict.",
    )
    parser.add_argument("checkpoint_path", help="a .ckpt file or a sharded checkpoint directory")
    parser.add_argument("output_path", help="where to write the state_dict (torch.save format)")
    args = parser.parse_args(argv)
    state_dict = convert_checkpoint_to_fp32_state_dict(args.checkpoint_path, args.output_path)
    numel = sum(t.numel() for t in state_dict.values() if isinstance(t, torch.Tensor))
    print(f"wrote {len(state_dict)} tensors ({numel:,} elements) to {args.output_path}")
