"""Will my model fit, how fast will it train, and what should I set: answered before the first step.

``plan(model, ...)`` predicts, per node and per rank, the host RAM the engine allocates (mirroring
engine/engine.py, engine/grads.py and engine/memory.py buffer by buffer), the device memory of the
model states, and the time of one optimizer step split into forward/backward, gradient transfers, CPU
step and copy-back, for each CPU-step schedule. The model is a handful of rates: host memory bandwidth
(the Adam step moves 28 B/param), host<->device and interconnect bandwidth, and the device's achieved
forward+backward FLOP/s (about 6 x params x tokens). :func:`measure_machine` measures them here;
pass a :class:`Machine` to plan for another host or GPU. ``python -m lightning_zero_offload.planner``
is the command line (docs/planning.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

from lightning_zero_offload.engine.layout import Layout, build_layout
from lightning_zero_offload.engine.options import OffloadOptions
from lightning_zero_offload.planner import probes

SCHEDULES = ("sync", "speculative", "delayed")
DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}
ADAM_BYTES_PER_PARAM = probes.ADAM_BYTES_PER_PARAM
STATE_BYTES_PER_PARAM = 16  # fp32 master, exp_avg, exp_avg_sq and the fp32 gradient buffer
GB = 1e9


@dataclass
class Machine:
    """The rates the step time depends on. Bandwidths in GB/s (1e9 B/s), throughput in TFLOP/s.

    ``host_bandwidth_gbs`` is the Adam-shaped bandwidth of one node with all its cores;
    ``host_bandwidth_per_thread_gbs`` what one thread reaches (None: any thread count reaches the
    node's share). ``device_tflops`` is the achieved forward+backward throughput of training, not
    the datasheet peak. ``interconnect_gbs`` (per rank, for reduce-scatter/all-gather) None: collectives
    are left out of the step time.
    """

    host_bandwidth_gbs: float
    cpu_cores: int
    host_memory_gb: float
    device_tflops: float
    h2d_gbs: float
    d2h_gbs: float
    device_type: str = "cuda"
    device_memory_gb: float | None = None
    host_bandwidth_per_thread_gbs: float | None = None
    adam_efficiency: float = 1.0  # the kernel's rate / (bandwidth / 28 B): 1.0 at the roofline
    call_overhead_s: float = 30e-6  # Python + thread wake-up per kernel call (once per bucket)
    link_latency_s: float = 20e-6  # per bucket copy (launch, event); a collective's latency comes on top
    interconnect_gbs: float | None = None
    name: str = "custom"

    def rank_bandwidth(self, threads: int, ranks_per_node: int) -> float:
        """Bytes/s one rank's CPU step gets: its share of the node, or what its threads can pull."""
        share = self.host_bandwidth_gbs * GB / ranks_per_node
        if self.host_bandwidth_per_thread_gbs is None:
            return share
        return min(share, threads * self.host_bandwidth_per_thread_gbs * GB)


def measure_machine(
    device: str | torch.device | None = None,
    threads: int | None = None,
    tokens: int = 2048,
    linear_shapes: dict[tuple[int, int], int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Machine:
    """Measure this machine's rates (about a second): see :mod:`lightning_zero_offload.planner_probes`.

    ``threads``: the thread count the node bandwidth is measured with (default: all cores).
    ``tokens``, ``linear_shapes``, ``dtype``: the matmul probe runs forward+backward of each ``(in, out)`` shape once
    for ``tokens`` rows and weighs it by its count (:func:`plan` passes the model's own layers: small
    matmuls run far below the peak, and how far depends on the shape). Default: one 1024 x 4096 layer.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cores = probes.cpu_cores()
    threads = threads or cores
    per_thread = probes.host_bandwidth(1)
    node = probes.host_bandwidth(threads) if threads > 1 else per_thread
    device_memory = None
    if device.type == "cuda":
        device_memory = torch.cuda.get_device_properties(device).total_memory / GB
    return Machine(
        host_bandwidth_gbs=node / GB,
        host_bandwidth_per_thread_gbs=per_thread / GB,
        cpu_cores=cores,
        host_memory_gb=probes.host_memory_available() / GB,
        device_tflops=probes.linear_layers_rate(device, dtype, tokens, linear_shapes or {(1024, 4096): 1}) / 1e12,
        h2d_gbs=probes.copy_bandwidth(device, to_device=True) / GB,
        d2h_gbs=probes.copy_bandwidth(device, to_device=False) / GB,
        device_type=device.type,
        device_memory_gb=device_memory,
        adam_efficiency=probes.adam_rate(threads) * ADAM_BYTES_PER_PARAM / node,
        call_overhead_s=probes.call_overhead(threads),
        name=f"measured here ({device.type}, {threads} threads)",
    )


@dataclass
class ModelShape:
    """What the plan needs to know about a model: trainable parameter shapes and matmul FLOPs per token."""

    shapes: list[torch.Size] | None  # None: only the count is known
    matmul_params: int  # weights used in a matmul per token, counted per use (a tied head counts again)
    linear_shapes: dict[tuple[int, int], int]  # (in, out) of the matmuls -> how many
    hidden: int  # the most common matmul input width (the attention term's width)
    count: int = 0

    @property
    def params(self) -> int:
        return self.count if self.shapes is None else sum(s.numel() for s in self.shapes)

    @classmethod
    def of(cls, model: nn.Module | int) -> ModelShape:
        if isinstance(model, int):
            if model < 1:
                raise ValueError(f"the parameter count must be >= 1, got {model}")
            hidden = max(64, min(8192, 64 * round(math.sqrt(model / 12 / 32) / 64)))  # a 32-layer-ish guess
            return cls(None, model, {(hidden, 4 * hidden): 1}, hidden, count=model)
        seen: set[int] = set()
        shapes = []
        for p in model.parameters():  # unique: a tied weight has one optimizer state
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                shapes.append(p.shape)
        if not shapes:
            raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
        widths: dict[int, int] = {}
        linear: dict[tuple[int, int], int] = {}
        matmul = 0
        for module in model.modules():
            if isinstance(module, nn.Linear):
                matmul += module.weight.numel()
                widths[module.in_features] = widths.get(module.in_features, 0) + module.weight.numel()
                key = (module.in_features, module.out_features)
                linear[key] = linear.get(key, 0) + 1
        hidden = max(widths, key=widths.get) if widths else 1024
        return cls(shapes, matmul or sum(s.numel() for s in shapes), linear or {(hidden, 4 * hidden): 1}, hidden)


@dataclass
class HostMemory:
    """Host bytes per rank by buffer (what the engine allocates), and per node."""

    per_rank: dict[str, int]
    pinned_per_rank: int
    per_node: int
    transient_model_per_rank: int  # the module's own weights, on the host until the engine takes them
    checkpoint_full_per_rank: int  # extra while a checkpoint_format="full" checkpoint is assembled


@dataclass
class StepTime:
    """Seconds per optimizer step; ``transfer``, ``cpu_step`` and ``copy_back`` are the work, ``exposed``
    what of it the step waits for (the rest overlaps forward/backward)."""

    forward_backward: float
    transfer: float
    cpu_step: float
    copy_back: float
    exposed: float
    total: float
    bound_by: str


@dataclass
class Plan:
    params: int
    shard_params: int
    world_size: int
    ranks_per_node: int
    tokens_per_step: int
    machine: Machine
    host: dict[str, HostMemory]
    device_bytes: dict[str, int]
    steps: dict[str, StepTime]
    bucket_size_mb: float
    cpu_threads: int
    recommended: dict[str, object] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        from lightning_zero_offload.planner.report import format_plan

        return format_plan(self)


def plan(
    model: nn.Module | int,
    *,
    batch_size: int = 1,
    seq_len: int = 1,
    devices: int = 1,
    num_nodes: int = 1,
    precision: str = "bf16-mixed",
    bucket_size_mb: float = 25.0,
    cpu_threads: int | None = None,
    accumulate_grad_batches: int = 1,
    n_layer: int | None = None,
    machine: Machine | None = None,
    checkpoint_format: str = "full",
) -> Plan:
    """Predict memory and step time of training ``model`` with zero_offload, and recommend settings.

    Args:
        model: an ``nn.Module`` (build it on ``torch.device("meta")`` to count without allocating) or the
            number of trainable parameters.
        batch_size, seq_len: micro-batch per rank; tokens per micro-batch = ``batch_size * seq_len``.
        devices, num_nodes: ranks per node and nodes (as in ``Trainer(devices=, num_nodes=)``).
        precision: ``"bf16-mixed"``, ``"16-mixed"`` or ``"32-true"``.
        bucket_size_mb, cpu_threads: the strategy options to evaluate (None: cores per rank).
        n_layer: transformer layers; with ``seq_len`` adds attention's 12 x layers x hidden x seq FLOPs/token.
        machine: the rates to use; None measures this machine (:func:`measure_machine`).
        checkpoint_format: the strategy option; "full" assembles the full fp32 state on every rank.
    """
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("devices", devices)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_nodes < 1 or accumulate_grad_batches < 1:
        raise ValueError("num_nodes and accumulate_grad_batches must be >= 1")
    if not bucket_size_mb > 0 or (cpu_threads is not None and cpu_threads < 1):
        raise ValueError(f"bucket_size_mb must be > 0 and cpu_threads >= 1, got {bucket_size_mb}, {cpu_threads}")
    shape = ModelShape.of(model)
    tokens = batch_size * seq_len
    dtype = DTYPES[precision]
    if machine is None:
        machine = measure_machine(threads=cpu_threads, tokens=tokens, linear_shapes=shape.linear_shapes, dtype=dtype)
    world = devices * num_nodes
    threads = cpu_threads or default_threads(machine, devices)
    layout = _layout(shape, bucket_size_mb, dtype, world)
    host = {s: host_memory(layout, dtype, s, devices, machine.device_type, shape.params) for s in SCHEDULES}
    flops = accumulate_grad_batches * tokens * (6 * shape.matmul_params + 12 * (n_layer or 0) * shape.hidden * seq_len)
    steps = {
        s: step_time(layout, dtype, s, machine, threads, devices, flops, accumulate_grad_batches) for s in SCHEDULES
    }
    result = Plan(
        params=shape.params,
        shard_params=layout.shard_numel,
        world_size=world,
        ranks_per_node=devices,
        tokens_per_step=tokens * accumulate_grad_batches * world,
        machine=machine,
        host=host,
        device_bytes=device_memory(layout, dtype),
        steps=steps,
        bucket_size_mb=bucket_size_mb,
        cpu_threads=threads,
    )
    result.recommended = recommend(shape, dtype, machine, devices, world, flops, accumulate_grad_batches)
    result.notes = _notes(result, checkpoint_format)
    return result


BUCKET_CHOICES_MB = (1, 2, 4, 8, 16, 25, 32, 64, 128, 256)
EXACT_SCHEDULES = ("sync", "speculative")  # same result as a plain optimizer step; delayed uses stale weights


def default_threads(machine: Machine, ranks_per_node: int) -> int:
    """The engine's default: the node's cores shared evenly between its ranks."""
    return max(1, machine.cpu_cores // ranks_per_node)


@dataclass(frozen=True)
class LayoutSummary:
    """The sizes of the engine's layout that memory and time depend on (engine/layout.py)."""

    world_size: int
    shard_numel: int  # this rank's flat CPU buffers
    flat_numel: int  # the flat device buffer, padded
    buckets: int
    max_bucket: int  # padded elements of the largest bucket
    max_shard: int  # this rank's chunk of it

    @classmethod
    def of(cls, layout: Layout) -> LayoutSummary:
        return cls(
            layout.world_size,
            layout.shard_numel,
            layout.flat_numel,
            len(layout.buckets),
            max(b.padded_numel for b in layout.buckets),
            max(b.shard_numel for b in layout.buckets),
        )


def _layout(shape: ModelShape, bucket_size_mb: float, dtype: torch.dtype, world: int) -> LayoutSummary:
    bucket_numel = OffloadOptions(bucket_size_mb=bucket_size_mb).bucket_numel(dtype.itemsize)
    if shape.shapes is None:  # a bare parameter count: buckets of exactly the bucket size
        full, rest = divmod(shape.params, bucket_numel)
        padded, padded_rest = (-(-n // world) * world for n in (bucket_numel, rest))
        flat = full * padded + padded_rest
        largest = padded if full else padded_rest
        return LayoutSummary(world, flat // world, flat, full + (rest > 0), largest, largest // world)
    return LayoutSummary.of(build_layout(shape.shapes, bucket_numel, world, 0))


def recommend(
    shape: ModelShape, dtype: torch.dtype, machine: Machine, ranks_per_node: int, world: int, flops: float, micro: int
) -> dict[str, object]:
    """Threads, bucket size and schedule with the shortest predicted step.

    Threads: the fewest that pull the rank's share of the node's bandwidth (the others stay free for the
    data loader); buckets: the smallest size within 1% of the fastest (less device memory, earlier
    start); schedule: the fastest exact one (delayed is reported, not recommended: it changes the
    optimizer's result, docs/dpu.md).
    """
    cores = default_threads(machine, ranks_per_node)
    threads = cores
    if machine.device_type != "cpu" and machine.host_bandwidth_per_thread_gbs:
        share = machine.host_bandwidth_gbs / ranks_per_node
        threads = min(cores, max(1, math.ceil(0.95 * share / machine.host_bandwidth_per_thread_gbs)))
    layouts = {mb: _layout(shape, mb, dtype, world) for mb in BUCKET_CHOICES_MB}
    best: dict[str, tuple[float, float]] = {}
    for schedule in SCHEDULES:
        totals = []
        for mb, layout in layouts.items():
            totals.append(
                (step_time(layout, dtype, schedule, machine, threads, ranks_per_node, flops, micro).total, mb)
            )
        fastest = min(t for t, _ in totals)
        best[schedule] = next((t, mb) for t, mb in totals if t <= 1.01 * fastest)
    schedule = min(EXACT_SCHEDULES, key=lambda s: best[s][0] * (1.0 if s == "sync" else 1.02))  # ties: sync
    step_s, bucket_mb = best[schedule]
    return {
        "cpu_step": schedule,
        "bucket_size_mb": bucket_mb,
        "cpu_threads": threads,
        "step_s": step_s,
        "delayed_step_s": best["delayed"][0],
        "delayed_speedup": step_s / best["delayed"][0],
    }


def _notes(result: Plan, checkpoint_format: str) -> list[str]:
    m = result.machine
    notes = []
    need = result.host["sync"].per_node
    if need > m.host_memory_gb * GB:
        notes.append(
            f"DOES NOT FIT: {need / GB:.1f} GB of host RAM per node needed, {m.host_memory_gb:.1f} GB available: "
            "use more nodes (the state per node is 16 B x params / nodes) or fewer trainable parameters"
        )
    if checkpoint_format == "full":
        extra = result.host["sync"].checkpoint_full_per_rank * result.ranks_per_node
        notes.append(
            f'checkpoint_format="full" assembles the full fp32 state on every rank while saving: '
            f'+{extra / GB:.1f} GB per node at that moment; "sharded" avoids it'
        )
    if result.world_size > 1 and m.interconnect_gbs is None:
        notes.append("reduce-scatter/all-gather time not included (pass interconnect_gbs)")
    if m.device_type == "cpu":
        notes.append("CPU device: forward/backward and the CPU step share the cores, so no schedule overlaps them")
    notes.append("device memory: model states only; activations come on top")
    return notes


def host_memory(
    layout: LayoutSummary, dtype: torch.dtype, schedule: str, ranks_per_node: int, device_type: str, params: int
):
    """The engine's host allocations for one rank, buffer by buffer (see OffloadEngine.__init__)."""
    shard, element = layout.shard_numel, dtype.itemsize
    max_shard, max_bucket = layout.max_shard, layout.max_bucket
    low = dtype != torch.float32
    pin = device_type == "cuda"
    if device_type == "cpu" and not low and schedule == "sync" and layout.world_size == 1:
        # In place (engine/in_place.py): the parameters are the master; gradients are autograd's own tensors.
        buffers = {"master": 4 * shard, "exp_avg": 4 * shard, "exp_avg_sq": 4 * shard, "autograd_grads": 4 * shard}
        return HostMemory(
            per_rank=buffers,
            pinned_per_rank=0,
            per_node=sum(buffers.values()) * ranks_per_node,
            transient_model_per_rank=4 * params,
            checkpoint_full_per_rank=12 * params,
        )
    buffers = {
        "master": 4 * shard,
        "exp_avg": 4 * shard,
        "exp_avg_sq": 4 * shard,
        "grad": 4 * shard,
        "grad_staging": 2 * max_shard * element,  # GradientStreamer's pool of two
        "publish_pool": 2 * max_shard * element if low else 0,
    }
    pageable_published = not low  # the fp32 master itself is copied to the device
    if schedule == "delayed":
        buffers["grad_second"] = 4 * shard  # backward t+1 fills one while the update of t reads the other
        buffers["next_params"] = shard * element if low else 0
        pageable_published = True
    # Model-sized buffers are never pinned: they reach the device through HostToDevice's two pinned buffers.
    buffers["h2d_staging"] = 2 * max_shard * element if pin and pageable_published else 0
    pinned = buffers["grad_staging"] + buffers["publish_pool"] + buffers["h2d_staging"]
    if device_type == "cpu":  # the "device" is host memory too
        buffers["device_params"] = layout.flat_numel * element
        buffers["device_grad_buckets"] = 2 * max_bucket * element
    if not pin:
        pinned = 0
    per_rank = sum(buffers.values())
    return HostMemory(
        per_rank=buffers,
        pinned_per_rank=pinned,
        per_node=per_rank * ranks_per_node,
        transient_model_per_rank=4 * params,
        checkpoint_full_per_rank=12 * params,  # full fp32 master + two moments, gathered on every rank
    )


def device_memory(layout: LayoutSummary, dtype: torch.dtype) -> dict[str, int]:
    """Device bytes of the model states (activations are the model's own and not included)."""
    element = dtype.itemsize
    max_bucket, max_shard = layout.max_bucket, layout.max_shard
    states = {"params": layout.flat_numel * element, "grad_buckets": 2 * max_bucket * element}
    if layout.world_size > 1:
        states["collective_chunks"] = 2 * max_shard * element  # reduce-scatter out, all-gather in
    return states


def step_time(
    layout: LayoutSummary,
    dtype: torch.dtype,
    schedule: str,
    m: Machine,
    threads: int,
    ranks_per_node: int,
    flops: float,
    micro: int,
) -> StepTime:
    """One optimizer step's time under ``schedule`` (see docs/planning.md for the model)."""
    shard, element, world = layout.shard_numel, dtype.itemsize, layout.world_size
    buckets = layout.buckets
    bandwidth = m.rank_bandwidth(threads, ranks_per_node)
    forward_backward = flops / (m.device_tflops * 1e12)
    backward = forward_backward * 2 / 3
    collective = 0.0
    if world > 1 and m.interconnect_gbs:
        collective = element * layout.flat_numel * (world - 1) / world / (m.interconnect_gbs * GB)
    # per micro-batch: the gradient chunk crosses the bus, then is added into the fp32 buffer
    # (overwrite: read 2-4 B, write 4 B; later micro-batches also read the buffer)
    accumulate_bytes = (element + 4) * shard + (micro - 1) * (element + 8) * shard
    accumulate = accumulate_bytes / bandwidth + micro * buckets * m.call_overhead_s
    device_to_host = micro * (element * shard / (m.d2h_gbs * GB) + collective + buckets * m.link_latency_s)
    cpu_step = shard * ADAM_BYTES_PER_PARAM / (bandwidth * m.adam_efficiency) + buckets * m.call_overhead_s
    copy_back = element * shard / (m.h2d_gbs * GB) + collective + buckets * m.link_latency_s
    transfer = device_to_host + accumulate
    if m.device_type == "cpu":
        # Forward/backward, copies and the CPU step all run on the same cores: nothing overlaps.
        exposed = transfer + cpu_step + copy_back
        total = forward_backward + exposed
    else:
        per_bucket = 1 / max(1, buckets)
        # Buckets stream during backward; what does not fit behind it, and the last bucket, is waited for.
        pipe = max(device_to_host, accumulate)
        tail = max(0.0, pipe - backward) + pipe * per_bucket
        if schedule == "sync":  # update bucket k+1 while bucket k is copied back
            exposed = tail + max(cpu_step, copy_back) + min(cpu_step, copy_back) * per_bucket
        elif schedule == "speculative":  # each bucket is updated as soon as its gradients are final
            host = accumulate + cpu_step  # what is left of it after backward overlaps the copy-back
            left = max(0.0, max(device_to_host, host) - backward) + host * per_bucket
            exposed = max(left, copy_back) + min(left, copy_back) * per_bucket
        else:  # delayed: step t's update runs during forward/backward of t+1; its result is swapped in
            exposed = tail + max(0.0, cpu_step - forward_backward) + copy_back
        total = forward_backward + exposed
    work = {
        "device compute": forward_backward,
        "host memory bandwidth": accumulate + cpu_step,
        "host-device link": device_to_host + copy_back - 2 * micro * collective,
        "interconnect": (micro + 1) * collective,
    }
    return StepTime(forward_backward, transfer, cpu_step, copy_back, exposed, total, max(work, key=work.get))


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB"


def with_rates(machine: Machine, **changes: float) -> Machine:
    """A copy of ``machine`` with some rates replaced (e.g. a measured host with another GPU's numbers)."""
    return replace(machine, **changes)
