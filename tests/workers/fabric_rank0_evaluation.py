"""Fabric at 2 ranks with cpu_step="delayed": rank 0 alone evaluates between steps (model.eval() under no_grad,
the usual ``if fabric.is_global_zero:`` sample). Bringing the weights up to date is a collective there, which only
rank 0 would enter. Started by tests/fabric/test_strategy.py through Lightning's launcher; each rank prints that it
finished, and rank 0 the warning it got."""

import os
import sys
import warnings

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine_helpers import batches, loss_fn, make_net  # noqa: E402

from lightning_zero_offload import ZeroOffloadFabricStrategy  # noqa: E402


def main() -> None:
    strategy = ZeroOffloadFabricStrategy(bucket_size_mb=0.002, cpu_step="delayed", dpu_warmup_steps=2, timeout=60)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    net = make_net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for step, batch in enumerate(batches(6)):
        fabric.backward(loss_fn(model, batch))
        optimizer.step()
        optimizer.zero_grad()
        if step == 3 and fabric.is_global_zero:
            model.eval()
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                model(batch[0])
            model.train()
            print("rank 0 was told:", *[str(w.message) for w in caught], flush=True)
    print(f"rank {fabric.global_rank} finished", flush=True)


if __name__ == "__main__":
    main()
