"""What it costs to show users' hooks the gradients: a step with Lightning's grad-norm logging idiom
(``grad_norm()`` in ``on_before_optimizer_step``) against the same step without it, side by side.

zero_offload keeps gradients on the CPU; where a hook may read ``p.grad`` it shows them (gathered whole,
copied to the device in the parameter's dtype, compared after the hook to find what it changed:
docs/usage.md). On a CPU "device" those copies are host memcpys. Plain Lightning (``strategy="auto"``)
pays for the idiom too (the norms themselves), so its own ratio is the baseline. Variants run
interleaved, fit after fit, medians of the per-step times after a warm-up.

    python benchmarks/gradient_hooks.py                 # the demo GPT (6 layers, 19M), 32-true
    python benchmarks/gradient_hooks.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.demo.model import GPT

ROOT = Path(__file__).resolve().parents[1]


class LogsGradNorm(L.Callback):
    """Lightning's documented idiom: the gradients' norms, in on_before_optimizer_step."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.last = grad_norm(pl_module, norm_type=2)["grad_2.0_norm_total"]


class StepClock(L.Callback):
    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())


def fit(strategy, hook: bool, steps: int) -> list[float]:
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",
        strategy=strategy,
        max_steps=steps,
        callbacks=[clock, *([LogsGradNorm()] if hook else [])],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    tokens = torch.randint(0, 256, (steps * 4, 129), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=128, n_layer=6, n_head=8, n_embd=512, dropout=0.0, warmup_steps=1)
    trainer.fit(model, data)
    return [b - a for a, b in zip(clock.starts, clock.starts[1:])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gradient_hooks.json")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    variants = {
        "auto": lambda: "auto",
        "zero_offload (offload path)": lambda: ZeroOffloadStrategy(in_place_on_cpu=False, metrics=False),
        "zero_offload (in place)": lambda: ZeroOffloadStrategy(metrics=False),
    }
    times: dict[tuple[str, bool], list[float]] = {(name, hook): [] for name in variants for hook in (False, True)}
    for _ in range(args.rounds):
        for name, make in variants.items():
            for hook in (False, True):
                times[name, hook] += fit(make(), hook, args.warmup + args.steps + 1)[args.warmup :]
    rows = {}
    print(f"{'variant':<30} {'no hook ms':>11} {'with hook ms':>13} {'hook / no hook':>15}")
    for name in variants:
        without, with_hook = (1e3 * statistics.median(times[name, hook]) for hook in (False, True))
        rows[name] = {"step_ms": without, "step_ms_with_hook": with_hook, "ratio": with_hook / without}
        print(f"{name:<30} {without:11.1f} {with_hook:13.1f} {with_hook / without:14.2f}x")
    args.out.write_text(json.dumps({"command": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
