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
from lightning_zero_offload.engine.options import OffloadOptions, Resolved, SpeculativeOptions, resolve
from lightning_zero_offload.planner import probes

SCHEDULES = ("sync", "speculative", "delayed")
DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}
ADAM_BYTES_PER_PARAM = probes.ADAM_BYTES_PER_PARAM
STATE_BYTES_PER_PARAM = 16  # fp32 master, exp_avg, exp_avg_sq and the fp32 gradient buffer
GB = 1e9
CHECKPOINT_FORMATS = ("full", "sharded")
# Host bytes per trainable parameter that saving a checkpoint adds on each rank on top of training's own
# buffers, by format: (one rank, several ranks). Owned by the checkpoint code (docs/checkpoints.md): update
# these when a save holds less. "full" at one rank: none, the file is written from the engine's own buffers
# (checked: docs/benchmarks.md, "Checkpoint save memory"; a user's CheckpointIO gets copies, +12); with
# several ranks every rank gathers the full fp32 master and both moments (12 B/param). "sharded": each rank
# writes its own shard through the file object, no copy.
CHECKPOINT_SAVE_BYTES_PER_PARAM: dict[str, tuple[int, int]] = {"full": (0, 12), "sharded": (0, 0)}
# Plain mixed-precision Adam on the device, no offload: fp32 weights, fp32 gradients, two fp32 moments.
PLAIN_DEVICE_BYTES_PER_PARAM = 16
# Activations kept for backward per layer, in bytes per (token x hidden) at 16-bit: 34 for a transformer
# layer without recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models", eq. 1 without its 5as/h attention-score term: PyTorch's SDPA/flash attention does
# not keep the scores). With activation checkpointing each layer keeps only its 16-bit input (2), and one
# layer at a time is recomputed in full during backward (34 once).
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34
CHECKPOINTED_BYTES_PER_TOKEN_HIDDEN = 2


def checkpoint_save_bytes(params: int, checkpoint_format: str, world_size: int) -> int:
    """Host bytes one rank holds on top of training's buffers while a checkpoint is saved."""
    if checkpoint_format not in CHECKPOINT_SAVE_BYTES_PER_PARAM:
        raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    one_rank, gathered = CHECKPOINT_SAVE_BYTES_PER_PARAM[checkpoint_format]
    return (one_rank if world_size == 1 else gathered) * params


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
    torch_threads: int | None = None  # torch's CPU threads (a CPU device's forward/backward); None: all cores
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
    """Measure this machine's rates with the short probes of :mod:`lightning_zero_offload.planner.probes`.

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
        torch_threads=torch.get_num_threads(),
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
    frozen: int = 0  # parameters without requires_grad: no CPU state, but on the host until setup and on the device
    module_bytes: int = 0  # the module's parameters as built (0: assume fp32, 4 B each)

    @property
    def params(self) -> int:
        return self.count if self.shapes is None else sum(s.numel() for s in self.shapes)

    @classmethod
    def of(cls, model: nn.Module | int | float) -> ModelShape:
        if isinstance(model, float) and model.is_integer():  # 7e9
            model = int(model)
        if isinstance(model, int):
            if model < 1:
                raise ValueError(f"the parameter count must be >= 1, got {model}")
            hidden = max(64, min(8192, 64 * round(math.sqrt(model / 12 / 32) / 64)))  # a 32-layer-ish guess
            return cls(None, model, {(hidden, 4 * hidden): 1}, hidden, count=model)
        seen: set[int] = set()
        shapes = []
        frozen = module_bytes = 0
        for p in model.parameters():  # unique: a tied weight has one optimizer state
            if id(p) in seen:
                continue
            seen.add(id(p))
            module_bytes += p.numel() * p.element_size()
            if p.requires_grad:
                shapes.append(p.shape)
            else:
                frozen += p.numel()
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
        matmul = matmul or sum(s.numel() for s in shapes)
        linear = linear or {(hidden, 4 * hidden): 1}
        return cls(shapes, matmul, linear, hidden, frozen=frozen, module_bytes=module_bytes)

    @property
    def built_bytes(self) -> int:
        """Host bytes of the module's parameters as built (a parameter count: fp32)."""
        return self.module_bytes or 4 * (self.params + self.frozen)


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

    @property
    def steady_per_node(self) -> int:
        return self.per_node

    @property
    def setup_per_node(self) -> int:
        return self.setup_per_rank * self.ranks_per_node

    def save_per_node(self, checkpoint_format: str) -> int:
        """Peak per node while a checkpoint of this format is saved (training's buffers stay allocated)."""
        return self.per_node + self.checkpoint_save_per_rank[checkpoint_format] * self.ranks_per_node


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
class Activations:
    """Device bytes one micro-batch's activations keep for backward: an estimate, ``formula`` says which."""

    bytes: int
    checkpointing: bool
    formula: str


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


@dataclass
class Check:
    """One memory requirement against what the machine has (``available`` None: not known, not checked)."""

    name: str
    need: int
    available: int | None

    @property
    def fits(self) -> bool:
        return self.available is None or self.need <= self.available


@dataclass
class Verdict:
    """Whether one configuration (CPU-step schedule and checkpoint format) fits host and device memory."""

    schedule: str
    checkpoint_format: str
    checks: list[Check]

    @property
    def fits(self) -> bool:
        return all(c.fits for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.fits]


def host_checks(host: HostMemory, checkpoint_format: str, available: int | None, schedule: str = "") -> list[Check]:
    """Host RAM per node at each moment of a run: steady state, engine setup, checkpoint save."""
    steady = "host RAM, training" + (" (with delayed's second gradient buffer)" if schedule == "delayed" else "")
    return [
        Check(steady, host.steady_per_node, available),
        Check("host RAM, setup (the module as built + the engine's state)", host.setup_per_node, available),
        Check(f'host RAM, saving a "{checkpoint_format}" checkpoint', host.save_per_node(checkpoint_format), available),
    ]


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
    # What the engine runs with under each schedule (engine/options.resolve): in place or not, the rollback.
    resolved: dict[str, Resolved] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    checkpoint_format: str = "full"
    activations: Activations | None = None
    device_total: int = 0  # model states + frozen parameters + activations, per device
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # "schedule/format" -> verdict
    plain_device_bytes: int | None = None  # plain training without offload (16 B/param + activations)
    fixes: list[str] = field(default_factory=list)  # the smallest changes that would fit, when nothing does

    @property
    def fits(self) -> bool:
        """Whether some configuration fits host and device memory (then ``recommended`` names one)."""
        return any(v.fits for v in self.verdicts.values())

    @property
    def plain_fits_device(self) -> bool | None:
        m = self.machine
        if self.plain_device_bytes is None or m.device_memory_gb is None or m.device_type == "cpu":
            return None
        return self.plain_device_bytes <= m.device_memory_gb * GB

    def verdict(self, schedule: str, checkpoint_format: str | None = None) -> Verdict:
        return self.verdicts[f"{schedule}/{checkpoint_format or self.checkpoint_format}"]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["fits"] = self.fits
        out["plain_fits_device"] = self.plain_fits_device
        for key, verdict in self.verdicts.items():
            out["verdicts"][key]["fits"] = verdict.fits
        return out

    def __str__(self) -> str:
        from lightning_zero_offload.planner.report import format_plan

        return format_plan(self)


@dataclass
class _Memory:
    """Memory of one configuration of nodes, model size, micro-batch and activation checkpointing."""

    layout: LayoutSummary
    host: dict[str, HostMemory]
    device_states: dict[str, int]
    device_total: int
    activations: Activations | None
    verdicts: dict[str, Verdict]
    resolved: dict[str, Resolved]

    @property
    def fits(self) -> bool:
        return any(v.fits for v in self.verdicts.values())


def _resolve(options: OffloadOptions, machine: Machine, dtype: torch.dtype, world: int, ranks: int) -> Resolved:
    """What the engine would run with on ``machine`` (its cores, not this process's)."""
    cores = machine.cpu_cores
    device = torch.device(machine.device_type)
    return resolve(options, device, dtype, world, ranks, cores=cores, torch_threads=machine.torch_threads or cores)


def schedule_options(options: OffloadOptions, schedule: str) -> OffloadOptions:
    """``options`` with ``cpu_step=schedule``, as the planner evaluates each schedule. ``in_place_on_cpu=True``
    requires the sync schedule in place; the others, which never run in place, are planned without it."""
    in_place = None if options.in_place_on_cpu and schedule != "sync" else options.in_place_on_cpu
    return replace(options, cpu_step=schedule, in_place_on_cpu=in_place)


def _memory(
    shape: ModelShape,
    dtype: torch.dtype,
    machine: Machine,
    devices: int,
    num_nodes: int,
    options: OffloadOptions,
    batch_size: int,
    seq_len: int,
    n_layer: int | None,
    checkpointing: bool,
) -> _Memory:
    world = devices * num_nodes
    layout = _layout(shape, options.bucket_size_mb, dtype, world)
    configs = {s: _resolve(schedule_options(options, s), machine, dtype, world, devices) for s in SCHEDULES}
    host = {
        s: host_memory(
            layout, dtype, configs[s], devices, machine.device_type, shape.params, module_bytes=shape.built_bytes
        )
        for s in SCHEDULES
    }
    states = device_memory(layout, dtype)
    activations = None
    if n_layer:
        activations = activation_estimate(batch_size, seq_len, shape.hidden, n_layer, dtype, checkpointing)
    # Frozen parameters go to the device as they are (fp32 assumed); activations come on top.
    total = sum(states.values()) + 4 * shape.frozen + (activations.bytes if activations else 0)
    host_gb = machine.host_memory_gb * GB
    device_gb = None
    if machine.device_type != "cpu" and machine.device_memory_gb is not None:  # a CPU device is host memory
        device_gb = int(machine.device_memory_gb * GB)
    verdicts = {}
    for schedule in SCHEDULES:
        for checkpoint_format in CHECKPOINT_FORMATS:
            checks = host_checks(host[schedule], checkpoint_format, int(host_gb), schedule)
            what = "model states" + (" + activations" if activations else "")
            checks.append(Check(f"device memory per GPU ({what})", total, device_gb))
            verdicts[f"{schedule}/{checkpoint_format}"] = Verdict(schedule, checkpoint_format, checks)
    return _Memory(layout, host, states, total, activations, verdicts, configs)


def plan(
    model: nn.Module | int | float,
    *,
    batch_size: int,
    seq_len: int,
    devices: int = 1,
    num_nodes: int = 1,
    precision: str = "bf16-mixed",
    bucket_size_mb: float = 25.0,
    cpu_threads: int | None = None,
    accumulate_grad_batches: int = 1,
    n_layer: int | None = None,
    machine: Machine | None = None,
    checkpoint_format: str = "full",
    activation_checkpointing: bool = False,
    hidden: int | None = None,
    in_place_on_cpu: bool | None = None,
    speculation_rollback: str = "auto",
) -> Plan:
    """Predict memory and step time of training ``model`` with zero_offload, and recommend settings.

    Every configuration (CPU-step schedule x checkpoint format) gets a verdict against host RAM (steady
    state, setup with the module as built, checkpoint save) and device memory (parameters, gradient
    buckets and, with ``n_layer``, activations); only what fits is recommended, and when nothing fits
    ``fixes`` lists the smallest changes that would.

    Args:
        model: an ``nn.Module`` (build it on ``torch.device("meta")`` to count without allocating) or the
            number of trainable parameters.
        batch_size, seq_len: micro-batch per rank, as the run will use them (step time and activations
            scale with ``batch_size * seq_len`` tokens).
        devices, num_nodes: ranks per node and nodes (as in ``Trainer(devices=, num_nodes=)``).
        precision: ``"bf16-mixed"``, ``"16-mixed"`` or ``"32-true"``.
        bucket_size_mb, cpu_threads, in_place_on_cpu, speculation_rollback: the strategy options to evaluate,
            resolved as the engine resolves them (``Plan.resolved``); ``in_place_on_cpu=True`` applies to the
            sync schedule, the only one that runs in place, and ``speculation_rollback`` to the speculative one.
        n_layer: transformer layers; adds attention's 12 x layers x hidden x seq FLOPs/token and the
            activation estimate to device memory.
        machine: the rates to use; None measures this machine (:func:`measure_machine`).
        checkpoint_format: the strategy option you intend to use; both formats get a verdict.
        activation_checkpointing: whether the model recomputes activations (changes the activation estimate).
        hidden: the model width for the attention FLOPs and activations (default: the model's most common
            matmul input width; for a parameter count, ``sqrt(params / (12 x n_layer))``).
    """
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {sorted(DTYPES)}, got {precision!r}")
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("devices", devices)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if num_nodes < 1 or accumulate_grad_batches < 1:
        raise ValueError("num_nodes and accumulate_grad_batches must be >= 1")
    options = OffloadOptions(  # checks each option as the strategy does
        bucket_size_mb=bucket_size_mb,
        cpu_threads=cpu_threads,
        checkpoint_format=checkpoint_format,  # type: ignore[arg-type]
        in_place_on_cpu=in_place_on_cpu,
        speculative=SpeculativeOptions(speculation_rollback),  # type: ignore[arg-type]
    )
    if n_layer is not None and n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    shape = ModelShape.of(model)
    if hidden is not None:
        shape = replace(shape, hidden=hidden)
    elif shape.shapes is None and n_layer:
        shape = replace(shape, hidden=_width(shape.params, n_layer))
    tokens = batch_size * seq_len
    dtype = DTYPES[precision]
    if machine is None:
        machine = measure_machine(threads=cpu_threads, tokens=tokens, linear_shapes=shape.linear_shapes, dtype=dtype)
    world = devices * num_nodes
    args = (dtype, machine, devices, num_nodes, options, batch_size, seq_len, n_layer, activation_checkpointing)
    memory = _memory(shape, *args)
    threads = memory.resolved["sync"].cpu_threads  # the thread rule does not depend on the schedule
    layout = memory.layout
    flops = accumulate_grad_batches * tokens * (6 * shape.matmul_params + 12 * (n_layer or 0) * shape.hidden * seq_len)
    steps = {
        s: step_time(layout, dtype, s, machine, threads, devices, flops, accumulate_grad_batches) for s in SCHEDULES
    }
    plain = None
    if machine.device_type != "cpu":
        activations = memory.activations.bytes if memory.activations else 0
        plain = PLAIN_DEVICE_BYTES_PER_PARAM * shape.params + 4 * shape.frozen + activations
    result = Plan(
        params=shape.params,
        shard_params=layout.shard_numel,
        world_size=world,
        ranks_per_node=devices,
        tokens_per_step=tokens * accumulate_grad_batches * world,
        machine=machine,
        host=memory.host,
        device_bytes=memory.device_states,
        steps=steps,
        bucket_size_mb=bucket_size_mb,
        cpu_threads=threads,
        checkpoint_format=checkpoint_format,
        activations=memory.activations,
        device_total=memory.device_total,
        verdicts=memory.verdicts,
        plain_device_bytes=plain,
        resolved=memory.resolved,
    )
    chosen = _chosen_format(memory.verdicts, checkpoint_format)
    if chosen is not None:
        allowed = [s for s in SCHEDULES if memory.verdicts[f"{s}/{chosen}"].fits]
        result.recommended = recommend(
            shape, dtype, machine, devices, world, flops, accumulate_grad_batches, allowed=allowed
        )
        result.recommended["checkpoint_format"] = chosen
    if not memory.verdicts[f"sync/{checkpoint_format}"].fits or chosen is None:
        result.fixes = _fixes(shape, args, memory, checkpoint_format)
    result.notes = _notes(result)
    return result


def _width(params: int, n_layer: int) -> int:
    """A transformer's hidden size from its parameter count: about 12 x hidden^2 per layer."""
    return max(64, 64 * round(math.sqrt(params / (12 * n_layer)) / 64))


def _chosen_format(verdicts: dict[str, Verdict], asked: str) -> str | None:
    """The asked checkpoint format if some schedule fits with it, else the other one if that fits."""
    for checkpoint_format in (asked, *(f for f in CHECKPOINT_FORMATS if f != asked)):
        if any(verdicts[f"{s}/{checkpoint_format}"].fits for s in SCHEDULES):
            return checkpoint_format
    return None


def _fixes(shape: ModelShape, args: tuple, memory: _Memory, asked: str) -> list[str]:
    """The smallest single changes with which an exact schedule fits, each checked by recomputing. A change
    that fits only with the other checkpoint format says so."""
    dtype, machine, devices, num_nodes, options, batch, seq_len, n_layer, checkpointing = args

    def fitting_format(m: _Memory) -> str | None:
        for checkpoint_format in (asked, *(f for f in CHECKPOINT_FORMATS if f != asked)):
            if any(m.verdicts[f"{s}/{checkpoint_format}"].fits for s in EXACT_SCHEDULES):
                return checkpoint_format
        return None

    def also(checkpoint_format: str | None) -> str:
        return "" if checkpoint_format == asked else f' and checkpoint_format="{checkpoint_format}"'

    fixes = []
    if fitting_format(memory) not in (None, asked):
        fixes.append(f'checkpoint_format="{fitting_format(memory)}" (a save then gathers no copy of the fp32 state)')
    failed = {c.name.split(",")[0].split(" per ")[0] for v in memory.verdicts.values() for c in v.failed}
    device_fails = "device memory" in failed
    if dtype != torch.float32 and shape.built_bytes > 2 * (shape.params + shape.frozen):
        bf16 = replace(shape, module_bytes=2 * (shape.params + shape.frozen))
        found = fitting_format(_memory(bf16, *args))
        if found:
            fixes.append(
                f"build the module in {str(dtype).split('.')[-1]} (module.to(torch.{str(dtype).split('.')[-1]}) "
                f"before fit): {_gb(bf16.built_bytes)} instead of {_gb(shape.built_bytes)} on the host until setup; "
                "the master weights and Adam state stay fp32, initialised from the rounded values" + also(found)
            )
    if n_layer and not checkpointing and device_fails:
        again = _memory(shape, dtype, machine, devices, num_nodes, options, batch, seq_len, n_layer, True)
        found = fitting_format(again)
        if found:
            fixes.append(
                f"activation checkpointing: activations {_gb(memory.activations.bytes)} -> "
                f"{_gb(again.activations.bytes)} per GPU" + also(found)
            )
    if n_layer and device_fails and batch > 1:
        for b in range(batch - 1, 0, -1):
            smaller = _memory(shape, dtype, machine, devices, num_nodes, options, b, seq_len, n_layer, checkpointing)
            found = fitting_format(smaller)
            if found:
                fixes.append(f"a micro-batch of {b} (accumulate_grad_batches keeps the tokens per step)" + also(found))
                break
    if failed & {"host RAM"} and not device_fails:  # ZeRO-2 shards the CPU state over nodes, never the device's
        for nodes in range(num_nodes + 1, 1025):
            more = _memory(shape, dtype, machine, devices, nodes, options, batch, seq_len, n_layer, checkpointing)
            found = fitting_format(more)
            if found:
                fixes.append(
                    f"{nodes} nodes (num_nodes={nodes}): the CPU state per node is 16 B x params / nodes; the module "
                    "as built is not sharded" + also(found)
                )
                break
            if more.host["sync"].transient_model_per_rank * devices >= machine.host_memory_gb * GB:
                break  # the module as built alone does not fit: more nodes never help

    def of_size(params: int) -> ModelShape:  # a narrower model of the same depth
        width = _width(params, n_layer) if n_layer and shape.shapes is None else shape.hidden
        return ModelShape(None, params, shape.linear_shapes, width, params)

    low, high = 0, shape.params
    while high - low > max(1, shape.params // 1000):
        mid = (low + high) // 2
        if fitting_format(_memory(of_size(mid), *args)):
            low = mid
        else:
            high = mid
    if low > 0:
        found = fitting_format(_memory(of_size(low), *args))
        fixes.append(
            f"a model of at most {low / 1e9:.2f}B parameters" + also(found) + " (freezing parameters removes their "
            "16 B/param of CPU state, but not their memory while the module is built nor on the device)"
        )
    return fixes


BUCKET_CHOICES_MB = (1, 2, 4, 8, 16, 25, 32, 64, 128, 256)
EXACT_SCHEDULES = ("sync", "speculative")  # same result as a plain optimizer step; delayed uses stale weights


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
    shape: ModelShape,
    dtype: torch.dtype,
    machine: Machine,
    ranks_per_node: int,
    world: int,
    flops: float,
    micro: int,
    allowed: list[str] | tuple[str, ...] = SCHEDULES,
) -> dict[str, object]:
    """Threads, bucket size and schedule with the shortest predicted step, among the ``allowed`` schedules
    (those that fit in memory; none allowed: an empty dict).

    Threads: the fewest that pull the rank's share of the node's bandwidth (the others stay free for the
    data loader); buckets: the smallest size within 1% of the fastest (less device memory, earlier
    start); schedule: the fastest exact one (delayed is reported, not recommended: it changes the
    optimizer's result, docs/dpu.md).
    """
    exact = [s for s in EXACT_SCHEDULES if s in allowed]
    if not exact:
        return {}
    cores = _resolve(OffloadOptions(), machine, dtype, world, ranks_per_node).cpu_threads  # the engine's default
    threads = cores
    if machine.device_type != "cpu" and machine.host_bandwidth_per_thread_gbs:
        share = machine.host_bandwidth_gbs / ranks_per_node
        threads = min(cores, max(1, math.ceil(0.95 * share / machine.host_bandwidth_per_thread_gbs)))
    layouts = {mb: _layout(shape, mb, dtype, world) for mb in BUCKET_CHOICES_MB}
    best: dict[str, tuple[float, float]] = {}
    for schedule in [s for s in SCHEDULES if s in allowed]:
        totals = []
        for mb, layout in layouts.items():
            totals.append(
                (step_time(layout, dtype, schedule, machine, threads, ranks_per_node, flops, micro).total, mb)
            )
        fastest = min(t for t, _ in totals)
        best[schedule] = next((t, mb) for t, mb in totals if t <= 1.01 * fastest)
    schedule = min(exact, key=lambda s: best[s][0] * (1.0 if s == "sync" else 1.02))  # ties: sync
    step_s, bucket_mb = best[schedule]
    delayed = best.get("delayed")  # None: delayed does not fit in memory
    return {
        "cpu_step": schedule,
        "bucket_size_mb": bucket_mb,
        "cpu_threads": threads,
        "step_s": step_s,
        "delayed_step_s": delayed[0] if delayed else None,
        "delayed_speedup": step_s / delayed[0] if delayed else None,
    }


def _notes(result: Plan) -> list[str]:
    m = result.machine
    notes = []
    if result.world_size > 1 and m.interconnect_gbs is None:
        notes.append("reduce-scatter/all-gather time not included (pass interconnect_gbs)")
    if m.device_type == "cpu":
        notes.append(
            "CPU device: forward/backward and the CPU step share the cores, so no schedule overlaps them; the "
            "device's memory is host memory, counted in the host RAM above"
        )
    elif m.device_memory_gb is None:
        notes.append("device memory not checked: the machine's device_memory_gb is not known")
    if result.activations is None:
        notes.append("device memory: model states only; activations are not estimated without n_layer")
    return notes


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
    (:func:`~lightning_zero_offload.engine.options.resolve`: the schedule, in place or not, the rollback)."""
    shard, element = layout.shard_numel, dtype.itemsize
    max_shard, max_bucket = layout.max_shard, layout.max_bucket
    low = dtype != torch.float32
    pin, schedule = config.pin_memory, config.cpu_step
    module = 4 * params if module_bytes is None else module_bytes
    saves = {f: checkpoint_save_bytes(params, f, layout.world_size) for f in CHECKPOINT_FORMATS}
    if config.in_place:
        # In place (engine/in_place.py): the parameters are the master; gradients are autograd's own tensors.
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
    if schedule == "speculative":
        # Speculated low-precision results wait for validation; "snapshot" (fp16's default) keeps a copy
        # of master and moments to take a step back bitwise.
        buffers["speculated_out"] = shard * element if low else 0
        buffers["snapshot"] = 12 * shard if config.speculation_rollback == "snapshot" else 0
    # Model-sized buffers are never pinned: they reach the device through HostToDevice's two pinned buffers.
    buffers["h2d_staging"] = 2 * max_shard * element if pin and pageable_published else 0
    pinned = buffers["grad_staging"] + buffers["publish_pool"] + buffers["h2d_staging"]
    # Allocated before the module's parameters are replaced by views of the flat buffer (the engine's publisher).
    first = 16 * shard
    if device_type == "cpu":  # the "device" is host memory too
        buffers["device_params"] = layout.flat_numel * element
        buffers["device_grad_buckets"] = 2 * max_bucket * element
        first += buffers["device_params"]
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
