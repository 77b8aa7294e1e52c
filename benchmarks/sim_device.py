"""The update schedules on a simulated accelerator: what overlapping the CPU step buys on a GPU system.

Why simulate: on a CPU-only machine the "device" work (forward/backward) and the CPU Adam step share
cores and memory bandwidth, so overlapping them cannot pay even on disjoint cores (measured: DPU 0.97x
of sync on a real model). On a GPU system the device computes from its own memory while the host
CPU is free. This benchmark models exactly that: every block of the model is a custom autograd
function that *sleeps* for a set time in forward and in backward (the GIL is released and the host
CPU is idle, as while a GPU kernel runs) and returns gradients of real size for real parameters. So
the engine's hooks, buckets, gradient copies, CPU Adam and copy-back are all real; only the device
compute is replaced by waiting.

It runs the real user path (a Lightning Trainer with ``accelerator="cpu"``, "bf16-mixed" and
``ZeroOffloadStrategy``) for each schedule, alternating short fits round after round so machine
noise hits them alike, and reports medians over the steps after each fit's warm-up. The device time
is swept relative to the CPU step measured first: ``--ratios`` are backward time / CPU step time,
from backward-bound to CPU-bound.

    python benchmarks/sim_device.py            # full sweep (a few minutes on a quiet machine)
    python benchmarks/sim_device.py --quick    # one point, a smaller model
    python benchmarks/sim_device.py --ratios 1 --rounds 5   # the targets' point, more rounds

The speculative schedule runs twice: publishing each speculated bucket to the device during backward
(what it does now) and only after validation (what it did before), side by side in the same rounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero_offload import ZeroOffloadStrategy, kernels

ROOT = Path(__file__).resolve().parent.parent
# The global gradient norm of every step; CLIP_QUIET leaves it alone, CLIP_EVERY_STEP clips every step.
GRAD_NORM, CLIP_QUIET, CLIP_EVERY_STEP = 0.5, 1.0, 0.1


@dataclass(frozen=True)
class Config:
    """One measured setting: an update schedule and a clipping threshold."""

    name: str
    schedule: str  # "sync" | "speculative" | "delayed"
    clip: float
    rollback: str = "auto"  # speculative: "auto" (the snapshot), or "undo" (the default before, inexact)


CONFIGS = [
    Config("sync", "sync", CLIP_QUIET),
    Config("speculative", "speculative", CLIP_QUIET),
    Config("speculative, undo rollback", "speculative", CLIP_QUIET, rollback="undo"),
    Config("delayed", "delayed", CLIP_QUIET),
    Config("sync, clip every step", "sync", CLIP_EVERY_STEP),
    Config("speculative, clip every step", "speculative", CLIP_EVERY_STEP),
]


# --------------------------------------------------------------------------------------------------
# the simulated device


class _SleepingDeviceWork(torch.autograd.Function):
    """Identity on the activations; the block's device time is spent asleep; fixed gradients come out."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, block: SleepingBlock, *weights: torch.Tensor) -> torch.Tensor:
        ctx.block = block
        time.sleep(block.forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        block: SleepingBlock = ctx.block
        time.sleep(block.backward_s)
        return (grad_out, None, *block.gradients())


_GRADIENTS: dict[tuple, list[torch.Tensor]] = {}  # built once per process, shared by every fit


class SleepingBlock(nn.Module):
    """A block with real parameters whose forward/backward take ``forward_s``/``backward_s`` of "device" time.

    Its gradients are fixed tensors (one per weight, in the weights' dtype) scaled so that a model of
    ``blocks`` such blocks has the global gradient norm ``grad_norm``: the clipping threshold alone
    decides whether clipping triggers. Autograd copies them into ``.grad`` (we keep a reference), so
    the engine gets a fresh gradient tensor every step, as from a real backward.
    """

    def __init__(self, shapes: list[tuple[int, ...]], blocks: int, grad_norm: float, seed: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.full(shape, 0.01)) for shape in shapes)
        self.forward_s = self.backward_s = 0.0
        self._scale = grad_norm / math.sqrt(blocks * sum(math.prod(s) for s in shapes))
        self._seed = seed

    def gradients(self) -> list[torch.Tensor]:
        weights = list(self.weights)
        key = (self._seed, self._scale, weights[0].dtype, *(w.shape for w in weights))
        if key not in _GRADIENTS:
            gen = torch.Generator().manual_seed(self._seed)
            _GRADIENTS[key] = [(torch.randn(w.shape, generator=gen) * self._scale).to(w.dtype) for w in weights]
        return _GRADIENTS[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepingDeviceWork.apply(x, self, *self.weights)


def sleeping_blocks(blocks: int, params_per_block: int, grad_norm: float = GRAD_NORM) -> nn.ModuleList:
    """``blocks`` sleeping blocks of about ``params_per_block`` parameters (two matrices and a bias each)."""
    width = max(1, round(math.sqrt(params_per_block / 4)))  # two (width x 2 width) matrices
    shapes = [(width, 2 * width), (2 * width, width), (width,)]
    return nn.ModuleList(SleepingBlock(shapes, blocks, grad_norm, seed) for seed in range(blocks))


def set_device_time(blocks: nn.ModuleList, forward_s: float, backward_s: float) -> None:
    """Device time per block."""
    for block in blocks:
        block.forward_s, block.backward_s = forward_s, backward_s


class SimulatedModel(L.LightningModule):
    """``blocks`` sleeping blocks of about ``params_per_block`` parameters (two matrices and a bias each)."""

    def __init__(self, blocks: int = 8, params_per_block: int = 4 * 2**20, grad_norm: float = GRAD_NORM) -> None:
        super().__init__()
        self.blocks = sleeping_blocks(blocks, params_per_block, grad_norm)

    def set_device_time(self, forward_s: float, backward_s: float) -> None:
        set_device_time(self.blocks, forward_s, backward_s)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return x.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)


# --------------------------------------------------------------------------------------------------
# running one configuration


def schedule_options(schedule: str) -> dict[str, Any]:
    """ZeroOffloadStrategy arguments selecting ``schedule``.

    Overlap is set explicitly: on a CPU device the strategy's defaults assume that the device and the
    CPU step share the cores, which is what this benchmark pretends is not so.
    """
    delayed = {"dpu_warmup_steps": 1} if schedule == "delayed" else {}  # the other schedules warn about it
    return {"cpu_step": schedule, "overlap": True, **delayed}


class StepClock(L.Callback):
    """Wall time at the end of every training batch and the engine's statistics of that step."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.stats: list[dict[str, float]] = []
        self._published = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())
        engine = trainer.strategy.engine
        # speculated_fraction and rolled_back are there where the speculative schedule is
        row = {k: float(v) for k, v in asdict(engine.last).items()}
        published = getattr(engine.schedule, "early_published", None)
        if published is not None:  # buckets published during this step's backward
            row["early_published"], self._published = float(published - self._published), published
        self.stats.append(row)


def quiet_fit(
    module: L.LightningModule,
    data: DataLoader,
    strategy: Any,
    steps: int,
    clip: float,
    callbacks: list[L.Callback],
    precision: str = "bf16-mixed",
) -> L.Trainer:
    """One short fit of ``steps`` on the CPU device (the simulated accelerator's host): no logger, checkpoint,
    progress bar, summary or sanity check, Lightning's notes on this setting silenced; returns the trainer."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        strategy=strategy,
        max_steps=steps,
        gradient_clip_val=clip,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*LeafSpec.*")
        trainer.fit(module, data)
    return trainer


def run(config: Config, model_args: dict[str, Any], device_s: tuple[float, float], steps: int, args) -> StepClock:
    """One short fit; returns its per-step clock (the caller drops the warm-up steps)."""
    model = SimulatedModel(**model_args)
    model.set_device_time(*device_s)
    clock = StepClock()
    options = schedule_options(config.schedule)
    if config.schedule == "speculative":
        options["speculation_rollback"] = config.rollback
    strategy = ZeroOffloadStrategy(
        bucket_size_mb=args.bucket_mb, cpu_threads=args.cpu_threads, metrics=False, **options
    )
    data = DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1)
    trainer = quiet_fit(model, data, strategy, steps, config.clip, [clock])
    del trainer, model
    gc.collect()  # the next fit allocates its own optimizer state: free this one first
    return clock


def summarize(clocks: list[StepClock], warmup: int, device_ms: float = 0.0) -> dict[str, Any]:
    """Medians over the measured steps of every fit of one configuration at one sweep point.

    ``device_ms``: the simulated device time of one step (forward + backward asleep); what the step
    takes beyond it is host work the schedule did not hide (``exposed_ms``).
    """
    times, rows, fit_medians = [], [], []
    for clock in clocks:
        fit = [b - a for a, b in zip(clock.ends[warmup:], clock.ends[warmup + 1 :])]
        times += fit
        fit_medians.append(1e3 * statistics.median(fit))
        rows += clock.stats[warmup + 1 :]
    out: dict[str, Any] = {"step_ms": 1e3 * statistics.median(times), "steps": len(times)}
    out["fit_median_step_ms"] = fit_medians  # the spread between fits (rounds)
    out["exposed_ms"] = out["step_ms"] - device_ms
    for key in ("backward_s", "transfer_wait_s", "cpu_step_s", "update_wait_s", "copy_back_s"):
        out[key[:-2] + "_ms"] = 1e3 * statistics.median(r[key] for r in rows)
    out["grad_norm"] = statistics.median(r["grad_norm"] for r in rows)
    if "speculated_fraction" in rows[0]:
        out["speculated_fraction"] = statistics.median(r["speculated_fraction"] for r in rows)
    if "rolled_back" in rows[0]:
        out["rollbacks"] = sum(r["rolled_back"] for r in rows)  # among the measured steps
    if "early_published" in rows[0]:
        out["early_published_per_step"] = statistics.median(r["early_published"] for r in rows)
    return out


# --------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one sweep point, a smaller model")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--params-per-block", type=float, default=None, help="default 4M (quick: 1M)")
    parser.add_argument(
        "--ratios", type=float, nargs="+", default=None, help="backward time / CPU step time (default 4 2 1 0.5)"
    )
    parser.add_argument("--forward-ratio", type=float, default=0.5, help="forward time / backward time")
    parser.add_argument("--rounds", type=int, default=None, help="fits per configuration and point (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per fit (default 12)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps at the start of each fit")
    parser.add_argument("--bucket-mb", type=float, default=8.0)
    parser.add_argument("--cpu-threads", type=int, default=None, help="CPU Adam threads (default: usable cores)")
    parser.add_argument("--configs", nargs="+", help="run only these configurations (by name; sync always runs)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sim_device.json"))
    parser.add_argument("--figure", default=str(ROOT / "docs" / "figures" / "sim_device.png"))
    args = parser.parse_args()
    args.cpu_threads = args.cpu_threads or len(os.sched_getaffinity(0))
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one fit per measurement: no banners
    quick = args.quick
    configs = [c for c in CONFIGS if args.configs is None or c.name in args.configs or c.name == "sync"]
    ratios = args.ratios or ([1.0] if quick else [4.0, 2.0, 1.0, 0.5])
    rounds = args.rounds or (2 if quick else 3)
    steps = args.steps or (4 if quick else 12)
    # past the delayed warm-up and the speculative pause rule (clipping in 4 of the last 8 steps)
    warmup = args.warmup if args.warmup is not None else 6
    per_block = int(args.params_per_block or (2**20 if quick else 4 * 2**20))
    model_args = {"blocks": args.blocks, "params_per_block": per_block}
    params = sum(p.numel() for p in SimulatedModel(**model_args).parameters())

    # The CPU step of this machine with no device time: the unit of the sweep.
    calibration = summarize([run(CONFIGS[0], model_args, (0.0, 0.0), warmup + steps + 1, args)], warmup)
    cpu_ms = calibration["cpu_step_ms"]
    print(
        f"{params / 1e6:.1f}M params in {args.blocks} sleeping blocks, bf16 device copy, CPU Adam on "
        f"{kernels.backend()} with {args.cpu_threads} thread(s): CPU step {cpu_ms:.1f} ms"
    )

    points = []
    for ratio in ratios:
        backward_s = ratio * cpu_ms / 1e3 / args.blocks
        device_s = (args.forward_ratio * backward_s, backward_s)
        clocks: dict[str, list[StepClock]] = {c.name: [] for c in configs}
        for _ in range(rounds):  # alternate the configurations, round after round
            for config in configs:
                clocks[config.name].append(run(config, model_args, device_s, warmup + steps + 1, args))
        device_ms = 1e3 * args.blocks * sum(device_s)
        results = {name: summarize(c, warmup, device_ms) for name, c in clocks.items()}
        for name, r in results.items():
            base = results["sync, clip every step" if "clip every step" in name else "sync"]
            r["speedup_vs_sync"] = base["step_ms"] / r["step_ms"]
            # the share of sync's CPU step taken off the step time
            r["hidden_fraction"] = max(0.0, min(1.0, (base["step_ms"] - r["step_ms"]) / base["cpu_step_ms"]))
        points.append(
            {
                "backward_over_cpu_step": ratio,
                "device_backward_ms": 1e3 * backward_s * args.blocks,
                "device_forward_ms": 1e3 * device_s[0] * args.blocks,
                "results": results,
            }
        )
        print_point(points[-1])

    verdict = targets(points)
    out = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "load_average_1_5_15min_at_end": os.getloadavg(),  # how shared the machine was
        },
        "command": " ".join(["python", *sys.argv]),
        "kernel_backend": kernels.backend(),
        "cpu_threads": args.cpu_threads,
        "params": params,
        "blocks": args.blocks,
        "bucket_size_mb": args.bucket_mb,
        "buckets": math.ceil(params * 2 / (args.bucket_mb * 2**20)),  # about: whole parameters join a bucket
        "grad_norm": GRAD_NORM,
        "clip": {"quiet": CLIP_QUIET, "every_step": CLIP_EVERY_STEP},
        "rounds": rounds,
        "steps_per_fit": steps,
        "warmup_steps_per_fit": warmup,
        "calibration_cpu_step_ms": cpu_ms,
        "points": points,
        "targets": verdict,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    plot(points, args.figure)
    print(f"wrote {args.out} and {args.figure}")


def print_point(point: dict[str, Any]) -> None:
    print(
        f"\nbackward {point['device_backward_ms']:.0f} ms + forward {point['device_forward_ms']:.0f} ms of "
        f"device time (backward / CPU step = {point['backward_over_cpu_step']:g})"
    )
    print(
        f"  {'schedule':<37} {'step ms':>8} {'fits':>13} {'vs sync':>8} {'hidden':>7} {'exposed':>8}"
        f" {'cpu step':>9} {'copy-back':>9} {'wait':>6} {'speculated':>10} {'early':>5} {'rollbacks':>9}"
    )
    for name, r in point["results"].items():
        speculated = f"{100 * r['speculated_fraction']:.0f}%" if "speculated_fraction" in r else "-"
        rollbacks = f"{r['rollbacks']:.0f}/{r['steps']}" if "rollbacks" in r else "-"
        early = f"{r['early_published_per_step']:.0f}" if "early_published_per_step" in r else "-"
        fits = f"{min(r['fit_median_step_ms']):.0f}-{max(r['fit_median_step_ms']):.0f}"
        print(
            f"  {name:<37} {r['step_ms']:8.1f} {fits:>13} {r['speedup_vs_sync']:7.2f}x"
            f" {100 * r['hidden_fraction']:6.0f}% {r['exposed_ms']:8.1f} {r['cpu_step_ms']:9.1f}"
            f" {r['copy_back_ms']:9.1f} {r['update_wait_ms']:6.1f} {speculated:>10} {early:>5} {rollbacks:>9}"
        )


TARGETS = [  # (label, schedule, compared with, the least ratio of step times that meets it)
    ("speculative vs sync", "speculative", "sync", 1.3),
    ("speculative vs delayed", "speculative", "delayed", 0.97),
    ("speculative vs sync, clip every step", "speculative, clip every step", "sync, clip every step", 0.97),
    # the exact rollback's cost: the default (snapshot) against the undo, the default before
    ("snapshot rollback vs undo rollback", "speculative", "speculative, undo rollback", 0.97),
    ("undo rollback vs sync", "speculative, undo rollback", "sync", 1.3),
]


def targets(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, at the sweep point where the CPU step is closest to the backward time."""
    point = min(points, key=lambda p: abs(math.log(p["backward_over_cpu_step"])))
    results = point["results"]
    verdict: dict[str, Any] = {"at_backward_over_cpu_step": point["backward_over_cpu_step"]}
    print(f"\ntargets at backward / CPU step = {point['backward_over_cpu_step']:g} (step-time ratios):")
    for label, ours, other, needed in TARGETS:
        if ours not in results or other not in results:
            print(f"  {label}: not measured ({ours!r} or {other!r} is missing)")
            continue
        ratio = results[other]["step_ms"] / results[ours]["step_ms"]
        verdict[label] = {"ratio": ratio, "needed": needed, "met": ratio >= needed}
        print(f"  {label}: {ratio:.3f}x (target >= {needed}) {'met' if ratio >= needed else 'NOT met'}")
    return verdict


def plot(points: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    x = [p["backward_over_cpu_step"] for p in points]
    for name in points[0]["results"]:
        ax.plot(x, [p["results"][name]["speedup_vs_sync"] for p in points], marker="o", label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.invert_xaxis()  # left: backward-bound, right: CPU-bound
    ax.set_xlabel("device backward time / CPU step time")
    ax.set_ylabel("step-time speed-up vs sync (same clipping)")
    ax.set_title("Update schedules on a simulated accelerator")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
