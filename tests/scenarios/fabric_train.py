"""A Fabric training loop, launched by Fabric's own launcher (devices=N on the CPU), or run in-process.

Run by tests/test_fabric.py in a subprocess for multi-process runs; rank 0 writes what the test
compares to --out. Every rank draws its part of the same global batch, so world sizes compare.
"""

from __future__ import annotations

import argparse
import os
import sys

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
) -> dict:
    """Train the shared MLP with two param groups and a scheduler; returns losses and fp32 weights."""
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
        loss = loss_fn(model, (x, y))
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="zero_offload")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--format", default="full")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    strategy = args.strategy
    if strategy == "zero_offload":
        strategy = lightning_zero_offload.ZeroOffloadFabricStrategy(checkpoint_format=args.format, bucket_size_mb=0.002)
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    result = train(fabric, args.steps, resume=args.resume, save=args.save, save_at=args.save_at)
    if fabric.is_global_zero:
        torch.save(result, args.out)
    fabric.barrier()


if __name__ == "__main__":
    main()
