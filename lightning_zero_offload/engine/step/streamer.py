"""Gradients leave the device bucket by bucket while backward is still running.

For each parameter a post-accumulate-grad hook copies the final ``.grad`` into its bucket's device buffer and frees
it. A full bucket is launched: reduce-scattered across ranks (each rank keeps its chunk), copied into a host staging
buffer, and handed to a worker thread that adds it into the rank's gradient buffer (``CpuState.accumulate``: the
native kernel into fp32 state). That returns the bucket's sum of squares and an inf/nan flag, so the global norm and
the fp16 overflow check cost no extra pass over memory.

When a bucket leaves (in the order gradients arrive, the same on every rank) is decided by
engine/step/launch_order.py; this module holds the buffers and moves the bytes.

A failure on the gradient worker (the accumulate kernel, the speculative step, a CUDA error) is kept: the next hook,
the flush and every wait raise that error, and a launch waiting for a staging buffer wakes up and raises it, so
backward ends instead of waiting for a buffer that will never come back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import torch
import torch.distributed as dist

from lightning_zero_offload.engine.infra.collectives import reduce_scatter
from lightning_zero_offload.engine.infra.ledger import COLLECTIVE, MemoryLedger, current_ledger
from lightning_zero_offload.engine.infra.memory import BufferPool, DeviceBufferPool, device_empty
from lightning_zero_offload.engine.infra.streams import (
    device_transfer_times,
    on_stream,
    record_event,
    side_stream,
    wait_event,
    worker_pool,
)
from lightning_zero_offload.engine.step.cpu_state import CpuState
from lightning_zero_offload.engine.step.gradient_source import BucketArrivals, check_gradient, register_grad_hooks
from lightning_zero_offload.engine.step.landings import LandingClock
from lightning_zero_offload.engine.step.launch_order import Launch, LaunchOrder
from lightning_zero_offload.engine.step.layout import Bucket, Layout

# Device gradient buffers: one filling while up to two transfers are in flight.
DEVICE_BUFFER_CAP = 3


class GradientStreamer:
    """Moves gradients from device parameters into a flat fp32 CPU buffer (this rank's shard)."""

    def __init__(
        self,
        layout: Layout,
        params: list[torch.nn.Parameter],
        state: CpuState,
        device: torch.device,
        grad_dtype: torch.dtype,
        pin_memory: bool,
        num_threads: int,
        process_group: dist.ProcessGroup | None = None,
        overlap: bool = True,
        arrivals: BucketArrivals | None = None,
    ) -> None:
        self.layout = layout
        self.params = params
        self.state = state  # accumulates into state.grad, the buffer backward fills now (it may swap)
        self.device = device
        self.grad_dtype = grad_dtype
        self.num_threads = num_threads
        self.process_group = process_group
        self.overlap = overlap
        self.ledger = current_ledger() or MemoryLedger()
        world = layout.world_size
        # Reduce-scatter sums. fp16 is divided by the world size on the device first, so the sum has the
        # same overflow headroom as one rank's gradient; other dtypes are averaged on the CPU, in fp32.
        predivide = world > 1 and grad_dtype == torch.float16
        self._device_factor = 1.0 / world if predivide else 1.0
        self.scale = 1.0 if predivide else 1.0 / world
        max_bucket = max((b.padded_numel for b in layout.buckets), default=0)
        max_shard = max((b.shard_numel for b in layout.buckets), default=0)
        self._device_buffer_numel = max_bucket
        self.device_buffers = DeviceBufferPool(max_bucket, grad_dtype, device, DEVICE_BUFFER_CAP, self.ledger)
        self._stream = side_stream(device)
        self._buffers_held = self._buffers_peak = 0  # device gradient buffers holding gradients now, most since asked
        self._staging = BufferPool(2, max_shard, grad_dtype, pin_memory, self.ledger)
        self.worker = worker_pool("zero-offload-grads", device)
        self._futures: list[Future] = []
        self._failure: BaseException | None = None  # the first error on the worker, raised from then on

        n_buckets = len(layout.buckets)
        self._bucket_buffer: list[torch.Tensor | None] = [None] * n_buckets
        self.launch_order = LaunchOrder(layout, process_group, device, DEVICE_BUFFER_CAP)
        self._seen = [False] * len(params)  # got a gradient in this pass (a second one is refused)
        self._open = False  # a backward pass has produced gradients that finish_backward has not flushed
        # Across an accumulation window: which params got a gradient, whether a bucket was written yet.
        self.has_grad = [False] * len(params)
        self._fresh = [True] * n_buckets
        # Sum of squares and inf/nan flag of the gradient buffer's current content, per bucket.
        self.bucket_sumsq = [0.0] * n_buckets
        self.bucket_nonfinite = [False] * n_buckets
        # Timing: host accumulate intervals (start, end, could overlap backward) and device transfers
        # (timing events around each launch on the side stream) of the current pass.
        self._host_spans: list[tuple[float, float, bool]] = []
        self._device_spans: list[tuple[torch.Event, torch.Event]] = []
        self._device_origin: torch.Event | None = None
        self._transfer_s = 0.0
        self._hidden_s = 0.0
        self.landings = LandingClock(n_buckets)  # when each bucket landed before backward's end ("auto"'s share)
        # Told on the worker once a bucket's gradient is in the CPU buffer (the speculative step's cue).
        self.arrivals = arrivals if arrivals is not None else BucketArrivals()
        self._hooks = register_grad_hooks(params, self._on_grad)

    # -- backward side -------------------------------------------------------------------------

    def _on_grad(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        self.begin()  # a backward nobody announced: it started no later than its first gradient
        self.landings.hook_started()
        self.check_worker()
        check_gradient(grad, self._seen[index])
        self._seen[index] = True
        flat = grad.reshape(-1)
        param.grad = None
        self.has_grad[index] = True
        for bucket, piece in self.layout.pieces_of(index):  # a split parameter's buckets leave one by one
            buffer = self._acquire_bucket_buffer(bucket.index, make_room=True)
            buffer[piece.bucket_range].copy_(flat[piece.param_range])
            self._send(self.launch_order.arrived(index, bucket.index))
        self.landings.hook_ended()

    def _acquire_bucket_buffer(self, bucket_index: int, make_room: bool = False) -> torch.Tensor:
        buffer = self._bucket_buffer[bucket_index]
        if buffer is None:
            if make_room:
                self._send(self.launch_order.make_room())
            buffer = self.device_buffers.acquire()
            bucket = self.layout.buckets[bucket_index]
            buffer[bucket.numel : bucket.padded_numel].zero_()
            self._bucket_buffer[bucket_index] = buffer
            self._buffers_held += 1
            self._buffers_peak = max(self._buffers_peak, self._buffers_held)
        return buffer

    def _send(self, launches: Iterable[Launch]) -> None:
        """Send the buckets the launch order lets go, each before it decides the next."""
        for launch in launches:
            self._launch(launch)

    def _launch(self, launch: Launch) -> None:
        """Send one bucket's buffer (what it holds and whether it is final: engine/step/launch_order.py)."""
        self.check_worker()
        launched = time.perf_counter()
        bucket, filled, final = launch
        buffer = self._acquire_bucket_buffer(bucket.index)
        for piece in bucket.pieces:
            if piece.param_index not in filled:  # no gradient (yet) in this buffer: it counts as zero
                buffer[piece.bucket_range].zero_()
        on_device = self.state.on_device(bucket)  # the device share: its gradient stays on the device
        staging = None if on_device else self._staging.acquire()
        if self._device_origin is None:  # on the compute stream, before anything this pass times
            self._device_origin = record_event(self.device, timing=True)
        with on_stream(self._stream):  # the transfer overlaps the rest of backward on the device
            started = record_event(self.device, timing=True)
            source = buffer[: bucket.padded_numel]
            if self.layout.world_size > 1:
                if self._device_factor != 1.0:
                    source.mul_(self._device_factor)
                chunk = device_empty(bucket.shard_numel, self.grad_dtype, self.device, COLLECTIVE, self.ledger)
                reduce_scatter(chunk, source, self.process_group)
                source = chunk
            if on_device:  # added in on this stream, in order with this bucket's earlier launches
                overwrite, self._fresh[bucket.index] = self._fresh[bucket.index], False
                target = self.state.grad[bucket.shard_range]  # type: ignore[index]
                self.state.accumulate_torch(target, source[: bucket.shard_numel], self.scale, overwrite)
            else:
                staging[: bucket.shard_numel].copy_(source, non_blocking=True)  # type: ignore[index]
            copied = record_event(self.device, timing=True)
        if started is not None:
            self._device_spans.append((started, copied))
        self.landings.launched(bucket.index, launched, started)
        self._bucket_buffer[bucket.index] = None
        self.device_buffers.release(buffer, copied, bucket.index)
        self._buffers_held -= 1
        if on_device:  # its sums are read on the worker, which waits for the device, backward does not
            self._futures.append(self.worker.submit(self._sum_on_device, bucket, copied, final))
        elif self.overlap:
            self._futures.append(self.worker.submit(self._accumulate, bucket, staging, copied, True, final))
        else:  # measured baseline: backward stops while each bucket is accumulated
            self._accumulate(bucket, staging, copied, False, final)

    def _accumulate(
        self, bucket: Bucket, staging: torch.Tensor, copied: torch.Event | None, overlaps: bool, final: bool
    ) -> None:
        try:
            try:
                wait_event(copied)
                start = time.perf_counter()  # after the wait: the device part is timed on the device
                overwrite = self._fresh[bucket.index]
                sumsq, nonfinite = self.state.accumulate(
                    bucket.shard_range, staging[: bucket.shard_numel], self.scale, overwrite, self.num_threads
                )
            finally:  # also on failure, so no launch waits for a buffer that never comes back
                self._staging.release(staging)
            self._fresh[bucket.index] = False
            self.bucket_sumsq[bucket.index] = sumsq
            self.bucket_nonfinite[bucket.index] = nonfinite
            self._host_spans.append((start, time.perf_counter(), overlaps))
            self.arrivals.report(bucket, final, nonfinite)
        except BaseException as error:
            self._fail(error, bucket)
            raise

    def _sum_on_device(self, bucket: Bucket, copied: torch.Event | None, final: bool) -> None:
        """A device-share bucket's gradient was added on the device: its sums, then the arrival."""
        try:
            wait_event(copied)
            window = bucket.shard_range
            sums = self.state.sum_of_squares(window, self.state.grad[window], self.num_threads)  # type: ignore[index]
            self.bucket_sumsq[bucket.index], self.bucket_nonfinite[bucket.index] = sums
            self.arrivals.report(bucket, final, sums[1])
        except BaseException as error:
            self._fail(error, bucket)
            raise

    def _fail(self, error: BaseException, bucket: Bucket) -> None:
        if self._failure is not None:
            return
        if hasattr(error, "add_note"):  # Python 3.11+: say where it happened, keep type and message
            error.add_note(
                f"zero_offload: raised on the gradient worker, handling bucket {bucket.index} (its CPU "
                "accumulate or speculative step); this backward's gradient is incomplete, so training stops."
            )
        self._failure = error
        self._staging.fail(error)  # a launch waiting for a staging buffer wakes up and raises it

    def check_worker(self) -> None:
        """Raise the gradient worker's first error, if it had one (every call from then on)."""
        if self._failure is not None:
            raise self._failure

    def begin(self) -> None:
        """A backward pass starts: its flush will launch every bucket, even if this rank got no gradient."""
        if not self._open:  # on the compute stream, behind the forward: when backward starts there
            self.landings.pass_started(time.perf_counter(), record_event(self.device, timing=True))
        self._open = True

    def finish_backward(self) -> bool:
        """End the open backward pass, if any: launch what is left (parameters without a gradient count as
        zero) and wait for the CPU. Returns whether a pass was open; without one nothing is in flight, and
        this only raises the worker's error, if it had one.
        """
        if not self._open:
            self.wait()
            return False
        self.check_worker()
        self._open = False
        backward_end = time.perf_counter()
        backward_end_event = record_event(self.device, timing=True)
        self._send(self.launch_order.flush())
        self.wait()
        self._account_pass(backward_end, backward_end_event)
        self.launch_order.end_pass(self._seen)
        self._seen = [False] * len(self.params)
        return True

    def _account_pass(self, backward_end: float, backward_end_event: torch.Event | None) -> None:
        """Add this pass's transfer time, and the part of it that overlapped backward, to the totals."""
        spans, self._host_spans = self._host_spans, []
        for start, end, overlaps in spans:
            self._transfer_s += end - start
            if overlaps:
                self._hidden_s += max(0.0, min(end, backward_end) - start)
        device_spans, self._device_spans = self._device_spans, []
        origin, self._device_origin = self._device_origin, None
        timed = origin is not None and backward_end_event is not None
        if timed:
            wait_event(backward_end_event)
            transfer_s, hidden_s = device_transfer_times(origin, device_spans, backward_end_event)
            self._transfer_s += transfer_s
            self._hidden_s += hidden_s
        self.landings.end_pass(backward_end, backward_end_event if timed else None)

    def wait(self) -> None:
        """Wait for every accumulate in flight; raises the worker's error if it had one."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()
        self.check_worker()

    def take_timings(self) -> tuple[float, float]:
        """(transfer seconds not hidden behind backward, transfer seconds) since the last call.

        Transfer time is the device side (reduce-scatter and copy, timed with events on the side
        stream) plus the host side (the accumulate kernel). The part that ran before backward ended
        is hidden; the rest is what the training thread waited for, so the first value never exceeds
        the second.
        """
        timings = (self._transfer_s - self._hidden_s, self._transfer_s)
        self._transfer_s = self._hidden_s = 0.0
        return timings

    # -- step side -----------------------------------------------------------------------------

    def new_window(self) -> None:
        """``zero_grad()``: no gradient; the next one written to each bucket overwrites it."""
        self._fresh = [True] * len(self.layout.buckets)
        self.has_grad = [False] * len(self.params)
        self.bucket_sumsq = [0.0] * len(self.layout.buckets)
        self.bucket_nonfinite = [False] * len(self.layout.buckets)

    def zero_window(self) -> None:
        """``zero_grad(set_to_none=False)``: every gradient that exists is zero (``has_grad`` stays)."""
        self.state.grad.zero_()  # type: ignore[union-attr]
        self._fresh = [False] * len(self.layout.buckets)  # the next gradient adds to the zeros
        self.bucket_sumsq = [0.0] * len(self.layout.buckets)
        self.bucket_nonfinite = [False] * len(self.layout.buckets)

    def set_gradients(self, values: dict[int, torch.Tensor | None]) -> None:
        """Write this rank's part of whole gradients (fp32, already scaled) into the buffer; None drops one."""
        touched: set[int] = set()
        for index, value in values.items():
            flat = None if value is None else value.reshape(-1)
            for bucket_index in self.layout.slots[index].buckets:
                if self._fresh[bucket_index]:  # the buffer still holds an older window there
                    self.state.grad[self.layout.buckets[bucket_index].shard_range].zero_()  # type: ignore[index]
                    self._fresh[bucket_index] = False
                touched.add(bucket_index)
            for seg in self.layout.segments_of(index):
                target = self.state.grad[seg.shard_start : seg.shard_end]  # type: ignore[index]
                if flat is None:
                    target.zero_()
                else:
                    target.copy_(flat[seg.param_start : seg.param_start + seg.numel])
            self.has_grad[index] = value is not None
        self._sum_buckets(touched)

    def _sum_buckets(self, indices: Iterable[int]) -> None:
        for bucket_index in indices:
            window = self.layout.buckets[bucket_index].shard_range
            sums = self.state.sum_of_squares(window, self.state.grad[window], self.num_threads)  # type: ignore[index]
            self.bucket_sumsq[bucket_index], self.bucket_nonfinite[bucket_index] = sums

    def fresh_buckets(self) -> list[bool]:
        """Per bucket: no gradient of this window written there yet (it may hold an older window's values)."""
        return list(self._fresh)

    def carry_window(self, carried: dict[int, tuple[bool, torch.Tensor | None]], fresh: list[bool] | None) -> None:
        """After a re-plan: the window's gradients are in the buffer already (carried, zero elsewhere; or moved whole,
        the buckets ``fresh`` names still holding an older window's values): add to them."""
        self.has_grad = [carried.get(index, (False, None))[0] for index in range(len(self.params))]
        if any(self.has_grad):
            self._fresh = list(fresh) if fresh is not None else [False] * len(self.layout.buckets)
            self.refresh_sums()

    def refresh_sums(self) -> None:
        """Sum the stored gradients again (they were changed in place after they were accumulated)."""
        self._sum_buckets(index for index, stale in enumerate(self._fresh) if not stale)

    def local_summary(self) -> tuple[float, bool]:
        """(sum of squares, any inf/nan) of this rank's accumulated gradients."""
        return sum(self.bucket_sumsq), any(self.bucket_nonfinite)

    def expect_clipping(self, clips: bool) -> None:
        """Nothing to change: every bucket is summed as it is accumulated."""

    def held(self) -> None:
        """None: the gradients lie in the CPU state's flat buffer (``state.grad``)."""
        return None

    def for_each_grad_range(self, fn: Callable[[torch.Tensor], None]) -> None:
        for bucket in self.layout.buckets:
            if not self._fresh[bucket.index]:
                fn(self.state.grad[bucket.shard_range])

    @property
    def device_buffers_held(self) -> int:
        """Device gradient buffers holding gradients now."""
        return self._buffers_held

    def take_device_buffer_peak(self) -> int:
        """The most device gradient buffers held at once since the last call (or since built)."""
        peak, self._buffers_peak = self._buffers_peak, self._buffers_held
        return peak

    @property
    def device_buffer_nbytes(self) -> int:
        return self._device_buffer_numel * torch.empty(0, dtype=self.grad_dtype).element_size()

    @property
    def device_buffers_allocated_peak(self) -> int:
        """The most device gradient buffers that existed at once (the pool keeps at most the cap)."""
        return self.device_buffers.peak

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.worker.shutdown(wait=True)
        self.device_buffers.clear()
