"""When each gradient bucket leaves the device: in the order gradients arrive, the same on every rank.

Launch order follows the order gradients actually arrive, not the order parameters were declared
(a model declaring its head first, or looping over its layers backwards, would otherwise hold every
bucket on the device until backward ends):

- one rank: a bucket leaves as soon as it is complete. After the first backward a bucket is complete
  once the parameters that got a gradient then have one, so an unused parameter does not hold it; a
  gradient that turns up after its bucket left is sent in a second launch (accumulation adds).
- several ranks: collectives must be issued in the same order everywhere. On the first backward no
  rank knows the order yet, so a bucket leaves only when the ranks agree: when a rank would need more
  device buffers than the cap (``grads.DEVICE_BUFFER_CAP``), and at the flush, it joins a round (one
  small all-reduce of which buckets each rank holds and has complete); every rank then sends the
  buckets complete on all ranks, in index order, or, if there is none, the one most ranks hold (its
  later gradients go in a second launch). Every rank acts on the same sums, so the collectives match,
  and a rank joins as many rounds as the others (each keeps joining at the flush until all ranks have
  finished). The first backward also records when each bucket got its last gradient; rank 0's order
  is then broadcast (once, as DDP does) and every later backward launches strictly in it. A bucket
  waits only for the parameters some rank got a gradient for on the first backward; if one turns up
  later, the ranks agree at the flush (one small all-reduce, only for models with such parameters)
  to send that bucket again.

Device gradient buffers: at most the cap are held on one rank, or on the first backward at several
ranks (buckets whose gradients arrive in launch order need two); later backward passes at several
ranks may hold more for a model whose buckets complete out of the agreed order, and the pool frees
buffers beyond the cap once their transfer completes.

This module decides and yields its decisions (:class:`Launch`); the streamer (engine/step/streamer.py)
holds the buffers and moves the bytes, and never calls back into it.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from lightning_zero_offload.engine.infra.collectives import all_reduce_sum, broadcast_tensors_
from lightning_zero_offload.engine.step.layout import Bucket, Layout


class Launch(NamedTuple):
    """One bucket to send now: what its device buffer holds, and why it leaves."""

    bucket: Bucket
    filled: frozenset[int]  # the parameters whose gradient is in the buffer (the rest count as zero)
    # Every parameter's gradient of this pass is in this launch, and no rank can send the bucket again in
    # this pass (a late relaunch needs a parameter the bucket does not wait for, and a bucket sent to make
    # room is sent again for the ranks that did not have all of it).
    final: bool


class LaunchOrder:
    """Which gradients each bucket holds in this backward pass, and when each bucket leaves.

    Every method that lets buckets leave yields them, one at a time, in the order they must be sent: the
    caller sends each before taking the next, so its transfer's collective comes before the next round of
    agreement, as on every other rank. A bucket counts as sent once yielded. A bucket holds a
    device gradient buffer from its first gradient of a pass until it is sent, and ``cap`` is how many
    such buffers may be held before buckets must leave.
    """

    def __init__(self, layout: Layout, process_group: dist.ProcessGroup | None, device: torch.device, cap: int) -> None:
        self.layout = layout
        self.process_group = process_group
        self.device = device
        self.cap = cap
        n_buckets = len(layout.buckets)
        # Parameters written into each bucket's current device buffer, and whether it left in this pass.
        self._filled: list[list[int]] = [[] for _ in range(n_buckets)]
        self._launched = [False] * n_buckets
        # Gradients that arrived in this pass per bucket (also those already sent), and whether the bucket
        # left with only part of them to make room (the rest follows in another launch).
        self._arrived = [0] * n_buckets
        self._evicted = [False] * n_buckets
        # Gradients a bucket waits for before it leaves (one rank; after the first backward: those that came).
        self._expected = [len(b.param_indices) for b in layout.buckets]
        # Several ranks: the agreed launch order, the next position in it, and (first backward) when each
        # bucket's last gradient arrived.
        self._order = list(range(n_buckets))
        self._next_launch = 0
        self._last_arrival = [-1] * n_buckets
        self._arrivals = 0
        self._learned = False
        self._agreement_done = False  # first backward, several ranks: the last round said every rank finished

    def _held(self) -> int:
        """Device gradient buffers held now: one per bucket holding gradients not sent yet."""
        return sum(1 for filled in self._filled if filled)

    def _leave(self, bucket: Bucket, evict: bool) -> Launch:
        """``bucket`` leaves now (``evict``: only to make room, before all its gradients have arrived)."""
        filled = frozenset(self._filled[bucket.index])
        whole = len(bucket.param_indices)
        final = len(filled) == whole and (self.layout.world_size == 1 or self._expected[bucket.index] == whole)
        self._filled[bucket.index] = []
        self._launched[bucket.index] = True
        self._evicted[bucket.index] = evict
        return Launch(bucket, filled, final and not evict)

    def make_room(self) -> Iterator[Launch]:
        """Before a new buffer is taken: the buckets to send until fewer than the cap are held (see the
        module doc)."""
        while self._held() >= self.cap:
            if self.layout.world_size == 1:  # no peer to agree with: send the fullest held bucket, partially
                held = [b for b in range(len(self._filled)) if self._filled[b]]
                yield self._leave(self.layout.buckets[max(held, key=lambda b: len(self._filled[b]))], True)
            elif not self._learned:
                yield from self._agree(finished=False)
            else:  # the agreed order cannot change within a pass: the pool allocates past its cap
                return

    def arrived(self, index: int, bucket_index: int) -> Iterator[Launch]:
        """Parameter ``index``'s gradient is in its bucket's buffer: the buckets ready to leave now."""
        self._filled[bucket_index].append(index)
        self._arrived[bucket_index] += 1
        self._last_arrival[bucket_index] = self._arrivals
        self._arrivals += 1
        yield from self._launch_ready(bucket_index)

    def _agree(self, finished: bool) -> Generator[Launch, None, list[float]]:
        """First backward at several ranks: one round of agreement on what leaves now (see the module doc).

        Returns how many ranks hold each bucket; the round is the last one when every rank has finished.
        """
        buckets = self.layout.buckets
        n = len(buckets)
        held = [bool(f) for f in self._filled]
        complete = [held[b] and self._arrived[b] >= len(buckets[b].param_indices) for b in range(n)]
        blocked = not finished and self._held() >= self.cap
        local = torch.tensor([*complete, *held, float(blocked), float(finished)], dtype=torch.float64)
        total = all_reduce_sum(local, self.process_group, self.device).tolist()
        world = self.layout.world_size
        ready, holders = total[:n], total[n : 2 * n]
        agreed = [b for b in range(n) if ready[b] == world]
        for b in agreed:
            yield self._leave(buckets[b], False)
        if not agreed and total[2 * n] > 0:  # a rank needs room and no bucket is complete everywhere
            forced = max(range(n), key=lambda b: (holders[b], -b))
            yield self._leave(buckets[forced], True)
        self._agreement_done = total[2 * n + 1] == world
        return holders

    def _launch_ready(self, bucket_index: int) -> Iterator[Launch]:
        if self.layout.world_size == 1:
            # Ready once every gradient it waits for has arrived; one that left early to make room sends the
            # rest then. A late gradient (its bucket already left whole) waits for the flush, sent with others.
            ready = self._filled[bucket_index] and self._arrived[bucket_index] >= self._expected[bucket_index]
            if ready and (not self._launched[bucket_index] or self._evicted[bucket_index]):
                yield self._leave(self.layout.buckets[bucket_index], False)
            return
        if not self._learned:  # the first backward: buckets leave by agreement only (_agree)
            return
        while self._next_launch < len(self._order):
            bucket = self.layout.buckets[self._order[self._next_launch]]
            if len(self._filled[bucket.index]) < self._expected[bucket.index]:
                return
            yield self._leave(bucket, False)
            self._next_launch += 1

    def flush(self) -> Iterator[Launch]:
        """Backward has ended: the buckets left to send (parameters without a gradient count as zero)."""
        buckets = self.layout.buckets
        if self.layout.world_size == 1:
            for bucket in buckets:
                if self._filled[bucket.index]:
                    yield self._leave(bucket, False)
            return
        # Every rank launches every bucket, in the agreed order, so the collectives always match.
        if self._learned:
            remaining = self._order[self._next_launch :]
        else:  # rounds until every rank has finished; then the rest, the buckets every rank holds first
            self._agreement_done = False
            while not self._agreement_done:
                holders = yield from self._agree(finished=True)
                remaining = [b for b in range(len(buckets)) if not self._launched[b]]
            remaining.sort(key=lambda b: (-holders[b], b))
        for index in remaining:
            yield self._leave(buckets[index], False)
        # Evictions are agreed, so every rank takes this branch alike.
        if any(self._evicted) or any(e < len(b.param_indices) for e, b in zip(self._expected, buckets)):
            # Some bucket may have left before a gradient no rank had on the first backward: relaunch
            # the buckets where any rank holds such a late gradient (one small all-reduce).
            late = torch.tensor([float(bool(f)) for f in self._filled], dtype=torch.float64)
            late = all_reduce_sum(late, self.process_group, self.device)
            for bucket in buckets:
                if late[bucket.index] > 0:
                    yield self._leave(bucket, False)

    def end_pass(self, seen: list[bool]) -> None:
        """The pass's transfers are done; ``seen``: which parameters got a gradient in it."""
        if not self._learned:
            self._learn_order(seen)
        n_buckets = len(self.layout.buckets)
        self._launched = [False] * n_buckets
        self._arrived = [0] * n_buckets
        self._evicted = [False] * n_buckets
        self._next_launch = 0

    def _learn_order(self, seen: list[bool]) -> None:
        """After the first backward: launch by arrival from now on (see the module docstring)."""
        self._learned = True
        buckets = self.layout.buckets
        if self.layout.world_size == 1:
            self._expected = [sum(seen[i] for i in b.param_indices) for b in buckets]
            return
        # A bucket waits only for the gradients some rank got, so it is ready when its last one arrived;
        # buckets without any gradient go last.
        anywhere = all_reduce_sum(torch.tensor(seen, dtype=torch.float64), self.process_group, self.device) > 0
        self._expected = [int(anywhere[b.param_indices].sum()) for b in buckets]
        order = sorted(range(len(buckets)), key=lambda b: (self._last_arrival[b] < 0, self._last_arrival[b]))
        agreed = torch.tensor(order, dtype=torch.int64)
        broadcast_tensors_([agreed], self.process_group, self.device)
        self._order = agreed.tolist()
