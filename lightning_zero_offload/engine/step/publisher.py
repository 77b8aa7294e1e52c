"""The publisher: the device copy of the parameters, and every write the engine makes into it.

It owns the flat low-precision device buffer the module's parameters are views of, the pool of
low-precision host chunks updates are written into, the host-to-device copier, the all-gather of
the other ranks' chunks, the events of copies that still read host memory, and the checksums that
find writes user code made into the parameters since (engine/step/param_writes.py).

In place (engine/step/in_place.py) there is nothing to publish: the parameters are views of the fp32
master itself, so :class:`NullPublisher` does nothing, and nothing can have been written behind
the engine's back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_zero_offload.engine.infra.collectives import all_gather
from lightning_zero_offload.engine.infra.ledger import COLLECTIVE, DEVICE, MemoryLedger, record_allocation
from lightning_zero_offload.engine.infra.memory import BufferPool, HostToDevice, device_empty, device_zeros
from lightning_zero_offload.engine.infra.streams import record_event, wait_event
from lightning_zero_offload.engine.step.layout import Bucket, Layout
from lightning_zero_offload.engine.step.param_writes import ParamWriteWatch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _detach(params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.data = p.data.new_empty(0)


def _attach(layout: Layout, params: list[torch.nn.Parameter], flat: torch.Tensor, copy: bool) -> None:
    """Make each parameter a view of its slot in ``flat`` (copying its values in first if ``copy``)."""
    for slot, p in zip(layout.slots, params):
        view = flat[layout.slot_range(slot.index)]
        if copy:
            view.copy_(p.detach().reshape(-1))
        p.data = view.view(slot.shape)


class Publisher:
    """Copies this rank's updated chunks to the device and gathers the others' (the offload path)."""

    def __init__(
        self,
        layout: Layout,
        params: list[torch.nn.Parameter],
        device: torch.device,
        dtype: torch.dtype,
        pin: bool,
        process_group: dist.ProcessGroup | None,
        ledger: MemoryLedger,
        master_dtype: torch.dtype = torch.float32,
        copy_values: bool = True,
    ) -> None:
        """``copy_values``: the parameters' values go into the new flat buffer; False: it stays zero until the
        caller publishes the master (a re-plan, whose old buffer was released first)."""
        self.layout, self.device, self.dtype = layout, device, dtype
        self.process_group, self.ledger = process_group, ledger
        self.flat_params = device_zeros(layout.flat_numel, dtype, device, "params")
        _attach(layout, params, self.flat_params, copy=copy_values)
        self.writes = ParamWriteWatch(layout, params, self.flat_params, checksums=True, master_dtype=master_dtype)
        self.writes.record_all()
        max_shard = max(b.shard_numel for b in layout.buckets)
        # Low-precision chunks the updates write into; None where the master has the device dtype already
        # (fp32 parameters, or bf16 state): the master itself is published.
        rounds = dtype in LOW_PRECISION and master_dtype != dtype
        self.pool = BufferPool(2, max_shard, dtype, pin) if rounds else None
        self.h2d = HostToDevice(device, max_shard, dtype, pin)  # pageable sources go through pinned staging
        self._pending: list[torch.Event | None] = []

    def publish(self, bucket: Bucket, source: torch.Tensor, out: torch.Tensor | None, pooled: bool) -> None:
        """Copy ``source`` (this rank's chunk of ``bucket``) to the device and gather the other chunks.

        ``out``: the pooled low-precision buffer ``source`` lies in, returned to the pool once copied
        when ``pooled``; otherwise the copy reads host memory that will change, so it is waited for in
        :meth:`wait`.
        """
        target = self.flat_params[bucket.flat_start : bucket.flat_start + bucket.padded_numel]
        if self.layout.world_size > 1:
            chunk = device_empty(bucket.shard_numel, self.dtype, self.device, COLLECTIVE, self.ledger)
            self.h2d.copy(chunk, source)
            all_gather(target, chunk, self.process_group)
        else:
            self.h2d.copy(target, source)
        self.writes.record(bucket)
        event = record_event(self.device)
        if out is not None and pooled:
            self.pool.release(out, event)  # type: ignore[union-attr]
        else:
            self._pending.append(event)

    def wait(self) -> None:
        """Wait for every copy that reads host memory the caller is about to change."""
        events, self._pending = self._pending, []
        for event in events:
            wait_event(event)

    def refresh(self, master: torch.Tensor) -> None:
        """Write ``master`` (this rank's shard, rounded to the device dtype) into the device parameters."""
        for bucket in self.layout.buckets:
            out = self.pool.acquire() if self.pool is not None else None
            if out is not None:
                out[: bucket.shard_numel].copy_(master[bucket.shard_range])
                self.publish(bucket, out[: bucket.shard_numel], out, pooled=True)
            else:
                self.publish(bucket, master[bucket.shard_range], None, pooled=True)
        self.wait()

    def written_buckets(self) -> list[int]:
        """Buckets whose device parameters user code wrote into since they were last published."""
        return self.writes.written_buckets()

    def record_in(self, ledger: MemoryLedger) -> None:
        """Kept by a re-plan that leaves the layout as it is (a larger device share): count what this publisher
        holds in the engine's new ``ledger``, which records what it makes from now on."""
        self.ledger = ledger
        record_allocation(ledger, DEVICE, "params", self.flat_params)
        if self.pool is not None:
            self.pool.record_in(ledger)
        self.h2d.record_in(ledger)
        self.writes.record_in(ledger)

    def release_waiters(self) -> None:
        """After a failure: hand every pooled buffer back, so an update waiting for one ends."""
        if self.pool is not None:
            for buffer in self.pool.buffers:
                self.pool.release(buffer)

    def drop(self) -> None:
        """The parameters left the flat buffer (close, or a re-plan's new one): free it."""
        self.flat_params = self.flat_params.new_empty(0)
        self.writes.drop()

    def release(self, params: list[torch.nn.Parameter]) -> None:
        """A re-plan lays ``params`` out anew, in a flat buffer filled from the master: they leave this one, freed
        before that one is made, so the device never holds the weights twice."""
        _detach(params)
        self.drop()


class NullPublisher:
    """In place: the parameters are views of the fp32 master, so there is never anything to publish."""

    pool = None

    def __init__(self, layout: Layout, params: list[torch.nn.Parameter], master: torch.Tensor) -> None:
        # One rank: the flat buffer and the shard are the same elements in the same order.
        self.flat_params = master
        _attach(layout, params, master, copy=False)
        # No checksums (the parameters are the master); reattach() still catches a replaced ``.data``.
        self.writes = ParamWriteWatch(layout, params, master, checksums=False)

    def publish(self, bucket: Bucket, source: torch.Tensor, out: torch.Tensor | None, pooled: bool) -> None:
        """Nothing to copy: the device parameters are the master."""

    def wait(self) -> None:
        """No copy is ever in flight."""

    def refresh(self, master: torch.Tensor) -> None:
        """The device parameters are the master weights already."""

    def written_buckets(self) -> list[int]:
        """None: a write into a parameter is a write into the master (a replaced ``.data`` is put back)."""
        self.writes.reattach()
        return []

    def release_waiters(self) -> None:
        """No pool, so nobody waits."""

    def drop(self) -> None:
        self.flat_params = self.flat_params.new_empty(0)
        self.writes.drop()

    def release(self, params: list[torch.nn.Parameter]) -> None:
        """A re-plan: the parameters leave the old master (the new one is carried already)."""
        _detach(params)
        self.drop()
