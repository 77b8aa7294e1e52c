"""What :func:`~lightning_zero_offload.planner.plan` returns, and the plan as text: what fits (first, when
nothing does), where the step's time goes, what to set."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from lightning_zero_offload.engine.options import Resolved
from lightning_zero_offload.planner.machine import GB, Machine, format_gb
from lightning_zero_offload.planner.memory import (
    ALLOCATOR_OVERHEAD,
    CHECKPOINT_FORMATS,
    DEVICE_CONTEXT_BYTES,
    Activations,
    HostMemory,
)
from lightning_zero_offload.planner.offload_params import ParamsOffload
from lightning_zero_offload.planner.timing import StepTime
from lightning_zero_offload.planner.verdicts import Check, Verdict


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
    device_total: int = 0  # model states + frozen parameters + activations + the runtime, per device
    device_runtime: int = 0  # of which the CUDA context and the caching allocator's overhead (memory.py)
    activation_room: int | None = None  # activation bytes any model shape may use per device (None: not known)
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # "schedule/format" -> verdict
    plain_device_bytes: int | None = None  # plain training without offload (16 B/param + activations + runtime)
    fixes: list[str] = field(default_factory=list)  # the smallest changes that would fit, when nothing does
    cpu_state: str = "fp32"  # the option planned: the dtype of master, moments and gradient buffers on the host
    params_offload: ParamsOffload | None = None  # offload_params=True: FSDP2's units, the traffic per step

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules planned: all three, or with offload_params or a device share the exact ones (delayed is
        refused)."""
        return tuple(self.steps)

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
        """The plan as JSON-ready data (dtypes as their names, e.g. "bfloat16")."""
        out = asdict(self)
        out["fits"] = self.fits
        out["plain_fits_device"] = self.plain_fits_device
        for key, verdict in self.verdicts.items():
            out["verdicts"][key]["fits"] = verdict.fits
        for key, resolved in self.resolved.items():
            out["resolved"][key]["state_dtype"] = str(resolved.state_dtype).removeprefix("torch.")
        if self.params_offload is None:
            del out["params_offload"]
        else:  # one entry per tensor: what the pinned rounding is computed from, not a figure to read
            del out["params_offload"]["units"]["tensor_shards"]
        return out

    def __str__(self) -> str:
        return format_plan(self)


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def _g(nbytes: float) -> str:
    return f"{nbytes / GB:.1f}"


def _why(check: Check) -> str:
    return f"{check.name.split(' (')[0]} {_g(check.need)} GB > {_g(check.available or 0)} GB"


def _failures(v: Verdict) -> str:
    return "; ".join(_why(c) for c in v.failed)


def format_plan(p: Plan) -> str:
    m = p.machine
    offload = p.params_offload
    if offload is None:
        moves = f"bucket {p.bucket_size_mb:g} MB"
    else:
        units = offload.units
        moves = f"{units.units} FSDP2 units of up to {units.largest_unit / 1e6:.1f}M params"
    lines = [
        f"{'zero_offload_params' if offload else 'zero_offload'} plan: {p.params / 1e6:.1f}M trainable params, "
        f"{p.world_size} rank(s) ({p.ranks_per_node} per node), {p.shard_params / 1e6:.1f}M params per rank's shard, "
        f"{p.tokens_per_step} tokens per step, {moves}, {p.cpu_threads} CPU thread(s)/rank",
        f"machine: {m.name}: host {m.host_bandwidth_gbs:.0f} GB/s ({m.cpu_cores} cores, {m.host_memory_gb:.0f} GB), "
        f"device {m.device_tflops:.1f} TFLOP/s achieved"
        + (f", {m.device_memory_gb:.0f} GB" if m.device_memory_gb is not None and m.device_type != "cpu" else "")
        + f", link {m.d2h_gbs:.0f}/{m.h2d_gbs:.0f} GB/s down/up",
        "",
    ]
    if not p.fits:
        lines.append("DOES NOT FIT: no configuration of zero_offload fits this machine's memory.")
        for key, verdict in p.verdicts.items():
            lines.append(f"  {key:<20} {_failures(verdict)}")
        if p.fixes:
            lines.append("Smallest changes that would fit:")
            lines += [f"  - {fix}" for fix in p.fixes]
        lines.append("")
    lines += _plain(p)
    lines += _memory_table(p)
    lines += ["", "step time, ms    fwd+bwd  transfer  cpu step  copy-back  waited-for    total  bound by"]
    for s in p.schedules:
        t = p.steps[s]
        lines.append(
            f"  {s:<13} {_ms(t.forward_backward):>9} {_ms(t.transfer):>9} {_ms(t.cpu_step):>9} {_ms(t.copy_back):>10}"
            f" {_ms(t.exposed):>11} {_ms(t.total):>8}  {t.bound_by}"
        )
    if offload:
        lines += _traffic(p)
    lines.append("")
    r = p.recommended
    if r:
        asked = p.verdict("sync")
        if not asked.fits:
            lines.append(f'checkpoint_format="{p.checkpoint_format}" does not fit: {_failures(asked)}')
            if p.fixes:
                lines += [f"  it would fit with: {fix}" for fix in p.fixes]
        buckets = "offload_params=True" if offload else f"bucket_size_mb={r['bucket_size_mb']}"
        lines.append(
            f"recommended: cpu_step={r['cpu_step']!r}, checkpoint_format={r['checkpoint_format']!r}, "
            f"{buckets}, cpu_threads={r['cpu_threads']} -> {_ms(r['step_s'])} ms/step"
        )
        if offload:
            lines.append(
                "  (cpu_step='delayed' does not apply: FSDP2 gathers the master itself, there is no older copy)"
            )
        elif "delayed" not in p.schedules:
            lines.append("  (cpu_step='delayed' does not take a device_share: it updates the master one step behind)")
        elif r["delayed_step_s"] is not None:
            lines.append(
                f"  (cpu_step='delayed' would take {_ms(r['delayed_step_s'])} ms, {r['delayed_speedup']:.2f}x, "
                "with one step of staleness: check convergence, docs/dpu.md)"
            )
        else:
            delayed = p.verdict("delayed", str(r["checkpoint_format"]))
            lines.append(f"  (cpu_step='delayed' does not fit: {_failures(delayed)})")
    else:
        lines.append("recommended: nothing (no configuration fits; see DOES NOT FIT above)")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def _plain(p: Plan) -> list[str]:
    fits = p.plain_fits_device
    if fits is None:
        return []
    verdict = "fits" if fits else "does not fit"
    line = (
        "plain training without offload (16 B/param on each GPU"
        + (" + activations" if p.activations else "")
        + f" + runtime): {format_gb(p.plain_device_bytes)} of {p.machine.device_memory_gb:.1f} GB per GPU: {verdict}"
    )
    if fits:
        line += "; zero_offload is not needed for memory, and plain training has no CPU step to wait for"
    return [line, ""]


def _memory_table(p: Plan) -> list[str]:
    m = p.machine
    device = f"device per GPU of {m.device_memory_gb:.1f}" if m.device_type != "cpu" and m.device_memory_gb else ""
    lines = [
        f"memory, GB (host per node of {m.host_memory_gb:.1f}" + (f"; {device}" if device else "") + "):",
        "  schedule      training   setup  save full  save sharded  device   fits: full / sharded",
    ]
    for s in p.schedules:
        h = p.host[s]
        fits = " / ".join("yes" if p.verdicts[f"{s}/{f}"].fits else "NO" for f in CHECKPOINT_FORMATS)
        lines.append(
            f"  {s:<13} {_g(h.steady_per_node):>8} {_g(h.setup_per_node):>7} {_g(h.save_per_node('full')):>10}"
            f" {_g(h.save_per_node('sharded')):>13} {_g(p.device_total):>7}   {fits}"
        )
    lines.append(f"host RAM per rank by buffer ({' / '.join(p.schedules)}):")
    names = list(dict.fromkeys(name for s in p.schedules for name in p.host[s].per_rank))
    for name in names:
        values = [p.host[s].per_rank.get(name, 0) for s in p.schedules]
        if any(values):
            lines.append(f"  {name:<22}" + " / ".join(format_gb(v) for v in values))
    lines.append(
        f"  host state per parameter of the rank's shard with cpu_state={p.cpu_state!r}: "
        + ", ".join(f"{s} {p.host[s].state_per_rank / max(1, p.shard_params):.1f} B" for s in p.schedules)
        + " (master, moments, gradient buffers and the schedule's own)"
    )
    sync = p.host["sync"]
    saves = ", ".join(f'{format_gb(v)} ("{f}")' for f, v in sync.checkpoint_save_per_rank.items())
    first = ", ".join(f'{format_gb(v)} ("{f}")' for f, v in sync.checkpoint_save_first_rank.items() if v)
    if first:  # the format gathers the whole state on the first rank
        saves += f" per rank, and the first rank {first} more"
    if p.params_offload is None:
        held = "the module as built stays on the host until setup"
        whole = " (ZeRO-2: every GPU holds all parameters, whatever the number of nodes)"
    else:
        if p.params_offload.configure_model:
            held = "built in configure_model, one block is whole on the host at setup (fp32)"
        else:
            held = "the module built whole stays on the host until setup (configure_model would hold one block)"
        flight = "one block" if p.world_size == 1 else "two blocks"  # FSDP2 prefetches at several ranks only
        whole = f" (offload_params: the root's parameters and {flight} in flight, whatever the number of blocks)"
    lines.append(
        f"  of which pinned per rank: {format_gb(sync.pinned_per_rank)}; {held}: "
        f"{format_gb(sync.transient_model_per_rank)} per rank; a save adds {saves}" + ("" if first else " per rank")
    )
    lines.append(
        "device memory per GPU: "
        + ", ".join(f"{k} {format_gb(v)}" for k, v in p.device_bytes.items())
        + (f", activations {format_gb(p.activations.bytes)}" if p.activations else "")
        + (f", runtime {format_gb(p.device_runtime)}" if p.device_runtime else "")
        + f" = {format_gb(p.device_total)}{whole}"
    )
    if p.activations:
        lines.append(f"  activations estimated as {p.activations.formula}")
        if p.activations.assumed_shape:
            lines.append(f"  n_layer not given: the shape is assumed, {p.activations.assumed_shape}")
    if p.device_runtime:
        lines.append(
            f"  runtime: the CUDA context ({format_gb(DEVICE_CONTEXT_BYTES)}) and the caching allocator's overhead "
            f"({ALLOCATOR_OVERHEAD:.0%} of the activations"
            + (" and of the blocks' buffers)" if p.params_offload else ")")
        )
    if p.activation_room is not None:
        room = "nothing" if p.activation_room <= 0 else format_gb(p.activation_room)
        states = "the root's parameters, the blocks' buffers" if p.params_offload else "the model states"
        lines.append(f"  room for activations per GPU, after {states} and the runtime: {room}")
    return lines


def _traffic(p: Plan) -> list[str]:
    """offload_params: what one optimizer step moves per rank."""
    moved = p.params_offload.traffic
    line = (
        f"traffic per step per rank: {format_gb(moved.up)} up (the shards, gathered for forward and again for "
        f"backward), {format_gb(moved.down)} down (the reduced gradient shards), every micro-batch"
    )
    if p.world_size > 1:
        line += (
            f"; interconnect {format_gb(moved.all_gather)} all-gathered and {format_gb(moved.reduce_scatter)} "
            "reduce-scattered (fp32)"
        )
    return [line]
