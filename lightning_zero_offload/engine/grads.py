"""Gradients leave the device bucket by bucket while backward is still running.

For each parameter a post-accumulate-grad hook copies the final ``.grad`` into its bucket's device
buffer and frees it. A full bucket is launched: reduce-scattered across ranks (each rank keeps its
chunk), copied into a host staging buffer, and handed to a worker thread that adds it into the
rank's fp32 gradient buffer with the native accumulate kernel. That same pass returns the bucket's
sum of squares and an inf/nan flag, so the global norm and the fp16 overflow check cost no extra
pass over memory.

Buckets are launched strictly in layout order, so every rank issues its collectives in the same
order even if gradients arrive in a different order (DDP does the same).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.collectives import reduce_scatter
from lightning_zero_offload.engine.layout import Bucket, Layout
from lightning_zero_offload.engine.memory import (
    BufferPool,
    on_stream,
    record_event,
    side_stream,
    stream_wait_event,
    wait_event,
)


class GradientStreamer:
    """Moves gradients from device parameters into a flat fp32 CPU buffer (this rank's shard)."""

    def __init__(
        self,
        layout: Layout,
        params: list[torch.nn.Parameter],
        cpu_grad: torch.Tensor,
        device: torch.device,
        grad_dtype: torch.dtype,
        pin_memory: bool,
        num_threads: int,
        process_group: dist.ProcessGroup | None = None,
        overlap: bool = True,
    ) -> None:
        self.layout = layout
        self.params = params
        self.cpu_grad = cpu_grad
        self.device = device
        self.grad_dtype = grad_dtype
        self.num_threads = num_threads
        self.process_group = process_group
        self.overlap = overlap
        world = layout.world_size
        self.scale = 1.0 / world  # reduce-scatter sums; the average is taken on the CPU, in fp32

        max_bucket = max((b.padded_numel for b in layout.buckets), default=0)
        max_shard = max((b.shard_numel for b in layout.buckets), default=0)
        self._device_buffer_numel = max_bucket
        # Free device buffers, each with the event after which its last transfer has read it.
        self._free_device_buffers: list[tuple[torch.Tensor, torch.Event | None]] = []
        self._stream = side_stream(device)
        self.device_buffers_live = 0
        self.device_buffers_peak = 0
        self._staging = BufferPool(2, max_shard, grad_dtype, pin_memory)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-offload-grads")
        self._futures: list[Future] = []

        n_buckets = len(layout.buckets)
        self._bucket_buffer: list[torch.Tensor | None] = [None] * n_buckets
        self._arrived = [0] * n_buckets
        self._next_launch = 0
        self._seen = [False] * len(params)
        self._open = False  # a backward pass has produced gradients that finish_backward has not flushed
        # Across an accumulation window: which params got a gradient, whether a bucket was written yet.
        self.has_grad = [False] * len(params)
        self._fresh = [True] * n_buckets
        # Sum of squares and inf/nan flag of the fp32 buffer's current content, per bucket.
        self.bucket_sumsq = [0.0] * n_buckets
        self.bucket_nonfinite = [False] * n_buckets
        self._wait_s = 0.0
        self._busy_s = 0.0
        # Called on the worker once a bucket's gradient is in the CPU buffer (the speculative step's cue).
        self.on_accumulated: Callable[[Bucket], None] | None = None
        self._hooks = [self._register(index, p) for index, p in enumerate(params)]

    # -- backward side -------------------------------------------------------------------------

    def _register(self, index: int, param: torch.nn.Parameter) -> torch.utils.hooks.RemovableHandle:
        def hook(p: torch.Tensor) -> None:
            self._on_grad(index, p)

        return param.register_post_accumulate_grad_hook(hook)

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise RuntimeError("zero_offload does not support sparse gradients (nn.Embedding(sparse=True))")
        if self._seen[index]:
            raise RuntimeError(
                "A parameter received its gradient twice in one backward pass. This happens with reentrant "
                "activation checkpointing when a parameter is used inside and outside the checkpointed region: "
                "use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
            )
        self._seen[index] = True
        self._open = True
        slot = self.layout.slots[index]
        buffer = self._acquire_bucket_buffer(slot.bucket)
        buffer[slot.bucket_offset : slot.bucket_offset + slot.numel].copy_(grad.reshape(-1))
        param.grad = None
        self.has_grad[index] = True
        self._arrived[slot.bucket] += 1
        self._launch_ready()

    def _acquire_bucket_buffer(self, bucket_index: int) -> torch.Tensor:
        buffer = self._bucket_buffer[bucket_index]
        if buffer is None:
            if self._free_device_buffers:
                buffer, transferred = self._free_device_buffers.pop()
                stream_wait_event(self.device, transferred)
            else:
                buffer = torch.empty(self._device_buffer_numel, dtype=self.grad_dtype, device=self.device)
            bucket = self.layout.buckets[bucket_index]
            buffer[bucket.numel : bucket.padded_numel].zero_()
            self._bucket_buffer[bucket_index] = buffer
            self.device_buffers_live += 1
            self.device_buffers_peak = max(self.device_buffers_peak, self.device_buffers_live)
        return buffer

    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self._next_launch < len(buckets):
            bucket = buckets[self._next_launch]
            if self._arrived[bucket.index] < len(bucket.param_indices):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        buffer = self._acquire_bucket_buffer(bucket.index)
        if self._arrived[bucket.index] < len(bucket.param_indices):
            for index in bucket.param_indices:
                if not self._seen[index]:
                    slot = self.layout.slots[index]
                    buffer[slot.bucket_offset : slot.bucket_offset + slot.numel].zero_()
        staging = self._staging.acquire()
        with on_stream(self._stream):  # the transfer overlaps the rest of backward on the device
            source = buffer[: bucket.padded_numel]
            if self.layout.world_size > 1:
                chunk = torch.empty(bucket.shard_numel, dtype=self.grad_dtype, device=self.device)
                reduce_scatter(chunk, source, self.process_group)
                source = chunk
            staging[: bucket.shard_numel].copy_(source, non_blocking=True)
            copied = record_event(self.device)
        self._bucket_buffer[bucket.index] = None
        self._free_device_buffers.append((buffer, copied))
        self.device_buffers_live -= 1
        if self.overlap:
            self._futures.append(self._worker.submit(self._accumulate, bucket, staging, copied))
        else:  # measured baseline: backward stops while each bucket is accumulated (all of it waited for)
            start = time.perf_counter()
            self._accumulate(bucket, staging, copied)
            self._wait_s += time.perf_counter() - start

    def _accumulate(self, bucket: Bucket, staging: torch.Tensor, copied: torch.Event | None) -> None:
        start = time.perf_counter()
        wait_event(copied)
        overwrite = self._fresh[bucket.index]
        sumsq, nonfinite = kernels.grad_accumulate(
            self.cpu_grad[bucket.shard_range],
            staging[: bucket.shard_numel],
            scale=self.scale,
            overwrite=overwrite,
            num_threads=self.num_threads,
        )
        self._fresh[bucket.index] = False
        self.bucket_sumsq[bucket.index] = sumsq
        self.bucket_nonfinite[bucket.index] = nonfinite
        self._staging.release(staging)
        self._busy_s += time.perf_counter() - start
        if self.on_accumulated is not None:
            self.on_accumulated(bucket)

    def begin(self) -> None:
        """A backward pass starts: its flush will launch every bucket, even if this rank got no gradient."""
        self._open = True

    def finish_backward(self) -> None:
        """Launch what is left (parameters without a gradient count as zero) and wait for the CPU.

        A second call without a backward in between only waits, so the collectives of a backward are
        issued exactly once.
        """
        if not self._open:
            self.wait()
            return
        self._open = False
        buckets = self.layout.buckets
        distributed = self.layout.world_size > 1
        for bucket in buckets[self._next_launch :]:
            # Every rank launches every bucket when distributed, so the collectives always match.
            if distributed or self._arrived[bucket.index] > 0:
                self._launch(bucket)
        self._next_launch = len(buckets)
        self.wait()
        self._arrived = [0] * len(buckets)
        self._next_launch = 0
        self._seen = [False] * len(self.params)

    def wait(self) -> None:
        start = time.perf_counter()
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()
        self._wait_s += time.perf_counter() - start

    def take_timings(self) -> tuple[float, float]:
        """(seconds the training thread waited for transfers, seconds the transfers took) since last call."""
        timings = (self._wait_s, self._busy_s)
        self._wait_s = self._busy_s = 0.0
        return timings

    # -- step side -----------------------------------------------------------------------------

    def new_window(self) -> None:
        """After an optimizer step: the next gradient written to each bucket overwrites it."""
        self._fresh = [True] * len(self.layout.buckets)
        self.has_grad = [False] * len(self.params)
        self.bucket_sumsq = [0.0] * len(self.layout.buckets)
        self.bucket_nonfinite = [False] * len(self.layout.buckets)

    def for_each_grad_range(self, fn: Callable[[torch.Tensor], None]) -> None:
        for bucket in self.layout.buckets:
            if not self._fresh[bucket.index]:
                fn(self.cpu_grad[bucket.shard_range])

    @property
    def staging_nbytes(self) -> int:
        return self._staging.nbytes

    @property
    def device_buffer_nbytes(self) -> int:
        return self._device_buffer_numel * torch.empty(0, dtype=self.grad_dtype).element_size()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._worker.shutdown(wait=True)
        self._free_device_buffers.clear()
