"""The CPU state: this rank's shard of the optimizer state, and the one owner of the step counts.

It owns the master weights, the two Adam moments, the gradient buffer(s) backward accumulates into
(none in place: there the gradients stay where autograd left them), each parameter's step count, and
the Adam update of a run of the shard. Everything else reads these buffers through it: the gradient
source accumulates into :attr:`CpuState.grad`, the schedules' plans run through :meth:`CpuState.update`,
the publisher copies from the master, and engine/state_dicts.py gathers or loads them for checkpoints.
Each parameter's step count changes here only: counted by a step (:meth:`CpuState.count_steps`), set as
a user sets ``optimizer.state[p]["step"]`` (:meth:`CpuState.set_step`), or loaded whole
(:meth:`CpuState.load_steps`: a checkpoint, a re-plan); everyone else reads :attr:`CpuState.steps`.

The state is fp32 (``cpu_state="fp32"``: exact to torch's AdamW) or bf16 (``"bf16"``, docs/compact-state.md):
master, moments and gradient buffers in bf16, the update computed in fp32 and stored with stochastic
rounding whose random bits are a hash of (seed, step, element), the element numbered by its parameter's place among
all of the optimizer's (:func:`rounding_numbers`), so the bits depend neither on the world size, the thread count
nor which parameters are trainable.

With a device share (``device_share``), the buckets whose gradients arrive last keep their state on the device:
each buffer is a :class:`ShardBuffer`, the shard's first elements on the host and its last ones (whole buckets) on
the device, indexed by the same shard windows. A bucket's window lies on one side (buckets never straddle the
split; a parameter split across buckets may, :meth:`ShardBuffer.pieces`), and the update, accumulate and sums of a
device window run there (kernels/device.py: the same arithmetic).

The delayed schedule keeps a second gradient buffer so that backward t+1 can fill one while the
update of step t reads the other; :meth:`CpuState.swap_grad` is the one place the buffers trade
roles, so there is a single owner of "the buffer backward fills now".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from lightning_zero_offload import kernels
from lightning_zero_offload.engine.infra.collectives import broadcast_tensors_
from lightning_zero_offload.engine.infra.memory import device_zeros, host_zeros
from lightning_zero_offload.engine.options import STATE_DTYPES
from lightning_zero_offload.engine.step.layout import Bucket, Layout
from lightning_zero_offload.engine.step.shard_buffer import ShardBuffer, first_device_bucket
from lightning_zero_offload.kernels import device as device_kernels

STATE_NAMES = {dtype: name for name, dtype in STATE_DTYPES.items()}  # the cpu_state option's name of each dtype
# A sharded checkpoint's key suffix for a state buffer's device part (saved apart: no copy of the host's part).
DEVICE_PART = "@device"
MOMENTS = ("exp_avg", "exp_avg_sq")


class CpuState:
    """This rank's master, moments, gradient buffer and per-parameter step counts, fp32 or bf16."""

    def __init__(
        self,
        layout: Layout,
        group_of: list[int],
        keeps_grad: bool,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        device: torch.device | None = None,
        device_share: float = 0.0,
        allocate: bool = True,
        first_numbers: Sequence[int] | None = None,
    ) -> None:
        """``allocate=False``: without buffers, which a re-plan makes and fills one at a time (``carry_state`` in
        engine/state_dicts.py). ``first_numbers``: each parameter's :func:`rounding_numbers` entry (None: the layout's
        parameters are all of the optimizer's)."""
        self.layout = layout
        self.group_of = group_of  # param group of each trainable parameter, in optimizer order
        self.dtype = dtype
        self.seed = seed  # of the stochastic rounding (bf16 only), the same on every rank
        # The device share: buckets from first_device_bucket on keep their state on ``device``.
        self.device = device if device is not None else torch.device("cpu")
        self.first_device_bucket = first_device_bucket(layout, device_share)
        on_device = layout.buckets[self.first_device_bucket :]
        self.split = on_device[0].shard_start if on_device else layout.shard_numel
        self.keeps_grad = keeps_grad
        if allocate:
            self.master, self.exp_avg, self.exp_avg_sq = (self.new_buffer() for _ in range(3))
            # The buffer backward accumulates into now (in place: gradients stay in the tensors autograd made).
            self.grad: ShardBuffer | None = self.new_buffer() if keeps_grad else None
        self._steps = [0] * len(layout.slots)
        if first_numbers is None:
            first_numbers = rounding_numbers([slot.numel for slot in layout.slots])
        self._number_runs = [_number_runs(bucket, first_numbers) for bucket in layout.buckets]

    @property
    def compact(self) -> bool:
        """bf16 state, stochastically rounded (``cpu_state="bf16"``)."""
        return self.dtype == torch.bfloat16

    def new_buffer(self, host_only: bool = False) -> ShardBuffer:
        """A shard-sized buffer of the state's dtype (the state's own, a second gradient buffer, a snapshot), the
        device share's part on the device (``host_only``: without it, for what only host buckets use).

        Model-sized, so never pinned (see HostToDevice)."""
        host = host_zeros(self.split, self.dtype, False)
        device_numel = 0 if host_only else self.layout.shard_numel - self.split
        return ShardBuffer(host, device_zeros(device_numel, self.dtype, self.device, "state"))

    def _on_device(self, window: slice) -> bool:
        """Whether a (non-empty) shard window lies in the device share."""
        return window.start >= self.split and window.stop > window.start

    def on_device(self, bucket: Bucket) -> bool:
        """Whether ``bucket``'s state is in the device share."""
        return bucket.index >= self.first_device_bucket

    @property
    def device_share_numel(self) -> int:
        """Trainable elements whose state is on the device (all ranks)."""
        return sum(bucket.numel for bucket in self.layout.buckets[self.first_device_bucket :])

    def numbered_runs(self, bucket: Bucket, window: slice) -> list[tuple[slice, int]]:
        """``window`` (in ``bucket``'s shard range) cut where the elements' rounding numbers jump (a frozen parameter
        between two of the bucket's), each run with its first element's number: one run unless something is frozen."""
        runs = []
        for start, stop, number in self._number_runs[bucket.index]:
            if start < window.stop and window.start < stop:
                first = max(start, window.start)
                runs.append((slice(first, min(stop, window.stop)), number + first - start))
        return runs

    def accumulate(
        self, window: slice, src: torch.Tensor, scale: float, overwrite: bool, num_threads: int
    ) -> tuple[float, bool]:
        """``grad[window] (+)= src * scale``; returns the window's new sum of squares and inf/nan flag.

        fp32: one native pass. bf16: the sum rounded to nearest bf16 once per backward pass, as plain bf16
        training accumulates ``.grad`` (one pass with one micro-batch at one rank, a copy of ``src``).
        """
        dst = self.grad[window]  # type: ignore[index]
        if not self.compact and window.stop <= self.split:
            return kernels.grad_accumulate(dst, src, scale=scale, overwrite=overwrite, num_threads=num_threads)
        self.accumulate_torch(dst, src, scale, overwrite)
        return self.sum_of_squares(window, dst, num_threads)

    @staticmethod
    def accumulate_torch(dst: torch.Tensor, src: torch.Tensor, scale: float, overwrite: bool) -> None:
        """``dst (+)= src * scale`` in torch ops, wherever ``dst`` lies (bf16 state, the device share)."""
        if overwrite and dst.dtype == torch.float32:  # widened exactly, then scaled in fp32 (as natively)
            dst.copy_(src)
            if scale != 1.0:
                dst.mul_(scale)
        elif overwrite and scale == 1.0:
            dst.copy_(src)
        elif overwrite:
            torch.mul(src, scale, out=dst)
        else:
            dst.add_(src, alpha=scale)

    def sum_of_squares(self, window: slice, grad: torch.Tensor, num_threads: int) -> tuple[float, bool]:
        """(sum of squares, any inf/nan) of ``grad``, this window's gradient, on the side it lies."""
        if self._on_device(window):
            return device_kernels.sum_of_squares(grad)
        return kernels.sum_of_squares(grad, num_threads=num_threads)

    def update(
        self,
        bucket: Bucket,
        window: slice,
        hparams: kernels.AdamArgs,
        step: int,
        grad_scale: float,
        grad: ShardBuffer,
        out: torch.Tensor | None,
        extrapolate: float,
        num_threads: int,
    ) -> None:
        """The fused Adam step of ``window`` (inside ``bucket``'s shard range), reading ``grad[window]``.

        fp32: the low-precision copy goes to ``out`` in the same pass (None: the master is published).
        bf16: the master is the copy to publish (``out`` is None, ``extrapolate`` 0). A device-share window
        steps on the device (kernels/device.py) and is published from its master (``out`` None).
        """
        on_device = self._on_device(window)
        if self.compact:  # one call per run of contiguous rounding numbers, on the side the window lies
            common = {"hparams": hparams, "step": step, "seed": self.seed, "grad_scale": grad_scale}
            for run, number in self.numbered_runs(bucket, window):
                tensors = (self.master[run], grad[run], self.exp_avg[run], self.exp_avg_sq[run])
                if on_device:
                    device_kernels.adam_step_bf16_state(*tensors, **common, offset=number)
                else:
                    kernels.adam_step_bf16_state(*tensors, **common, offset=number, num_threads=num_threads)
            return
        master, exp_avg, exp_avg_sq = self.master[window], self.exp_avg[window], self.exp_avg_sq[window]
        if on_device:
            device_kernels.adam_step_multi(
                [master], [grad[window]], [exp_avg], [exp_avg_sq], [step], hparams=hparams, grad_scale=grad_scale
            )
            return
        kernels.adam_step(
            master,
            grad[window],
            exp_avg,
            exp_avg_sq,
            hparams=hparams,
            step=step,
            grad_scale=grad_scale,
            param_out=out,
            extrapolate=extrapolate,
            num_threads=num_threads,
        )

    @property
    def steps(self) -> Sequence[int]:
        """Each trainable parameter's step count (read-only: it changes through the methods below)."""
        return self._steps

    def count_steps(self, indices: Iterable[int]) -> None:
        """One optimizer step more for each of these parameters (those that got a gradient)."""
        for index in indices:
            self._steps[index] += 1

    def set_step(self, index: int, step: int) -> None:
        """A parameter's step count as a user set it (``optimizer.state[p]["step"]``); 0 zeroes its moments too."""
        if step == 0:
            for name in MOMENTS:
                self.set_moment(index, name, torch.zeros(()))
        self._steps[index] = _checked_step(step)

    def moment_view(self, index: int, name: str) -> torch.Tensor:
        """A parameter's ``exp_avg`` or ``exp_avg_sq`` (one rank: whole) as a live view in its shape."""
        pieces = self._moment_pieces(index, name)
        if len(pieces) > 1:
            raise RuntimeError(
                f"optimizer.state[p][{name!r}]: the device share starts inside this parameter (split across "
                "buckets), so its moments lie partly on the device and partly on the host, and no tensor shows them "
                f"live. Assign them (optimizer.state[p][{name!r}] = tensor), reset them (del optimizer.state[p]), "
                "use optimizer.state_dict()/load_state_dict(), or give a device_share that starts at its edge."
            )
        return pieces[0][1].view(self.layout.slots[index].shape)

    def set_moment(self, index: int, name: str, value: torch.Tensor) -> None:
        """Copy ``value`` (broadcast to the parameter's shape) into its moment, on each side of the share."""
        flat = torch.as_tensor(value).expand(self.layout.slots[index].shape).reshape(-1)
        for place, view in self._moment_pieces(index, name):
            view.copy_(flat[place])

    def _moment_pieces(self, index: int, name: str) -> list[tuple[slice, torch.Tensor]]:
        buffer = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}[name]
        return buffer.pieces(self.layout.slot_range(index))

    def load_steps(self, steps: Sequence[int]) -> None:
        """Every parameter's step count, as a checkpoint or the state before a re-plan has it."""
        if len(steps) != len(self._steps):
            raise ValueError(f"{len(steps)} step counts for {len(self._steps)} trainable parameters")
        self._steps = [_checked_step(step) for step in steps]

    def takes_more(self, share: float) -> bool:
        """Whether ``device_share=share`` keeps more buckets on the device than the state does now."""
        return first_device_bucket(self.layout, share) < self.first_device_bucket

    def grow_share(self, share: float) -> None:
        """Move the buckets that ``share`` adds to the device share there, one buffer at a time (each made as
        :meth:`new_buffer` makes the state's, its old one freed before the next: never a copy of the whole state at
        once, which a host short of memory could not hold). Values and step counts stay bitwise."""
        if not self.takes_more(share):
            raise ValueError(
                f"device_share={share} adds no bucket to the share (from bucket {self.first_device_bucket})"
            )
        old_split = self.split
        self.first_device_bucket = first_device_bucket(self.layout, share)
        self.split = split = self.layout.buckets[self.first_device_bucket].shard_start
        for name in ("master", "exp_avg", "exp_avg_sq", "grad"):
            old = getattr(self, name)
            if old is None:
                continue
            new = self.new_buffer()
            new.host.copy_(old.host[:split])
            new.device_part[: old_split - split].copy_(old.host[split:])
            new.device_part[old_split - split :].copy_(old.device_part)
            setattr(self, name, new)

    def swap_grad(self, other: ShardBuffer) -> ShardBuffer:
        """Make ``other`` the buffer backward accumulates into; returns the one it replaces."""
        previous, self.grad = self.grad, other
        assert previous is not None, "in place there is no gradient buffer to swap"
        return previous

    def snapshot(self, window: slice, into: list[ShardBuffer]) -> None:
        """Copy the master and moments of ``window`` into ``into`` (three :meth:`new_buffer` buffers)."""
        for saved, buffer in zip(into, (self.master, self.exp_avg, self.exp_avg_sq)):
            saved[window].copy_(buffer[window])

    def restore(self, window: slice, saved: list[ShardBuffer]) -> None:
        """Undo everything since :meth:`snapshot` of ``window`` (bitwise)."""
        for kept, buffer in zip(saved, (self.master, self.exp_avg, self.exp_avg_sq)):
            buffer[window].copy_(kept[window])

    def param_views(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Per-parameter views of (master, exp_avg, exp_avg_sq): one rank holds every parameter whole (in place:
        no device share)."""
        ranges = [self.layout.slot_range(index) for index in range(len(self.layout.slots))]
        master, exp_avg, exp_avg_sq = (
            [buffer[r] for r in ranges] for buffer in (self.master, self.exp_avg, self.exp_avg_sq)
        )
        return master, exp_avg, exp_avg_sq


def _checked_step(step: int) -> int:
    if step < 0:
        raise ValueError(f"a step count must be >= 0, got {step}")
    return step


# The bf16 state's rounding numbers count down from here: above any model's element count, within the kernels' offset.
ROUNDING_NUMBERS_TOP = 2**48


def rounding_numbers(sizes: Sequence[int]) -> list[int]:
    """The bf16 state's rounding number of each parameter's first element, given the numels of all of the optimizer's
    parameters (frozen ones too) in param-group order; a parameter's element i is number ``first + i``.

    Counted down from :data:`ROUNDING_NUMBERS_TOP`, the last parameter lowest, as the ZeRO-2 layout lays them out (last
    first): a bucket's elements number contiguously (one kernel call); a param group added later numbers below the
    others, renumbering none; and a run resumed with another trainable set (a block frozen) rounds every parameter as
    the uninterrupted run did. offload_params numbers its shards the same way."""
    numbers, end = [], ROUNDING_NUMBERS_TOP
    for size in sizes:
        end -= size
        numbers.append(end)
    return numbers


def _number_runs(bucket: Bucket, first_numbers: Sequence[int]) -> list[tuple[int, int, int]]:
    """``bucket``'s shard range as (start, stop, number of start) runs of contiguous rounding numbers (the padding
    that may end it numbered on from its last parameter: its values stay zero)."""
    runs: list[tuple[int, int, int]] = []
    for segment in bucket.segments:
        number = first_numbers[segment.param_index] + segment.param_start
        if runs and runs[-1][2] + segment.shard_start - runs[-1][0] == number:
            runs[-1] = (runs[-1][0], segment.shard_end, runs[-1][2])
        else:
            runs.append((segment.shard_start, segment.shard_end, number))
    end = bucket.shard_start + bucket.shard_numel
    return [*runs[:-1], (runs[-1][0], end, runs[-1][2])] if runs else [(bucket.shard_start, end, 0)]


def rounding_seed(process_group: dist.ProcessGroup | None, device: torch.device, world_size: int) -> int:
    """The bf16 state's rounding seed: torch's initial seed (``seed_everything`` sets it), rank 0's on every
    rank (a collective when ``world_size`` > 1), so one run's bits are the same at any world size."""
    seed = torch.tensor([torch.initial_seed() & (2**63 - 1)], dtype=torch.int64)
    if world_size > 1:
        broadcast_tensors_([seed], process_group, device)
    return int(seed.item())


class ParkedState:
    """Moments and step counts of parameters that left the trainable set (or were frozen when a checkpoint was
    loaded), kept should they return, and saved with the optimizer state, as torch's AdamW keeps them.

    Survives re-planning (a new :class:`CpuState` is built for the new layout); keyed by parameter id. Full
    tensors, the same on every rank.
    """

    def __init__(self) -> None:
        self._parked: dict[int, dict[str, torch.Tensor | int]] = {}

    def park(self, param: torch.nn.Parameter, name: str, value: torch.Tensor | int) -> None:
        """Keep ``param``'s ``name`` ("exp_avg", "exp_avg_sq", "step"): ``value`` must be its own (a copy)."""
        self._parked.setdefault(id(param), {})[name] = value

    def entry(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor | int]:
        """``param``'s parked values by name (empty for a parameter with none), not taken."""
        return dict(self._parked.get(id(param), {}))

    def drop(self, param: torch.nn.Parameter) -> None:
        """Forget ``param``'s parked values (a reset: it comes back with fresh ones)."""
        self._parked.pop(id(param), None)

    def clear(self) -> None:
        self._parked.clear()

    def take(self, param: torch.nn.Parameter, name: str) -> torch.Tensor | int | None:
        """``param``'s parked ``name``, given back (None for a parameter never trained)."""
        entry = self._parked.get(id(param))
        if entry is None:
            return None
        value = entry.pop(name, None)
        if not entry:
            del self._parked[id(param)]
        return value
