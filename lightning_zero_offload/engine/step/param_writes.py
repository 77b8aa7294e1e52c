"""Writes to the device parameters made outside the engine, found and carried into the master weights.

User code writes parameters between steps: a callback clamping weights (max-norm, WGAN clipping),
weight averaging copying the average in at the end of fit, ``load_state_dict``, ``p.data = ...``.
The engine's master weights would overwrite such a write at the next publish, so before the master is
used (each backward, each step, a checkpoint, teardown) the engine asks this watch what changed:

- a parameter whose ``.data`` was replaced: its new value is copied into its place in the flat device
  buffer and it becomes a view of that buffer again;
- every bucket's contents: a checksum of the device buffer (:func:`kernels.fingerprint16`, one read of
  the low-precision copy, no host copy) taken right after each publish is compared with the current one.
  Version counters alone would miss ``p.data.copy_(...)``, which bumps none of them.

Only a bucket whose checksum changed is copied to the host and compared element by element with what
was published; the written elements become the new master values (in low precision, the value written).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.infra.ledger import DEVICE, MemoryLedger, current_ledger
from lightning_zero_offload.engine.step.layout import Bucket, Layout

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.shard_buffer import ShardBuffer

_WORDS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


class ParamWriteWatch:
    """Knows what the engine last wrote into the device parameters, and finds writes made since."""

    def __init__(
        self,
        layout: Layout,
        params: list[torch.nn.Parameter],
        flat_params: torch.Tensor,
        checksums: bool,
        master_dtype: torch.dtype | None = None,
    ):
        self.layout = layout
        # A master narrower than the device copy (bf16 state under fp32 parameters) keeps a written value
        # rounded: the device takes the same rounding, so forward, checkpoints and resumes agree.
        narrower = master_dtype is not None and master_dtype.itemsize < flat_params.dtype.itemsize
        self._rounding = master_dtype if narrower else None
        self.params = params
        self.flat_params = flat_params
        self._views = [flat_params[layout.slot_range(i)].view(slot.shape) for i, slot in enumerate(layout.slots)]
        self._pointers = [view.data_ptr() for view in self._views]
        # Every bucket's checksum in one device tensor (a 0-dim tensor each took an allocator block apiece on
        # CUDA: 512 bytes, not the 8 the ledger books); a bucket not recorded yet differs from anything. None in
        # place: the parameters are the master, only reassignment matters.
        self._prints = flat_params.new_zeros(len(layout.buckets), dtype=torch.int64) if checksums else None
        self._recorded = [False] * len(layout.buckets)
        self.record_in(current_ledger())

    def record_in(self, ledger: MemoryLedger | None) -> None:
        """Count the checksums in ``ledger``: one 8-byte checksum per bucket, where the device copy is."""
        if ledger is not None and self._prints is not None:
            ledger.add(DEVICE, "checksums", 8 * len(self.layout.buckets))

    def _bucket_words(self, bucket: Bucket) -> torch.Tensor:
        flat = self.flat_params[bucket.flat_start : bucket.flat_start + bucket.padded_numel]
        return flat.view(torch.int16)

    @property
    def rounds(self) -> bool:
        """Whether a written value is rounded to the master's (narrower) dtype when it is merged."""
        return self._rounding is not None

    def record(self, bucket: Bucket) -> None:
        """The engine just wrote ``bucket`` (queued on the current stream: the checksum is queued after it)."""
        if self._prints is not None:
            self._prints[bucket.index] = kernels.fingerprint16(self._bucket_words(bucket))
            self._recorded[bucket.index] = True

    def record_all(self) -> None:
        for bucket in self.layout.buckets:
            self.record(bucket)

    def drop(self) -> None:
        """The parameters left the flat buffer (close, or a re-plan's new one): hold none of it."""
        self.flat_params = self.flat_params.new_empty(0)
        self._views = []

    def reattach(self) -> list[int]:
        """Put parameters whose ``.data`` was replaced back into the flat buffer; returns their indices."""
        moved = []
        for index, (p, view, pointer) in enumerate(zip(self.params, self._views, self._pointers)):
            if p.data_ptr() == pointer and p.shape == view.shape:
                continue
            if p.shape != view.shape:
                raise RuntimeError(
                    f"A trainable parameter of shape {tuple(view.shape)} was given data of shape {tuple(p.shape)} "
                    "during fit. zero_offload keeps every parameter's shape fixed; change shapes before fit (or "
                    "build a new optimizer in a new fit)."
                )
            with torch.no_grad():
                view.copy_(p.data)
            p.data = view
            moved.append(index)
        return moved

    def written_buckets(self) -> list[int]:
        """Buckets whose device contents differ from what the engine last wrote there."""
        moved = self.reattach()
        if self._prints is None:
            return sorted({b for i in moved for b in self.layout.slots[i].buckets})
        buckets = self.layout.buckets
        current = torch.stack([kernels.fingerprint16(self._bucket_words(b)) for b in buckets])
        differs = (current != self._prints).tolist()  # one synchronisation
        return [b.index for b, d in zip(buckets, differs) if d or not self._recorded[b.index]]

    def find_writes(self, bucket: Bucket, published: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where this rank's chunk of ``bucket`` on the device differs from ``published`` (the chunk the
        device was given, in its dtype): (written mask, the device chunk on the host). Records the bucket."""
        if self._rounding is not None:  # every rank rounds the whole bucket alike: no collective needed
            whole = self.flat_params[bucket.flat_start : bucket.flat_start + bucket.padded_numel]
            whole.copy_(whole.to(self._rounding))
        rank_start = bucket.flat_start + self.layout.rank * bucket.shard_numel
        device_chunk = self.flat_params[rank_start : rank_start + bucket.shard_numel].cpu()
        words = _WORDS[device_chunk.dtype]
        written = device_chunk.view(words) != published.view(words)
        self.record(bucket)
        return written, device_chunk

    def merge_into(self, bucket: Bucket, master: ShardBuffer, published: torch.Tensor | None) -> int:
        """Make the written elements of this rank's chunk of ``bucket`` the new master values.

        ``published``: the low-precision chunk the device was given (None: ``master`` rounded to the
        device dtype, which is what it was given unless an update is in flight). Returns how many
        elements were written.
        """
        shard = master[bucket.shard_range]
        if published is None:
            published = shard.to(self.flat_params.dtype)
        written, device_chunk = self.find_writes(bucket, published.cpu())  # a device-share master is on the device
        count = int(written.sum())
        if count:
            shard[written.to(shard.device)] = device_chunk[written].to(shard.device, shard.dtype)
        return count
