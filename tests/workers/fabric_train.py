"""A Fabric training loop, launched by Fabric's own launcher (devices=N on the CPU), or run in-process.

Run by tests/fabric/test_strategy.py in a subprocess for multi-process runs, several one after another in the
same ranks; rank 0 writes what the test compares to each run's ``out``. A run is a dict: ``strategy``
("zero_offload" or a Fabric strategy name), ``precision``, ``steps``, ``format`` (checkpoint_format),
``resume``, ``save``, ``save_at``, ``out``. Every rank draws its part of the same global batch, so world
sizes compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine_helpers import batches, loss_fn, make_net, two_groups  # noqa: E402

import lightning_zero_offload  # noqa: E402,F401  (registers strategy="zero_offload" for Fabric)

GLOBAL_BATCH = 8


def train(
    fabric: L.Fabric,
    steps: int,
    clip: str | None = "norm",
    resume: str | None = None,
    save: str | None = None,
    save_at: int | None = None,
    seed: int = 0,
    accumulate: int = 1,
) -> dict:
    """Train the shared MLP with two param groups and a scheduler; returns losses and fp32 weights. ``accumulate``:
    each rank's share of a batch in that many micro-batches, in Fabric's recipe (``no_backward_sync`` but the last)."""
    net = make_net(seed, width=31)
    optimizer = two_groups(net)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    model, optimizer = fabric.setup(net, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if resume is not None:
        fabric.load(resume, state)
    world, rank = fabric.world_size, fabric.global_rank
    losses = []
    for x, y in batches(steps, seed=1)[state["step"] :]:
        share = GLOBAL_BATCH // world
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        for index, micro in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            with fabric.no_backward_sync(model, enabled=index < accumulate - 1):
                loss = loss_fn(model, micro) / accumulate
                fabric.backward(loss)
        if clip == "norm":
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
        elif clip == "value":
            fabric.clip_gradients(model, optimizer, clip_val=0.02)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state["step"] += 1
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        if save is not None and state["step"] == save_at:
            fabric.save(save, state)
    # zero_offload: the fp32 master weights (the module holds their bf16 copies while training)
    strategy = fabric.strategy
    weights = strategy.master_state_dict(model.module) if hasattr(strategy, "engine") else model.state_dict()
    weights = {k: v.detach().float().cpu().clone() for k, v in weights.items()}
    return {"losses": losses, "params": weights}


def run(spec: dict, devices: int) -> None:
    """One run; rank 0 writes what the test compares to ``spec["out"]``."""
    strategy = spec.get("strategy", "zero_offload")
    if strategy == "zero_offload":
        checkpoint_format = spec.get("format", "full")
        strategy = lightning_zero_offload.ZeroOffloadFabricStrategy(
            checkpoint_format=checkpoint_format, bucket_size_mb=0.002
        )
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=spec.get("precision", "32-true"))
    fabric.launch()
    saving = {"resume": spec.get("resume"), "save": spec.get("save"), "save_at": spec.get("save_at")}
    result = train(fabric, spec.get("steps", 12), **saving, accumulate=spec.get("accumulate", 1))
    if fabric.is_global_zero:
        torch.save(result, spec["out"])
    fabric.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--runs", required=True, help="a JSON list of runs, trained one after another")
    args = parser.parse_args()
    # Every run after the first reuses the ranks and the process group of the first (Fabric's launcher
    # starts the other ranks once; they run this same list).
    for spec in json.loads(Path(args.runs).read_text()):
        run(spec, args.devices)


if __name__ == "__main__":
    main()
