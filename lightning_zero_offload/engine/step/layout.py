"""Where every trainable element lives: flat order, buckets, and this rank's shard of each bucket.

The layout is the one piece of bookkeeping shared by gradient streaming, the CPU step, the copy-back
and checkpoints, so it is computed once, from the parameters alone, and never changes during a fit.

- Parameters are laid out in *reverse* registration order, because backward produces gradients
  roughly from the last layer to the first: a bucket then fills, and can leave the device, early.
- A bucket is a contiguous run of parameters of at most ``bucket_numel`` elements. A larger parameter is
  split: it starts a bucket, fills whole buckets of ``bucket_numel`` rounded down to a multiple of the world
  size, and its remainder opens the next bucket, which later parameters may join. So no bucket's transfer or
  CPU step is bigger than the bucket size (an embedding's step pipelines part by part), and a parameter's
  elements stay contiguous in the flat device buffer (padding only ever follows a bucket's last element).
  A bucket's length is padded to a multiple of the world size so that reduce-scatter and all-gather see
  equal chunks on every rank.
- Rank ``r`` owns chunk ``r`` of every bucket. Its CPU state is the concatenation of its chunks, so
  each rank holds ``1/world`` of the optimizer state and every collective is one call per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

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


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in one bucket (the whole parameter unless it is split)."""

    param_index: int
    bucket_offset: int  # where it starts inside the bucket
    param_start: int  # where it starts inside the flattened parameter
    numel: int

    @property
    def bucket_range(self) -> slice:
        return slice(self.bucket_offset, self.bucket_offset + self.numel)

    @property
    def param_range(self) -> slice:
        return slice(self.param_start, self.param_start + self.numel)


@dataclass
class Bucket:
    """One unit of gradient transfer and of parameter copy-back."""

    index: int
    pieces: list[Piece]
    flat_start: int  # offset of the bucket in the (padded) flat device buffer
    numel: int  # real elements
    padded_numel: int  # multiple of world size
    shard_numel: int  # padded_numel // world: the chunk each rank owns
    shard_start: int  # offset of this rank's chunk in the rank's flat CPU buffers
    segments: list[Segment] = field(default_factory=list)  # this rank's chunk, per parameter

    @property
    def shard_range(self) -> slice:
        return slice(self.shard_start, self.shard_start + self.shard_numel)

    @property
    def param_indices(self) -> list[int]:
        """The parameters with a piece in this bucket."""
        return [piece.param_index for piece in self.pieces]


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat device buffer: buckets ``bucket`` to ``last_bucket`` (one unless it
    is split), from ``bucket_offset`` inside the first."""

    index: int
    shape: torch.Size
    bucket: int
    flat_start: int  # offset in the flat device buffer
    bucket_offset: int  # offset inside its first bucket
    last_bucket: int

    @property
    def buckets(self) -> range:
        return range(self.bucket, self.last_bucket + 1)

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

    def pieces_of(self, index: int) -> list[tuple[Bucket, Piece]]:
        """Parameter ``index``'s pieces, each with its bucket, in flat order."""
        return self._pieces_by_param[index]

    @cached_property
    def _pieces_by_param(self) -> list[list[tuple[Bucket, Piece]]]:
        found: list[list[tuple[Bucket, Piece]]] = [[] for _ in self.slots]
        for bucket in self.buckets:
            for piece in bucket.pieces:
                found[piece.param_index].append((bucket, piece))
        return found

    def segments_of(self, index: int) -> list[Segment]:
        """This rank's runs of parameter ``index``, over every bucket it lies in."""
        return [seg for b in self.slots[index].buckets for seg in self.buckets[b].segments if seg.param_index == index]

    def bucket_runs(self) -> list[range]:
        """The buckets in maximal runs joined by split parameters: a run's gathered chunks, concatenated, hold
        whole parameters."""
        runs: list[range] = []
        for bucket in self.buckets:
            first = self.slots[bucket.pieces[0].param_index].bucket if bucket.pieces else bucket.index
            if runs and first < bucket.index:
                runs[-1] = range(runs[-1].start, bucket.index + 1)
            else:
                runs.append(range(bucket.index, bucket.index + 1))
        return runs


def build_layout(shapes: Sequence[torch.Size], bucket_numel: int, world_size: int = 1, rank: int = 0) -> Layout:
    """Lay out parameters of the given shapes (in registration order) into buckets and shards."""
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")

    # Each bucket as its pieces: (parameter, start inside the parameter, numel).
    groups: list[list[tuple[int, int, int]]] = [[]]
    filled = 0
    split_numel = max(world_size, bucket_numel // world_size * world_size)
    for index in reversed(range(len(shapes))):
        numel = shapes[index].numel()
        if groups[-1] and filled + numel > bucket_numel:
            groups.append([])
            filled = 0
        start = 0
        while numel - start > max(bucket_numel, split_numel):  # in an empty bucket: a split parameter starts one
            groups[-1].append((index, start, split_numel))
            groups.append([])
            start += split_numel
        groups[-1].append((index, start, numel - start))
        filled += numel - start
    if not groups[-1]:
        groups.pop()

    first_bucket: dict[int, tuple[int, int]] = {}  # parameter -> (its first bucket, flat offset)
    last_bucket: dict[int, int] = {}
    buckets: list[Bucket] = []
    flat_start = shard_start = 0
    for bucket_index, group in enumerate(groups):
        pieces, offset = [], 0
        for index, param_start, numel in group:
            pieces.append(Piece(index, offset, param_start, numel))
            first_bucket.setdefault(index, (bucket_index, flat_start + offset))
            last_bucket[index] = bucket_index
            offset += numel
        padded = -(-offset // world_size) * world_size
        bucket = Bucket(
            index=bucket_index,
            pieces=pieces,
            flat_start=flat_start,
            numel=offset,
            padded_numel=padded,
            shard_numel=padded // world_size,
            shard_start=shard_start,
        )
        bucket.segments = _segments(bucket, rank)
        buckets.append(bucket)
        flat_start += padded
        shard_start += bucket.shard_numel

    slots = []
    for index, shape in enumerate(shapes):
        bucket_index, flat = first_bucket[index]
        offset = flat - buckets[bucket_index].flat_start
        slots.append(ParamSlot(index, torch.Size(shape), bucket_index, flat, offset, last_bucket[index]))
    return Layout(
        slots=slots,
        buckets=buckets,
        world_size=world_size,
        rank=rank,
        flat_numel=flat_start,
        shard_numel=shard_start,
    )


def _segments(bucket: Bucket, rank: int) -> list[Segment]:
    """Intersect this rank's chunk of the bucket with each piece in it."""
    chunk_start = rank * bucket.shard_numel
    chunk_end = chunk_start + bucket.shard_numel
    segments = []
    for piece in bucket.pieces:
        start = max(piece.bucket_offset, chunk_start)
        end = min(piece.bucket_offset + piece.numel, chunk_end)
        if start < end:
            segments.append(
                Segment(
                    param_index=piece.param_index,
                    shard_start=bucket.shard_start + start - chunk_start,
                    shard_end=bucket.shard_start + end - chunk_start,
                    param_start=piece.param_start + start - piece.bucket_offset,
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
