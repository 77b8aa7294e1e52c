"""The streamed full save at several ranks: rank 0 writes the file while every other rank sends its part
of each gathered bucket as the writer reaches it, one bucket at a time.

The checkpoint dict holds placeholders (engine/save_sharing.py) for the gathered buckets of the master
weights and moments; :class:`BucketStream` is rank 0's side (the writer's ``StreamedStorages``),
:func:`serve_full_save` every other rank's. At one rank only a device share's buckets are placeholders
(:class:`OneRankBuckets`), so that the host never holds its master and both moments at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_zero_offload.checkpoints.files import CheckpointError
from lightning_zero_offload.engine.infra.collectives import all_reduce_sum, gather_host_to_first

if TYPE_CHECKING:
    from lightning_zero_offload.engine.save_sharing import Placeholders
    from lightning_zero_offload.engine.step.parts import ShardedState


class BucketStream:
    """Rank 0's side of a streamed full save: which storages are placeholders, and their bytes on demand.

    ``begin`` announces the placeholders in the order the file will hold them; each ``fetch`` is then
    one gather of one bucket (or of the buckets a split parameter joins) into the same reused buffer (valid
    until the next ``fetch``), so rank 0 holds at most the largest of those beyond its own state, and the
    others nothing.
    """

    def __init__(self, engine: ShardedState, broadcast: Callable[[Any], Any]) -> None:
        self.engine, self.broadcast = engine, broadcast
        self.registry = engine.save_sharing.placeholders
        self.order: list[int] | None = None  # announced and agreed, in file order
        self.announced = False
        self.done = 0
        self.buffer: torch.Tensor | None = None

    def number(self, storage: torch.UntypedStorage) -> int | None:
        """The placeholder number of ``storage``, ``None`` for a storage that holds its data."""
        return self.registry.number(storage)

    def begin(self, order: list[int]) -> None:
        self.announced = True
        self.broadcast(("plan", order))
        _check_plan(self.engine, self.registry, order)  # raises on every rank alike: nothing to finish
        self.order = order
        if order:  # bytes, viewed as each bucket's dtype
            self.buffer = torch.empty(max(_nbytes(self.registry, number) for number in order), dtype=torch.uint8)

    def fetch(self, number: int) -> torch.Tensor:
        """The gathered bucket behind placeholder ``number`` (the next one announced)."""
        assert self.order is not None and self.order[self.done] == number, "fetched out of the announced order"
        shard, shard_ranges, _ = self.registry.sources[number]
        assert self.buffer is not None
        whole = self.buffer[: _nbytes(self.registry, number)].view(shard.dtype)
        start, world = 0, dist.get_world_size(self.engine.process_group)
        for shard_range in shard_ranges:  # bucket by bucket, each rank's chunk straight into its place
            numel = (shard_range.stop - shard_range.start) * world
            output = whole[start : start + numel]
            gather_host_to_first(shard[shard_range], output, self.engine.process_group, self.engine.device)
            start += numel
        self.done += 1
        return whole

    def finish(self, error: BaseException | None) -> None:
        """Tell the other ranks how the save ended; after a failure, first take part in the gathers they
        still wait for (so that every rank returns, and raises the error)."""
        message = None if error is None else f"{type(error).__name__}: {error}"
        if not self.announced:
            self.broadcast(("failed", message or "the save ended before it began"))
            return
        if self.order is None:  # the ranks disagreed on the plan and all raised already
            return
        if error is not None:
            for number in self.order[self.done :]:
                self.fetch(number)
        self.broadcast(("failed", message) if error is not None else ("done", None))
        self.buffer = None


class OneRankBuckets:
    """One rank's streamed full save: each placeholder's buckets copied from the state (a device share's from the
    device) when the writer reaches them, into one reused buffer (valid until the next ``fetch``)."""

    def __init__(self, registry: Placeholders) -> None:
        self.registry = registry
        self.buffer: torch.Tensor | None = None

    def number(self, storage: torch.UntypedStorage) -> int | None:
        return self.registry.number(storage)

    def begin(self, order: list[int]) -> None:
        if order:
            self.buffer = torch.empty(max(_nbytes(self.registry, number) for number in order), dtype=torch.uint8)

    def fetch(self, number: int) -> torch.Tensor:
        shard, shard_ranges, _ = self.registry.sources[number]
        assert self.buffer is not None
        whole = self.buffer[: _nbytes(self.registry, number)].view(shard.dtype)
        start = 0
        for shard_range in shard_ranges:  # each bucket on its side of the share
            numel = shard_range.stop - shard_range.start
            whole[start : start + numel].copy_(shard[shard_range])
            start += numel
        return whole


def serve_full_save(engine: ShardedState, broadcast: Callable[[Any], Any], what: str) -> None:
    """A rank other than 0 in a streamed full save: send this rank's part of each bucket rank 0 asks for.

    Raises the error rank 0's save failed with, naming ``what`` was being saved.
    """
    registry = engine.save_sharing.placeholders
    kind, payload = broadcast(None)
    if kind == "failed":
        raise CheckpointError(f"saving {what} failed on rank 0: {payload}")
    _check_plan(engine, registry, payload)
    for number in payload:
        shard, shard_ranges, _ = registry.sources[number]
        for shard_range in shard_ranges:
            gather_host_to_first(shard[shard_range], None, engine.process_group, engine.device)
    kind, payload = broadcast(None)
    if kind == "failed":
        raise CheckpointError(f"saving {what} failed on rank 0: {payload}")


def _nbytes(registry: Placeholders, number: int) -> int:
    shard, _, numel = registry.sources[number]
    return numel * shard.dtype.itemsize


def _check_plan(engine: ShardedState, registry: Placeholders, order: list[int]) -> None:
    """Every rank holds every placeholder rank 0 will write (one small all-reduce), or every rank raises."""
    missing = sum(number not in registry.sources for number in order)
    total = all_reduce_sum(torch.tensor([float(missing)]), engine.process_group, engine.device)
    if total.item() > 0:
        raise CheckpointError(
            f"the ranks do not hold the same checkpoint: {int(total.item())} of the gathered buckets rank 0 would "
            "write are not held by the other ranks. Build the checkpoint on every rank and save it on every rank, "
            "as Trainer.save_checkpoint and fabric.save do"
        )
