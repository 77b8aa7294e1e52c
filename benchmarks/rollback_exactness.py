"""How far a rolled-back speculated step is from the synchronous one, per rollback and spike strength.

One step's gradient is multiplied by a factor (a loss spike) under clipping (by norm at 1.0, or by value
at 1.0), so clipping triggers on that step only; the speculative schedule has run that step's update
during backward and must take it back and redo it with the clip. Each run trains an MLP (two param
groups, AdamW, lr decaying each step) for 12 steps with the engine on the CPU (bf16 device parameters,
fp32 state, the offload data path) and compares with ``cpu_step="sync"``:

- update: the largest absolute change of any master weight over the spike's step, under sync;
- master: the largest difference of the master weights from sync after the run, relative to that update;
- exp_avg_sq: the largest relative difference of the second moments from sync.

    python benchmarks/rollback_exactness.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

from lightning_zero_offload.engine import OffloadEngine, OffloadOptions, SpeculativeOptions

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
SPIKE_STEP = 6


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def run(cpu_step: str, rollback: str, factor: float, clip: dict[str, float], steps: int = 12) -> dict:
    net = make_net()
    groups = [
        {"params": [p for n, p in net.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
        {"params": [p for n, p in net.named_parameters() if n.endswith("bias")], "weight_decay": 0.0},
    ]
    options = OffloadOptions(
        cpu_step=cpu_step, in_place_on_cpu=False, bucket_size_mb=0.01, speculative=SpeculativeOptions(rollback)
    )
    engine = OffloadEngine(torch.optim.AdamW(groups, lr=1e-3), CPU, torch.bfloat16, options)
    generator = torch.Generator().manual_seed(1)
    before = None
    for step in range(steps):
        x, y = torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator)
        if step == SPIKE_STEP:
            before = torch.cat([m.reshape(-1) for m in engine.master_params()])
        engine.expect_step(publish_early=True)
        engine.begin_backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(net(x).float(), y) * (factor if step == SPIKE_STEP else 1.0)
        loss.backward()
        engine.finish_backward()
        engine.step(**clip)
        if step == SPIKE_STEP:
            after = torch.cat([m.reshape(-1) for m in engine.master_params()])
        for group in engine.optimizer.param_groups:
            group["lr"] *= 0.9
    state = engine.optimizer_state_dict()["state"]
    return {
        "master": torch.cat([m.reshape(-1) for m in engine.master_params()]),
        "exp_avg_sq": torch.cat([entry["exp_avg_sq"].reshape(-1) for entry in state.values()]),
        "update": float((after - before).abs().max()),
        "rollbacks": engine.schedule.rollbacks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rollback_exactness.json")
    args = parser.parse_args()
    rows = []
    print("clip      factor   rollback   update     master/update   exp_avg_sq rel.   rollbacks")
    for clip_name, clip in (("norm 1.0", {"clip_norm": 1.0}), ("value 1.0", {"clip_value": 1.0})):
        for factor in (1.0, 1e1, 1e2, 1e3, 1e4, 1e5):
            sync = run("sync", "auto", factor, clip)
            for rollback in ("undo", "snapshot"):
                spec = run("speculative", rollback, factor, clip)
                master = float((spec["master"] - sync["master"]).abs().max()) / sync["update"]
                rel = (spec["exp_avg_sq"] - sync["exp_avg_sq"]).abs() / sync["exp_avg_sq"].abs().clamp_min(1e-30)
                row = {
                    "clip": clip_name,
                    "factor": factor,
                    "rollback": rollback,
                    "update": sync["update"],
                    "master_over_update": master,
                    "exp_avg_sq_relative": float(rel.max()),
                    "rollbacks": spec["rollbacks"],
                }
                rows.append(row)
                print(
                    f"{clip_name:9} {factor:7.0e}  {rollback:9}  {sync['update']:.2e}   {master:12.2e}"
                    f"   {row['exp_avg_sq_relative']:14.2e}   {spec['rollbacks']}"
                )
    args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
