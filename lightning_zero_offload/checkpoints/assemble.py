"""Full per-parameter tensors cut out of every rank's shard of a sharded checkpoint (checkpoints/sharded.py),
at any world size: rank ``r`` holds chunk ``r`` of every bucket, and a split parameter runs on from its first
bucket into the next ones (engine/step/layout.py)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_zero_offload.engine.step.cpu_state import DEVICE_PART


def assemble_params(
    shards: list[dict[str, torch.Tensor]], info: dict[str, Any], names: tuple[str, ...]
) -> dict[str, list[torch.Tensor]]:
    """Each parameter's full tensors (``names``: master, moments) from the shards of a sharded checkpoint whose
    metadata ``info`` places it; raises IndexError for a parameter placed outside its buckets."""
    full: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    buckets, world = info["buckets"], info["world_size"]
    for param in info["params"]:
        shape = torch.Size(param["shape"])
        first = param["bucket"]
        room = sum(b["shard_numel"] for b in buckets[first:]) * world - param["offset"]
        if not 0 <= first < len(buckets) or param["offset"] < 0 or shape.numel() > room:
            raise IndexError(f"parameter {param['keys']} lies outside its buckets")  # named by load_sharded
        for name in names:
            full[name].append(_assemble(shards, name, buckets[first:], param["offset"], shape))
    return full


def _assemble(
    shards: list[dict[str, torch.Tensor]], name: str, buckets: list[dict[str, int]], offset: int, shape: torch.Size
) -> torch.Tensor:
    """Cut one parameter out of the buckets from its first (a split parameter runs on into the next ones),
    where each bucket's chunk ``r`` lives in shard ``r``."""
    out = torch.empty(shape.numel(), dtype=shards[0][name].dtype)  # fp32, or bf16 from cpu_state="bf16"
    position, world = 0, len(shards)
    for bucket in buckets:
        chunk, start = bucket["shard_numel"], bucket["shard_start"]
        while position < shape.numel() and offset < chunk * world:  # offset: index inside the padded bucket
            rank, inside = divmod(offset, chunk)
            take = min(chunk - inside, shape.numel() - position)
            out[position : position + take] = _shard_part(shards[rank], name, start + inside, take)
            position += take
            offset += take
        if position == shape.numel():
            break
        offset -= chunk * world  # the parameter goes on at the start of the next bucket
    return out.view(shape)


def _shard_part(shard: dict[str, torch.Tensor], name: str, start: int, numel: int) -> torch.Tensor:
    """``numel`` elements of a shard tensor from ``start``, from its host part or its device part (a bucket's
    chunk lies in one of them)."""
    host = shard[name]
    if start < host.numel():
        return host[start : start + numel]
    return shard[name + DEVICE_PART][start - host.numel() : start - host.numel() + numel]
