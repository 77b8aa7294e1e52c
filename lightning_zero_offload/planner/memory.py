"""Memory of one configuration in bytes: the engine's host buffers, the device's model states, the
activations, and what a checkpoint save adds; mirrored from engine/step/cpu_state.py, engine/step/publisher.py,
engine/step/streamer.py and the schedules buffer by buffer (tests/planner/ compares them with the engine)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lightning_zero_offload.engine.options import Resolved
from lightning_zero_offload.kernels.device import BF16_STATE_CHUNK, BF16_STATE_SCRATCH_BYTES
from lightning_zero_offload.planner.shape import LayoutSummary

SCHEDULES = ("sync", "speculative", "delayed")
CHECKPOINT_FORMATS = ("full", "sharded")
# The buffers the engine's ledger counts as state (memory_report()["host_state_bytes"]); the others are
# bucket-sized staging, or the device's own memory on a CPU device, or autograd's gradients in place.
STATE_BUFFERS = ("master", "exp_avg", "exp_avg_sq", "grad", "grad_second", "next_params", "speculated_out", "snapshot")
# Host bytes per trainable parameter that saving a checkpoint adds on each rank on top of training's own
# buffers, by format: (one rank, several ranks), for fp32 state (bf16 state: half, the same tensors in bf16).
# Owned by the checkpoint code (docs/checkpoints.md): update these when a save holds less. "full" at one
# rank: none, the file is written from the engine's own buffers (checked: docs/benchmarks.md, "Checkpoint
# save memory"; a user's CheckpointIO gets copies, +12); with several ranks every rank gathers the full
# master and both moments (12 B/param). "sharded": each rank writes its own shard through the file object.
CHECKPOINT_SAVE_BYTES_PER_PARAM: dict[str, tuple[int, int]] = {"full": (0, 12), "sharded": (0, 0)}
# Plain mixed-precision Adam on the device, no offload: fp32 weights, fp32 gradients, two fp32 moments.
PLAIN_DEVICE_BYTES_PER_PARAM = 16
PLAIN_GRAD_BYTES_PER_PARAM = 4  # of which the gradients, allocated in backward and freed by zero_grad each step
# Activations kept for backward per layer, in bytes per (token x hidden) at 16-bit: 34 for a transformer
# layer without recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models", eq. 1 without its 5as/h attention-score term: PyTorch's SDPA/flash attention does
# not keep the scores). With activation checkpointing each layer keeps only its 16-bit input (2), and one
# layer at a time is recomputed in full during backward (34 once).
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34
CHECKPOINTED_BYTES_PER_TOKEN_HIDDEN = 2
# The device runtime's own memory on each GPU, which no tensor accounts for (the figures and their sources:
# docs/planning.md, "The device runtime's reserve"). The CUDA context with the kernels it loads lazily and the
# cuBLAS/cuDNN handles and workspaces of a training step: 1 GiB. NCCL's buffers with several ranks are not in it.
DEVICE_CONTEXT_BYTES = 2**30
# PyTorch's caching allocator holds more than its tensors: it rounds requests up and cannot always reuse a freed
# block for a request of another size. The engine's device buffers are allocated once (the flat parameters, two
# gradient buckets), so that overhead grows with what is allocated and freed every step: the activations, and
# plain training's gradients. An allowance of 5% of those, not a measurement.
ALLOCATOR_OVERHEAD = 0.05


def device_runtime_bytes(per_step: int) -> int:
    """Device bytes the runtime takes beyond the tensors: the CUDA context, and the caching allocator's
    overhead on the ``per_step`` bytes allocated and freed every step (DEVICE_CONTEXT_BYTES,
    ALLOCATOR_OVERHEAD). One rule for every device verdict: zero_offload's, plain training's, the largest
    model's."""
    return DEVICE_CONTEXT_BYTES + math.ceil(ALLOCATOR_OVERHEAD * per_step)


def activation_room(device_bytes: int, resident: int) -> int:
    """The most activation bytes that fit in ``device_bytes`` next to ``resident`` bytes allocated once and
    the runtime; zero or less when nothing is left for activations."""
    return math.floor((device_bytes - DEVICE_CONTEXT_BYTES - resident) / (1 + ALLOCATOR_OVERHEAD))


def state_bytes_per_param(state_dtype: torch.dtype = torch.float32) -> int:
    """Host bytes of CPU state per trainable parameter with the sync schedule: master, exp_avg, exp_avg_sq
    and the gradient buffer, each of the state's dtype (16 for cpu_state="fp32", 8 for "bf16")."""
    return 4 * state_dtype.itemsize


def checkpoint_save_bytes(
    params: int, checkpoint_format: str, world_size: int, state_dtype: torch.dtype = torch.float32
) -> int:
    """Host bytes one rank holds on top of training's buffers while a checkpoint is saved: the gathered
    master and moments are tensors of the state's dtype."""
    if checkpoint_format not in CHECKPOINT_SAVE_BYTES_PER_PARAM:
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    one_rank, gathered = CHECKPOINT_SAVE_BYTES_PER_PARAM[checkpoint_format]
    return (one_rank if world_size == 1 else gathered) * params * state_dtype.itemsize // 4


@dataclass
class HostMemory:
    """Host bytes per rank by buffer (what the engine allocates), and per node."""

    per_rank: dict[str, int]
    pinned_per_rank: int
    per_node: int
    transient_model_per_rank: int  # the module's own weights, on the host until the engine takes them
    checkpoint_full_per_rank: int  # extra while a checkpoint_format="full" checkpoint is assembled
    setup_per_rank: int = 0  # peak while the engine is built: its first buffers next to the module as built
    checkpoint_save_per_rank: dict[str, int] = field(default_factory=dict)  # format -> extra while saving
    ranks_per_node: int = 1
    # format -> extra on the first rank alone, beyond checkpoint_save_per_rank (it gathers the whole state)
    checkpoint_save_first_rank: dict[str, int] = field(default_factory=dict)

    @property
    def state_per_rank(self) -> int:
        """What the engine's ledger reports as ``host_state_bytes`` (see STATE_BUFFERS)."""
        return sum(self.per_rank.get(name, 0) for name in STATE_BUFFERS)

    @property
    def steady_per_node(self) -> int:
        return self.per_node

    @property
    def setup_per_node(self) -> int:
        return self.setup_per_rank * self.ranks_per_node

    def save_per_node(self, checkpoint_format: str) -> int:
        """Peak per node while a checkpoint of this format is saved (training's buffers stay allocated); the
        first rank's node, where a format gathers the whole state on the first rank."""
        first = self.checkpoint_save_first_rank.get(checkpoint_format, 0)
        return self.per_node + self.checkpoint_save_per_rank[checkpoint_format] * self.ranks_per_node + first


@dataclass
class Activations:
    """Device bytes one micro-batch's activations keep for backward: an estimate, ``formula`` says which."""

    bytes: int
    checkpointing: bool
    formula: str
    assumed_shape: str = ""  # how depth and width were chosen when the caller did not give n_layer ("": given)


def activation_estimate(
    batch_size: int, seq_len: int, hidden: int, n_layer: int, dtype: torch.dtype, checkpointing: bool
) -> Activations:
    """Transformer activations (see ACTIVATION_BYTES_PER_TOKEN_HIDDEN): 16-bit under bf16/fp16 autocast,
    twice that in fp32."""
    scale = 2 if dtype == torch.float32 else 1
    unit = batch_size * seq_len * hidden * scale  # one byte per token and hidden unit, per 16-bit-equivalent
    one_layer = ACTIVATION_BYTES_PER_TOKEN_HIDDEN * unit
    if checkpointing:
        total = n_layer * CHECKPOINTED_BYTES_PER_TOKEN_HIDDEN * unit + one_layer
        formula = (
            f"with activation checkpointing: {n_layer} layers x {CHECKPOINTED_BYTES_PER_TOKEN_HIDDEN} B x batch x "
            f"seq x hidden (each layer's input) + one layer recomputed ({ACTIVATION_BYTES_PER_TOKEN_HIDDEN} B x "
            "batch x seq x hidden)"
        )
    else:
        total = n_layer * one_layer
        formula = (
            f"{n_layer} layers x {ACTIVATION_BYTES_PER_TOKEN_HIDDEN} B x batch x seq x hidden (Korthikanti et al. "
            "2022; attention scores not kept, as with SDPA/flash attention)"
        )
    formula += f" with batch {batch_size}, seq {seq_len}, hidden {hidden}" + (", x2 for fp32" if scale == 2 else "")
    return Activations(int(total), checkpointing, formula + "; logits and loss not included")


def host_memory(
    layout: LayoutSummary,
    dtype: torch.dtype,
    config: Resolved,
    ranks_per_node: int,
    device_type: str,
    params: int,
    *,
    module_bytes: int | None = None,
) -> HostMemory:
    """The engine's host allocations for one rank, buffer by buffer (see OffloadEngine.__init__), and the
    transient peaks: the engine's first buffers next to the module as built (``module_bytes``, default fp32),
    and each checkpoint format's save. ``config`` is what the engine runs with
    (:func:`~lightning_zero_offload.engine.options.resolve`: the schedule, in place or not, the rollback,
    the state's dtype)."""
    # The device share (ZeRO-2: the last buckets) keeps its state on the device: the host's buffers hold the rest.
    shard, element = layout.host_shard_numel, dtype.itemsize
    max_shard, max_bucket = layout.max_shard, layout.max_bucket
    state = config.state_dtype.itemsize  # master, moments and every gradient buffer (engine/step/cpu_state.py)
    # The updates write a low-precision copy to publish, unless the master has the device's dtype already
    # (fp32 parameters, or bf16 state): then the master itself is published (engine/step/publisher.py).
    rounds = dtype != torch.float32 and config.state_dtype != dtype
    pin, schedule = config.pin_memory, config.cpu_step
    module = 4 * params if module_bytes is None else module_bytes
    saves = {f: checkpoint_save_bytes(params, f, layout.world_size, config.state_dtype) for f in CHECKPOINT_FORMATS}
    # A save copies the device share's master and moments to the host: a full one at one rank (which otherwise
    # writes views) one run of buckets at a time (checkpoints/streamed.py's OneRankBuckets); a sharded one a
    # buffer's part at a time as the writer reaches it (checkpoints/writer.py's DeviceTensors), none on a CPU
    # device, where the share is host memory already.
    share_part = state * layout.device_shard_numel
    saves["sharded"] += 0 if device_type == "cpu" else share_part
    if layout.world_size == 1:
        saves["full"] += state * layout.device_max_run
    if config.in_place:
        # In place (engine/step/in_place.py, fp32 state only): the parameters are the master; gradients are
        # autograd's own tensors.
        buffers = {"master": 4 * shard, "exp_avg": 4 * shard, "exp_avg_sq": 4 * shard, "autograd_grads": 4 * shard}
        return HostMemory(
            per_rank=buffers,
            pinned_per_rank=0,
            per_node=sum(buffers.values()) * ranks_per_node,
            transient_model_per_rank=module,
            checkpoint_full_per_rank=saves["full"],
            setup_per_rank=12 * shard + module,  # master and moments are built while the module still holds its own
            checkpoint_save_per_rank=saves,
            ranks_per_node=ranks_per_node,
        )
    buffers = {
        "master": state * shard,
        "exp_avg": state * shard,
        "exp_avg_sq": state * shard,
        "grad": state * shard,
        "grad_staging": 2 * max_shard * element,  # GradientStreamer's pool of two
        "publish_pool": 2 * max_shard * element if rounds else 0,
    }
    pageable_published = not rounds  # the master itself is copied to the device
    if schedule == "delayed":
        buffers["grad_second"] = state * shard  # backward t+1 fills one while the update of t reads the other
        buffers["next_params"] = shard * element if rounds else 0
        pageable_published = True
    if schedule == "speculative":
        # Speculated low-precision results wait for validation; "snapshot" (fp16's and bf16 state's default)
        # keeps a copy of master and moments to take a step back bitwise.
        buffers["speculated_out"] = shard * element if rounds else 0
        buffers["snapshot"] = 3 * state * shard if config.speculation_rollback == "snapshot" else 0
    # Model-sized buffers are never pinned: they reach the device through HostToDevice's two pinned buffers.
    buffers["h2d_staging"] = 2 * max_shard * element if pin and pageable_published else 0
    pinned = buffers["grad_staging"] + buffers["publish_pool"] + buffers["h2d_staging"]
    # Allocated before the module's parameters are replaced by views of the flat buffer (the engine's publisher).
    first = 4 * state * shard
    if device_type == "cpu":  # the "device" is host memory too
        buffers["device_params"] = layout.flat_numel * element
        buffers["device_grad_buckets"] = 2 * max_bucket * element
        buffers["device_share"] = 4 * state * layout.device_shard_numel
        first += buffers["device_params"] + buffers["device_share"]
    if not pin:
        pinned = 0
    per_rank = sum(buffers.values())
    return HostMemory(
        per_rank=buffers,
        pinned_per_rank=pinned,
        per_node=per_rank * ranks_per_node,
        transient_model_per_rank=module,
        checkpoint_full_per_rank=saves["full"],
        setup_per_rank=first + module,
        checkpoint_save_per_rank=saves,
        ranks_per_node=ranks_per_node,
    )


def device_memory(
    layout: LayoutSummary, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32
) -> dict[str, int]:
    """Device bytes of the model states (activations are the model's own and not included); with a device share,
    its master, moments and gradient buffer, and the scratch of its step (kernels/device.py: the bf16 state's
    pass over at most BF16_STATE_CHUNK elements; fp32, an fp32 copy of one run's gradient)."""
    element = dtype.itemsize
    max_bucket, max_shard = layout.max_bucket, layout.max_shard
    states = {"params": layout.flat_numel * element, "grad_buckets": 2 * max_bucket * element}
    if layout.world_size > 1:
        states["collective_chunks"] = 2 * max_shard * element  # reduce-scatter out, all-gather in
    if layout.device_shard_numel:
        states["device_share"] = 4 * state_dtype.itemsize * layout.device_shard_numel
        window = layout.device_max_shard
        compact = state_dtype == torch.bfloat16
        scratch = BF16_STATE_SCRATCH_BYTES * min(BF16_STATE_CHUNK, window) if compact else 4 * window
        states["device_share_step"] = scratch
    return states
