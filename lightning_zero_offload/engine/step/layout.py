"""Where every trainable element lives: flat order, buckets, and this rank's shard of each bucket.

The layout is the one piece of bookkeeping shared by gradient streaming, the CPU step, the copy-back
and checkpoints, so it is computed once, from the parameters alone, and never changes during a fit.

- Parameters are laid out in *reverse* registration order, because backward produces gradients
  roughly from the last layer to the first: a bucket then fills, and can leave the device, early.
- A bucket is a contiguous run of whole parameters of at most ``bucket_numel`` elements (a larger
  parameter gets a bucket of its own). Its length is padded to a multiple of the world size so that
  reduce-scatter and all-gather see equal chunks on every rank.
- Rank ``r`` owns chunk ``r`` of every bucket. Its CPU state is the concatenation of its chunks, so
  each rank holds ``1/world`` of the optimizer state and every collective is one call per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segment:
    """A run of this rank's shard that belongs to one parameter.

    ``shard_start``/``shard_end`` index the rank's flat CPU buffers; ``param_start`` is where the run
    starts inside the flattened parameter.
    """

    param_index: int
    shard_start: int
    shard_end: int
    param_start: int

    @property
    def numel(self) -> int:
        return self.shard_end - self.shard_start


@dataclass
class Bucket:
    """One unit of gradient transfer and of parameter copy-back."""

    index: int
    param_indices: list[int]
    flat_start: int  # offset of the bucket in the (padded) flat device buffer
    numel: int  # real elements
    padded_numel: int  # multiple of world size
    shard_numel: int  # padded_numel // world: the chunk each rank owns
    shard_start: int  # offset of this rank's chunk in the rank's flat CPU buffers
    segments: list[Segment] = field(default_factory=list)  # this rank's chunk, per parameter

    @property
    def shard_range(self) -> slice:
        return slice(self.shard_start, self.shard_start + self.shard_numel)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat device buffer."""

    index: int
    shape: torch.Size
    bucket: int
    flat_start: int  # offset in the flat device buffer
    bucket_offset: int  # offset inside its bucket

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class Layout:
    slots: list[ParamSlot]
    buckets: list[Bucket]
    world_size: int
    rank: int
    flat_numel: int  # padded length of the flat device buffer (sum of padded bucket lengths)
    shard_numel: int  # length of this rank's flat CPU buffers

    def slot_range(self, index: int) -> slice:
        slot = self.slots[index]
        return slice(slot.flat_start, slot.flat_start + slot.numel)


def build_layout(shapes: Sequence[torch.Size], bucket_numel: int, world_size: int = 1, rank: int = 0) -> Layout:
    """Lay out parameters of the given shapes (in registration order) into buckets and shards."""
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")

    order = list(reversed(range(len(shapes))))
    groups: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for index in order:
        numel = shapes[index].numel()
        if current and current_numel + numel > bucket_numel:
            groups.append(current)
            current, current_numel = [], 0
        current.append(index)
        current_numel += numel
    if current:
        groups.append(current)

    slots: list[ParamSlot | None] = [None] * len(shapes)
    buckets: list[Bucket] = []
    flat_start = shard_start = 0
    for bucket_index, indices in enumerate(groups):
        offset = 0
        for index in indices:
            slots[index] = ParamSlot(index, torch.Size(shapes[index]), bucket_index, flat_start + offset, offset)
            offset += shapes[index].numel()
        padded = -(-offset // world_size) * world_size
        bucket = Bucket(
            index=bucket_index,
            param_indices=indices,
            flat_start=flat_start,
            numel=offset,
            padded_numel=padded,
            shard_numel=padded // world_size,
            shard_start=shard_start,
        )
        bucket.segments = _segments(bucket, slots, rank)
        buckets.append(bucket)
        flat_start += padded
        shard_start += bucket.shard_numel

    return Layout(
        slots=[slot for slot in slots if slot is not None],
        buckets=buckets,
        world_size=world_size,
        rank=rank,
        flat_numel=flat_start,
        shard_numel=shard_start,
    )


def _segments(bucket: Bucket, slots: Sequence[ParamSlot | None], rank: int) -> list[Segment]:
    """Intersect this rank's chunk of the bucket with each parameter's range in it."""
    chunk_start = rank * bucket.shard_numel
    chunk_end = chunk_start + bucket.shard_numel
    segments = []
    for index in bucket.param_indices:
        slot = slots[index]
        assert slot is not None
        start = max(slot.bucket_offset, chunk_start)
        end = min(slot.bucket_offset + slot.numel, chunk_end)
        if start < end:
            segments.append(
                Segment(
                    param_index=index,
                    shard_start=bucket.shard_start + start - chunk_start,
                    shard_end=bucket.shard_start + end - chunk_start,
                    param_start=start - slot.bucket_offset,
                )
            )
    return segments


def count_within_share(sizes: Sequence[int], share: float) -> int:
    """How many of ``sizes``, taken in order, hold at most ``share`` of their sum: the device share's rule for
    ZeRO-2 buckets and FSDP2 units alike (each given in the order its gradients arrive last), whole ones only."""
    budget, taken = share * sum(sizes), 0
    for count, size in enumerate(sizes):
        if taken + size > budget:
            return count
        taken += size
    return len(sizes)
