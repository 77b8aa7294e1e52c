"""Host memory of the parameter-offload mode per parameter, against FSDP2 + ``CPUOffloadPolicy`` + torch's
``AdamW(fused=True)`` (what a user would pick instead), on the CPU device.

Each case runs in fresh processes (``lightning_zero_offload.testing.ranks.run_ranks``, gloo; 1 or 2 ranks):
take the resident set after the imports, build a stack of ``Linear(2048, 2048)`` residual blocks (fp32),
put it on FSDP2 (each block, then the root; shards on the host; bf16 compute, fp32 reduce), build the
optimizer, and train three steps with clipping by norm. Per rank, relative to that baseline and divided by
the whole model's parameter count:

- ``held``: the resident set after the last step, its gradients still held (what stays between steps);
- ``peak``: the kernel's high-water mark (VmHWM) over building and training. On a CPU device it includes
  FSDP2's per-block transients (all-gathered block, its unsharded gradient, the reduce-scatter input),
  which on an accelerator are device memory; ``held`` does not.

The cases: the anchor (its shards, gradients and fused AdamW state); ours with fp32 state and with
``cpu_state="bf16"`` (the sharded parameter a bf16 master), each with ``cpu_step="sync"`` (the mode's
default) and ``"speculative"`` (opt in: it keeps a snapshot of each speculated shard's master and
moments). Each once with glibc's defaults and once with ``MALLOC_MMAP_THRESHOLD_=131072`` (its dynamic
mmap threshold otherwise keeps freed block-sized buffers in the heap: docs/design/offload-params-spike.md,
section 5).

    python benchmarks/offload_params_memory.py                 # 100.7M params; 1 and 2 ranks (minutes)
    python benchmarks/offload_params_memory.py --quick         # a small model, one rank, glibc's defaults:
                                                               # the logic only (fixed costs dominate)
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import reset_peak, status  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "offload_params"
MMAP_THRESHOLD = "131072"
CLIP = 1.0
TARGETS = {"ours bf16, sync": 8.5, "ours fp32, sync": 16.5}  # B/param of host memory (held)
BF16_OVER_ANCHOR = 0.55  # ours-bf16 RSS at most this fraction of the anchor's


@dataclass(frozen=True)
class Case:
    name: str
    cpu_state: str | None = None  # None: the anchor
    cpu_step: str = "sync"


CASES = [
    Case("anchor: FSDP2 + AdamW(fused)"),
    Case("ours fp32, sync", "fp32", "sync"),
    Case("ours fp32, speculative", "fp32", "speculative"),
    Case("ours bf16, sync", "bf16", "sync"),
    Case("ours bf16, speculative", "bf16", "speculative"),
]
TWO_RANK_CASES = ["anchor: FSDP2 + AdamW(fused)", "ours fp32, sync", "ours bf16, sync"]


class LinearBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x


class Stack(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LinearBlock(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def measure(rank: int, case: Case, blocks: int, width: int, steps: int = 3) -> dict[str, Any]:
    """One rank of one case: resident bytes above the post-import baseline, held and peak (see the module)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from lightning_zero_offload.core import ParamOffloadSession, make_offload_options

    world = torch.distributed.get_world_size()
    cpu = torch.device("cpu")
    gc.collect()
    base = status("VmRSS")
    reset_peak()
    torch.manual_seed(0)
    model = Stack(blocks, width)
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"rank": rank, "world": world, "params": params}
    if case.cpu_state is None:
        policy = {
            "mesh": init_device_mesh("cpu", (world,)),
            "offload_policy": CPUOffloadPolicy(pin_memory=False),
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        }
        for block in model.blocks:
            fully_shard(block, **policy)
        fully_shard(model, **policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    else:
        overlap = case.cpu_step == "speculative"  # as on an accelerator: the step on a worker during backward
        options = make_offload_options(
            offload_params=True, cpu_state=case.cpu_state, cpu_step=case.cpu_step, overlap=overlap
        )
        ParamOffloadSession.shard(model, cpu, "bf16-mixed", options, world)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        session = ParamOffloadSession.start(model, [optimizer], cpu, "bf16-mixed", options, world, world)
    # bf16 like the compute: ours leaves inputs as they are (as under autocast), FSDP2's default casts them
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank)).bfloat16()
    for _ in range(steps):
        loss = model(x).float().square().mean()
        if case.cpu_state is None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
        else:
            session.zero_grad()
            session.expect_step(publish_early=True)
            session.begin_backward()
            loss.backward()
            session.finish_backward()
            session.clip_norm(CLIP)
            session.step()
    out["held_bytes"] = status("VmRSS") - base
    out["peak_bytes"] = status("VmHWM") - base
    if case.cpu_state is not None:
        out["engine_host_state_bytes"] = session.memory_report()["host_state_bytes"]
        session.close()
    else:
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        out["optimizer_state_bytes"] = sum(
            (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes() for t in state
        )
    return out


def run_case(case: Case, world: int, malloc_env: bool, blocks: int, width: int) -> dict[str, Any]:
    """``case`` at ``world`` fresh ranks, with or without ``MALLOC_MMAP_THRESHOLD_`` in their environment."""
    from lightning_zero_offload.testing.ranks import run_ranks

    saved = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if malloc_env:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # the ranks inherit it: glibc reads it at start
    try:
        with tempfile.TemporaryDirectory() as tmp:
            rank = functools.partial(measure, case=case, blocks=blocks, width=width)
            preload = ("lightning_zero_offload.core",)
            ranks = run_ranks(rank, world, tmp, timeout=900, preload=preload)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if saved is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    params = ranks[0]["params"]
    row: dict[str, Any] = {"case": case.name, "world": world, "malloc_mmap_threshold_env": malloc_env}
    row |= {"params": params, "ranks": ranks}
    row["held_bytes_per_param"] = max(r["held_bytes"] for r in ranks) / params  # the fullest rank
    row["peak_bytes_per_param"] = max(r["peak_bytes"] for r in ranks) / params
    return row


def judge(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, per allocator setting, on the held bytes (peak beside it)."""
    verdict: dict[str, Any] = {}
    for env in (False, True):
        one = {r["case"]: r for r in rows if r["world"] == 1 and r["malloc_mmap_threshold_env"] == env}
        key = f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}" if env else "glibc defaults"
        if not one:
            continue
        checks: dict[str, Any] = {}
        for name, limit in TARGETS.items():
            if name in one:
                held = one[name]["held_bytes_per_param"]
                checks[f"{name} <= {limit} B/param"] = {"held": held, "peak": one[name]["peak_bytes_per_param"]}
                checks[f"{name} <= {limit} B/param"]["met"] = held <= limit
        anchor = one.get(CASES[0].name)
        if anchor and "ours bf16, sync" in one:
            ratio = one["ours bf16, sync"]["held_bytes_per_param"] / anchor["held_bytes_per_param"]
            peak = one["ours bf16, sync"]["peak_bytes_per_param"] / anchor["peak_bytes_per_param"]
            checks[f"ours bf16 / anchor <= {BF16_OVER_ANCHOR}"] = {
                "held": ratio,
                "peak": peak,
                "met": ratio <= BF16_OVER_ANCHOR,
            }
        two = {r["case"]: r for r in rows if r["world"] == 2 and r["malloc_mmap_threshold_env"] == env}
        for name, row in two.items():
            if name in one:
                checks[f"{name}: per rank at 2 ranks / 1 rank"] = {
                    "held": row["held_bytes_per_param"] / one[name]["held_bytes_per_param"],
                    "peak": row["peak_bytes_per_param"] / one[name]["peak_bytes_per_param"],
                }
        verdict[key] = checks
    return verdict


def print_rows(rows: list[dict[str, Any]], verdict: dict[str, Any]) -> None:
    params = rows[0]["params"]
    print(f"{params / 1e6:.1f}M params, bf16 compute on a CPU device; bytes per parameter of the whole model, per rank")
    print(f"  {'case':<30} {'ranks':>5} {'malloc env':>10} {'held B/param':>12} {'peak B/param':>12} {'held MB':>8}")
    for r in rows:
        env = "set" if r["malloc_mmap_threshold_env"] else "-"
        held_mb = max(x["held_bytes"] for x in r["ranks"]) / 2**20
        print(
            f"  {r['case']:<30} {r['world']:>5} {env:>10} {r['held_bytes_per_param']:12.2f}"
            f" {r['peak_bytes_per_param']:12.2f} {held_mb:8.0f}"
        )
    for setting, checks in verdict.items():
        print(f"\ntargets, {setting} (held; peak in brackets):")
        for label, check in checks.items():
            met = "" if "met" not in check else (" met" if check["met"] else " NOT met")
            print(f"  {label}: {check['held']:.3f} [{check['peak']:.3f}]{met}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model, one rank, glibc's defaults only")
    parser.add_argument("--blocks", type=int, default=None, help="Linear(width, width) blocks (default 24, quick 4)")
    parser.add_argument("--width", type=int, default=None, help="default 2048 (quick 256)")
    parser.add_argument("--no-two-ranks", action="store_true", help="skip the 2-rank cases")
    parser.add_argument("--cases", nargs="+", help="run only these cases (by name)")
    parser.add_argument("--out", default=str(RESULTS / "memory.json"))
    args = parser.parse_args()
    blocks = args.blocks or (4 if args.quick else 24)
    width = args.width or (256 if args.quick else 2048)
    cases = [case for case in CASES if args.cases is None or case.name in args.cases]
    plan = [(case, 1, env) for env in ((False,) if args.quick else (False, True)) for case in cases]
    if not (args.quick or args.no_two_ranks):
        plan += [(case, 2, True) for case in cases if case.name in TWO_RANK_CASES]
    rows = []
    for case, world, env in plan:
        rows.append(run_case(case, world, env, blocks, width))
        print(f"measured {case.name}, {world} rank(s), malloc env {'set' if env else 'unset'}", flush=True)
    verdict = judge(rows)
    print_rows(rows, verdict)
    record = {
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "libc": platform.libc_ver(),
            "load_average_1_5_15min_at_end": os.getloadavg(),
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", *sys.argv]),
        "blocks": blocks,
        "width": width,
        "clip_norm": CLIP,
        "cases": [asdict(case) for case in CASES],
        "rows": rows,
        "targets": verdict,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
