"""How the engine's state goes into a full-format save: views or copies, and the placeholders of a
streamed save at several ranks (engine/state_dicts.py makes them, rank 0's writer fetches their bytes)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.shard_buffer import ShardBuffer


class Placeholders:
    """The bucket runs a full save will stream (at several ranks gathered, at one a device share's), by number and
    by meta storage.

    Every rank numbers its placeholders in the order ``engine.state.full_tensors`` makes them, which is the same
    on every rank (as the order of collectives is), so rank 0 can name a bucket by its number. An
    entry lives as long as its placeholder (a checkpoint dict that is dropped unsaved leaves nothing).
    """

    def __init__(self) -> None:
        # shard (a state buffer, or a flat tensor of the shard), this rank's chunk of each bucket of the run
        # (buckets joined by a split parameter: engine/step/layout.py), gathered numel
        self.sources: dict[int, tuple[ShardBuffer | torch.Tensor, list[slice], int]] = {}
        self.by_storage: dict[int, int] = {}
        self.count = 0

    def add(self, shard: ShardBuffer | torch.Tensor, shard_ranges: list[slice], world: int) -> torch.Tensor:
        numel = sum(r.stop - r.start for r in shard_ranges) * world
        whole = torch.empty(numel, dtype=shard.dtype, device="meta")
        number, storage = self.count, whole.untyped_storage()._cdata
        self.count += 1
        self.sources[number] = (shard, shard_ranges, numel)
        self.by_storage[storage] = number
        weakref.finalize(whole, self._forget, number, storage)  # views keep ``whole`` alive
        return whole

    def _forget(self, number: int, storage: int) -> None:
        self.sources.pop(number, None)
        if self.by_storage.get(storage) == number:  # the address may be a newer placeholder's by now
            del self.by_storage[storage]

    def number(self, storage: torch.UntypedStorage) -> int | None:
        return self.by_storage.get(storage._cdata) if storage.device.type == "meta" else None


class SaveSharing:
    """How the engine's state goes into a full save now: views instead of copies (inside
    ``engine.state.buffers_shared_for_save``), and at several ranks the placeholders the writer streams."""

    def __init__(self) -> None:
        self.share = False
        self.streamed = False  # for this package's writer: at one rank a device share's buckets are placeholders too
        self.placeholders = Placeholders()
