"""The plan as text: what fits, where the step's time goes, what to set."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_zero_offload.planner.model import SCHEDULES, _gb

if TYPE_CHECKING:
    from lightning_zero_offload.planner.model import Plan


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def format_plan(p: Plan) -> str:
    m = p.machine
    lines = [
        f"zero_offload plan: {p.params / 1e6:.1f}M trainable params, {p.world_size} rank(s) "
        f"({p.ranks_per_node} per node), {p.shard_params / 1e6:.1f}M params per rank's shard, "
        f"{p.tokens_per_step} tokens per step, bucket {p.bucket_size_mb:g} MB, {p.cpu_threads} CPU thread(s)/rank",
        f"machine: {m.name}: host {m.host_bandwidth_gbs:.0f} GB/s ({m.cpu_cores} cores), "
        f"device {m.device_tflops:.1f} TFLOP/s achieved, link {m.d2h_gbs:.0f}/{m.h2d_gbs:.0f} GB/s down/up",
        "",
        "host RAM per rank (sync / speculative / delayed):",
    ]
    names = list(dict.fromkeys(name for s in SCHEDULES for name in p.host[s].per_rank))
    for name in names:
        values = [p.host[s].per_rank.get(name, 0) for s in SCHEDULES]
        if any(values):
            lines.append(f"  {name:<22}" + " / ".join(_gb(v) for v in values))
    lines += [
        "  " + "total per node".ljust(22) + " / ".join(_gb(p.host[s].per_node) for s in SCHEDULES),
        f"  of which pinned per rank: {_gb(p.host['sync'].pinned_per_rank)}; "
        f"the module as built stays on the host until setup: {_gb(p.host['sync'].transient_model_per_rank)} per rank",
        "device memory per rank (model states): "
        + ", ".join(f"{k} {_gb(v)}" for k, v in p.device_bytes.items())
        + f" = {_gb(sum(p.device_bytes.values()))}",
        "",
        "step time, ms    fwd+bwd  transfer  cpu step  copy-back  waited-for    total  bound by",
    ]
    for s in SCHEDULES:
        t = p.steps[s]
        lines.append(
            f"  {s:<13} {_ms(t.forward_backward):>9} {_ms(t.transfer):>9} {_ms(t.cpu_step):>9} {_ms(t.copy_back):>10}"
            f" {_ms(t.exposed):>11} {_ms(t.total):>8}  {t.bound_by}"
        )
    r = p.recommended
    lines += [
        "",
        f"recommended: cpu_step={r['cpu_step']!r}, bucket_size_mb={r['bucket_size_mb']}, "
        f"cpu_threads={r['cpu_threads']} -> {_ms(r['step_s'])} ms/step",
        f"  (cpu_step='delayed' would take {_ms(r['delayed_step_s'])} ms, {r['delayed_speedup']:.2f}x, "
        "with one step of staleness: check convergence, docs/dpu.md)",
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
