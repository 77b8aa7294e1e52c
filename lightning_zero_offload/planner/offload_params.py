"""Memory and traffic of ``offload_params=True``: torch FSDP2 ``fully_shard`` per block with
``CPUOffloadPolicy`` and the project's CPU step on the shards (docs/planning.md, "Parameters offloaded too").

Modelled from FSDP2's source (torch 2.13, ``torch/distributed/fsdp/_fully_shard/``) and the spike's
measurements (docs/design/offload-params-spike.md), not from the engine's own ledger: the engine for this
mode (``engine/offload_params/``) is being written, and tests/planner/test_offload_params.py pins the
formulas to hand computations until a live engine can be compared with them, as for the ZeRO-2 mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_zero_offload.engine.options import Resolved
from lightning_zero_offload.engine.step.layout import count_within_share
from lightning_zero_offload.kernels.device import BF16_STATE_CHUNK, BF16_STATE_SCRATCH_BYTES
from lightning_zero_offload.planner.memory import HostMemory
from lightning_zero_offload.planner.shape import DEFAULT_N_LAYER, ModelShape

REDUCE_BYTES = 4  # MixedPrecisionPolicy(reduce_dtype=torch.float32) across ranks (one rank: the compute dtype)


@dataclass(frozen=True)
class FsdpUnits:
    """The sizes FSDP2's memory and traffic depend on, for one rank of ``world_size``."""

    world_size: int
    units: int  # modules wrapped with fully_shard besides the root
    largest_unit: int  # parameters of the largest one: gathered whole on the device while it runs
    root_params: int  # parameters of the root itself: gathered at the first forward, kept all step
    params: int  # every parameter, frozen ones too (all of them are sharded)
    shard_numel: int  # this rank's shard of the trainable parameters (dim 0 padded to a multiple of the ranks)
    frozen_shard_numel: int
    largest_tensor: int  # a streamed full export gathers one tensor at a time
    tensor_shards: tuple[int, ...] = ()  # this rank's shard of each trainable tensor: each is pinned on its own
    largest_unit_tensor: int = 0  # a unit's largest parameter: one rank copies a unit up one tensor at a time
    root_tied: int = 0  # the root's parameters that several modules use: autograd sums their gradients
    unit_sizes: tuple[int, ...] = ()  # each unit's parameters, in module order (the device share takes them)

    @property
    def largest_unit_shard(self) -> int:
        return -(-self.largest_unit // self.world_size)

    @property
    def held_shard_numel(self) -> int:
        """This rank's shard of every parameter (the trainable ones and the frozen ones)."""
        return self.shard_numel + self.frozen_shard_numel

    def pinned_rounding(self, element_size: int) -> int:
        """Bytes torch's pinned allocator adds to the shards: by default it rounds every allocation up to a
        power of two (``CachingHostAllocator``, ATen/core/CachingHostAllocator.h), and FSDP2 pins each
        parameter's shard with ``Tensor.pin_memory()`` (read from torch 2.13's source; no GPU run has checked it)."""
        return sum((1 << (element_size * n - 1).bit_length()) - element_size * n for n in self.tensor_shards if n)


def _shard(size: torch.Size | tuple[int, ...], world: int) -> int:
    """A tensor's shard: FSDP2 splits dim 0 and pads it to a multiple of the ranks."""
    if not size:  # a scalar
        return 1
    return -(-size[0] // world) * math.prod(size[1:])


def fsdp_units(shape: ModelShape, n_layer: int | None, world: int) -> FsdpUnits:
    """FSDP2's units of ``shape`` at ``world`` ranks. A built model has its own (:class:`ModelShape`); a
    parameter count is the planner's family: ``n_layer`` layers that hold every parameter, 12 x hidden^2
    each, in a GPT layer's four matrices (3h x h, h x h, 4h x h, h x 4h)."""
    frozen_shard = -(-shape.frozen // world)
    if shape.shapes is None or shape.units is None:
        depth, h = n_layer or DEFAULT_N_LAYER, shape.hidden
        per_layer = -(-shape.params // depth)
        tensors = tuple(_shard(size, world) for size in ((3 * h, h), (h, h), (4 * h, h), (h, 4 * h)))
        shard = -(-shape.params // world)
        largest = 4 * h * h  # the MLP's matrices
        return FsdpUnits(
            world,
            depth,
            per_layer,
            0,
            shape.params,
            shard,
            frozen_shard,
            largest,
            tensors * depth,
            min(largest, per_layer),
            unit_sizes=(per_layer,) * depth,
        )
    tensors = tuple(_shard(size, world) for size in shape.shapes)
    total = sum(shape.units) + shape.root_params
    largest = max(shape.units, default=0)
    return FsdpUnits(
        world,
        len(shape.units),
        largest,
        shape.root_params,
        total,
        sum(tensors),
        frozen_shard,
        shape.largest_tensor,
        tensors,
        shape.largest_unit_tensor,
        shape.root_tied,
        tuple(shape.units),
    )


def device_fraction(units: FsdpUnits, device_share: float) -> float:
    """The fraction of the parameters ``device_share`` keeps on the device: placement.device_units' rule (the
    root's own parameters, then whole units in module order, while they stay within the share)."""
    sizes = (units.root_params, *units.unit_sizes)
    taken = sum(sizes[: count_within_share(sizes, device_share)])
    return taken / units.params if units.params else 0.0


def host_part(count: int, on_device: float) -> int:
    """What of ``count`` (elements or bytes spread over the parameters) stays on the host with ``on_device``
    (:func:`device_fraction`) of the parameters on the device."""
    return count - round(on_device * count)


def initialized_unit_bytes(units: FsdpUnits) -> int:
    """Host bytes of the largest unit a model built on the meta device is initialized in, whole in fp32
    scratch tensors (engine/offload_params/materialize.py): a block, or what the root holds outside them."""
    return 4 * max(units.largest_unit, units.root_params)


def host_memory_params(
    units: FsdpUnits,
    dtype: torch.dtype,
    config: Resolved,
    ranks_per_node: int,
    device_type: str,
    *,
    module_bytes: int,
    configure_model: bool,
) -> HostMemory:
    """Host bytes of one rank: FSDP2's sharded parameter (the master, in the state's dtype), its sharded
    gradient, the two moments and the speculative step's snapshot; one block's gradient shards copied down
    before they are added or assigned; on a CPU device the device's buffers too. Setup: the shards next to
    one block whole in fp32 (``configure_model``) or next to the module as built (``module_bytes``, on every
    rank). Saves: a sharded checkpoint writes the shards with one block's state at a time beyond them; a full
    one gathers one tensor at a time on every rank, and at several ranks the first rank keeps the whole
    weights and moments for the file (engine/offload_params/full_state.py; at one rank they are views)."""
    state = config.state_dtype.itemsize
    on_device = device_fraction(units, config.device_share)  # the device share's units keep theirs on the device
    shard, block_shard = host_part(units.shard_numel, on_device), units.largest_unit_shard
    buffers = {
        "master": state * shard,
        "exp_avg": state * shard,
        "exp_avg_sq": state * shard,
        "grad": state * shard,
        "frozen_shards": state * host_part(units.frozen_shard_numel, on_device),
        "block_grad_copies": state * block_shard,
    }
    if config.cpu_step == "speculative":
        buffers["snapshot"] = 3 * state * shard if config.speculation_rollback == "snapshot" else 0
    if device_type == "cpu":  # the "device" is host memory too
        device_side = device_memory_params(units, dtype, config.state_dtype, config.device_share)
        buffers["device_buffers"] = sum(device_side.values())
    shards = state * host_part(units.held_shard_numel, on_device)
    pinned = 0
    if config.pin_memory:  # CPUOffloadPolicy(pin_memory=True) pins the shards, each rounded up
        buffers["pinned_rounding"] = host_part(units.pinned_rounding(state), on_device)
        pinned = shards + buffers["pinned_rounding"]
        shards = pinned
    if configure_model:
        transient = initialized_unit_bytes(units)
        setup = shards + transient
    else:
        transient = module_bytes
        setup = module_bytes + state * block_shard  # the block being sharded next to the module as built
    saves = {"full": state * units.largest_tensor, "sharded": 3 * state * block_shard}
    # weights and both moments; at one rank the host shards are the file's tensors, and only the share's are copied
    held = units.params if units.world_size > 1 else units.params - host_part(units.params, on_device)
    whole_state = 3 * state * held
    per_rank = sum(buffers.values())
    return HostMemory(
        per_rank=buffers,
        pinned_per_rank=pinned,
        per_node=per_rank * ranks_per_node,
        transient_model_per_rank=transient,
        checkpoint_full_per_rank=saves["full"],
        setup_per_rank=setup,
        checkpoint_save_per_rank=saves,
        ranks_per_node=ranks_per_node,
        checkpoint_save_first_rank={"full": whole_state},
    )


def device_memory_params(
    units: FsdpUnits, dtype: torch.dtype, state_dtype: torch.dtype, device_share: float = 0.0
) -> dict[str, int]:
    """Device bytes of one rank at the peak of backward, activations aside: FSDP2's allocations in the order
    it makes and frees them (torch 2.13), as measured on the CPU device by
    benchmarks/offload_params_device_peak.py (docs/benchmarks.md).

    ``root_params``: the root's own parameters, gathered for the whole step. ``blocks_in_flight``: the
    running unit, unsharded in the compute dtype, and at several ranks the all-gather output of the unit
    FSDP2 prefetches (at one rank ``unshard`` is a no-op: each unit is copied up in its own pre-forward and
    pre-backward). ``backward_buffers``: the largest of three moments of a unit's backward (the root
    counts as a unit here), each next to the previous unit's reduce-scatter input (held until this unit
    reduces; in the reduce dtype: fp32 across ranks, the compute dtype at one rank): computing, autograd's
    gradients (compute dtype); gathering, the shards coming up (at one rank a tensor at a time, copied in
    the state's dtype and cast, with the previous tensor's input; at several ranks the prefetched unit's
    input, freed before this unit computes); reducing, once the running unit is resharded, its input with
    the output shard and the output's cast to the state's dtype (none where they agree). ``device_share``: its
    units' shards, gradient shards and two moments, in the state's dtype, held for the whole run.
    """
    e, s, world = dtype.itemsize, state_dtype.itemsize, units.world_size
    block = units.largest_unit
    unit = max(block, units.root_params)
    unit_shard = -(-unit // world)
    cast = e if e != s else 0  # the shard's cast to the compute dtype, where the dtypes differ
    tensor = units.largest_unit_tensor or block
    if world == 1:
        in_flight = 1
        gather_input = (s + 2 * cast) * tensor if cast else 2 * s * tensor
    else:
        in_flight = 2
        gather_input = ((cast or s) * block + (s * tensor if cast else 0)) // world
    r = e if world == 1 else REDUCE_BYTES  # placement.shard_model's reduce dtype
    # A weight the root's modules share (a tied embedding and head): autograd holds the head's gradient through
    # every block's backward until the embedding's arrives, then sums the two out of place (docs/benchmarks.md,
    # "Parameter offload: device memory, planned vs measured").
    tied = e * units.root_tied
    computing = (e + r) * unit + tied
    gathering = r * unit + gather_input + tied
    reducing = r * unit + (r + (s if s != r else 0)) * unit_shard - e * block + tied
    root = e * (units.root_params + units.root_tied) + r * block  # the root's gradients and the sum's copy
    held = {
        "root_params": e * units.root_params,
        "blocks_in_flight": in_flight * e * block,
        "backward_buffers": max(computing, gathering, reducing, root),
    }
    if fraction := device_fraction(units, device_share):
        kept = 4 * units.shard_numel + units.frozen_shard_numel  # master, gradient, two moments; frozen shards
        held["device_share"] = s * (kept - host_part(kept, fraction))
        # its step's scratch (kernels/device.py): the bf16 step's float64 passes, or an fp32 copy of one scaled
        # gradient (clipping, fp16's unscale), at most the largest tensor's shard
        tensor = -(-units.largest_tensor // world)
        scratch = BF16_STATE_SCRATCH_BYTES * min(tensor, BF16_STATE_CHUNK) if s == 2 else 4 * tensor
        held["device_share_step"] = scratch
    return held


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank moves per optimizer step: over the host link and, with several ranks, the interconnect."""

    up: int  # host -> device: the shards, gathered for forward and again for backward, every micro-batch
    down: int  # device -> host: the reduced gradient shards, every micro-batch
    all_gather: int  # interconnect: what the all-gathers bring from the other ranks
    reduce_scatter: int  # interconnect: what the reduce-scatters send to them (fp32)


def traffic(
    units: FsdpUnits, dtype: torch.dtype, state_dtype: torch.dtype, micro: int, device_share: float = 0.0
) -> Traffic:
    """Per optimizer step of ``micro`` micro-batches: FSDP2 gathers each unit before its forward and again
    before its backward (the shard crosses the link in the state's dtype and is cast on the device), and
    the engine reduces every micro-batch, so that the device holds only the blocks in flight. The device
    share's units do not cross the link; the interconnect carries every unit."""
    world, s = units.world_size, state_dtype.itemsize
    others = (world - 1) / world  # padded, as FSDP2 gathers and scatters them
    on_device = device_fraction(units, device_share)
    return Traffic(
        up=micro * 2 * s * host_part(units.held_shard_numel, on_device),
        down=micro * s * host_part(units.shard_numel, on_device),
        all_gather=math.ceil(micro * 2 * dtype.itemsize * units.held_shard_numel * world * others),
        reduce_scatter=math.ceil(micro * REDUCE_BYTES * units.shard_numel * world * others),
    )


@dataclass
class ParamsOffload:
    """What a plan with ``offload_params=True`` adds: FSDP2's units, one optimizer step's traffic per rank,
    and whether the model is built in ``configure_model`` (materialized block by block) or whole."""

    units: FsdpUnits
    traffic: Traffic
    configure_model: bool
