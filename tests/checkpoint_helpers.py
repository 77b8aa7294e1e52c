"""Small checkpoints written and read at one rank: shared by the tests of tests/checkpoints/."""

import torch

from lightning_zero_offload import checkpoints as ckpt
from lightning_zero_offload import convert_checkpoint_to_fp32_state_dict
from lightning_zero_offload.checkpoints import FORMAT_KEY
from lightning_zero_offload.checkpoints import sharded as checkpoint_sharded


def full_checkpoint(value: float) -> dict:
    return {"state_dict": {"w": torch.full((5,), value)}, "optimizer_states": [{"state": {}, "param_groups": []}]}


def save_sharded_one_rank(path, value: float, world: int = 1) -> None:
    """A world-size-``world`` sharded checkpoint of one parameter ``w`` (5 values) in one bucket, saved from
    this process as every rank in turn would (only rank 0's collectives matter with trivial ones)."""
    chunk = -(-5 // world)
    flat = torch.cat([torch.full((5,), value), torch.zeros(chunk * world - 5)])
    meta = full_checkpoint(value)
    meta.pop("state_dict")
    meta[FORMAT_KEY] = {
        "format": "sharded",
        "version": 2,
        "world_size": world,
        "buckets": [{"shard_start": 0, "shard_numel": chunk}],
        "params": [{"keys": ["w"], "shape": [5], "bucket": 0, "offset": 0, "step": 1, "torch_index": 0}],
    }
    assert world == 1, "one process plays rank 0 only"
    shard = {name: flat.clone() for name in checkpoint_sharded.SHARD_KEYS}
    ckpt.save_sharded(path, shard, meta, 0, broadcast=lambda x: x, gather=lambda x: [x])


def save(fmt: str, path, value: float) -> None:
    if fmt == "full":
        ckpt.atomic_save(full_checkpoint(value), path)
    else:
        save_sharded_one_rank(path, value)


def load_w(path) -> torch.Tensor:
    return convert_checkpoint_to_fp32_state_dict(path)["w"]
