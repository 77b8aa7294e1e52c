"""A state buffer split by the device share: the shard's first elements on the host, its last buckets' on the device.

With ``device_share`` the buckets whose gradients arrive last keep their state on the device (engine/step/
cpu_state.py). Each of the state's shard-sized buffers is then a :class:`ShardBuffer` indexed by the same shard
windows as a plain tensor: a bucket's window lies on one side (buckets never straddle the split), a parameter split
across buckets may lie on both (:meth:`ShardBuffer.pieces`).
"""

from __future__ import annotations

import torch

from lightning_zero_offload.engine.step.layout import Layout, count_within_share


def first_device_bucket(layout: Layout, share: float) -> int:
    """The first of the buckets whose state stays on the device with ``device_share=share``: the last buckets
    (layout order is reverse registration, so their gradients arrive last), whole, as many as hold at most
    ``share`` of the trainable elements. ``len(layout.buckets)``: none."""
    numels = [bucket.numel for bucket in reversed(layout.buckets)]
    return len(numels) - count_within_share(numels, share)


class ShardBuffer:
    """One of the state's shard-sized buffers: elements ``[0, split)`` on the host, ``[split, numel)`` on the
    device (the device share's buckets). Indexed by shard windows, each of which lies on one side."""

    def __init__(self, host: torch.Tensor, device_part: torch.Tensor) -> None:
        self.host = host
        self.device_part = device_part
        self.split = host.numel()
        self.dtype = host.dtype

    def numel(self) -> int:
        return self.split + self.device_part.numel()

    def __getitem__(self, window: slice) -> torch.Tensor:
        start, stop, _ = window.indices(self.numel())
        if stop <= self.split:
            return self.host[start:stop]
        if start >= self.split:
            return self.device_part[start - self.split : stop - self.split]
        raise IndexError(f"shard window [{start}, {stop}) straddles the device share, which starts at {self.split}")

    def pieces(self, window: slice) -> list[tuple[slice, torch.Tensor]]:
        """The window's part on each side it lies on: (that part's place within the window, its view there). Only
        a split parameter's window (a slot's, not a bucket's) can lie on both."""
        start, stop, _ = window.indices(self.numel())
        at = min(max(self.split, start), stop)
        pieces = [(slice(0, at - start), self.host[start:at])] if at > start else []
        if stop > at:
            pieces.append((slice(at - start, stop - start), self.device_part[at - self.split : stop - self.split]))
        return pieces

    @property
    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.host, self.device_part

    def zero_(self) -> ShardBuffer:
        for part in self.parts:
            part.zero_()
        return self
