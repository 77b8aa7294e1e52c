"""Does a CPU-step schedule converge like synchronous training? The demo model, trained twice.

Runs ``configs/cpu_demo.yaml`` (or ``--config``) once with ``cpu_step="sync"`` and once with
``--schedule`` (``delayed``: DPU, one-step-stale weights; ``speculative``: the step runs during backward
and is validated after it), same seed, data and steps, then writes both validation-loss curves to
``--figure`` and the final numbers to ``--out``. For ``speculative`` it also reports whether every logged
loss is bitwise equal to the synchronous run's (they must be, except after a rolled-back step).

    python benchmarks/dpu_convergence.py                          # DPU, ~2 x 3 minutes on 2 CPU cores
    python benchmarks/dpu_convergence.py --max-steps 100          # a shorter run
    python benchmarks/dpu_convergence.py --weight-prediction      # DPU with dpu_weight_prediction=True
    python benchmarks/dpu_convergence.py --schedule speculative \
        --out benchmarks/results/speculative_convergence.json --figure docs/figures/speculative_convergence.png
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(
    name: str,
    config: Path,
    strategy_args: dict,
    max_steps: int | None,
    runs: Path,
    cli_args: list[str],
) -> dict[str, list[tuple[int, float]]]:
    overlay = {
        "trainer": {
            "strategy": {"class_path": "lightning_zero_offload.ZeroOffloadStrategy", "init_args": strategy_args},
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(runs), "name": name},
            },
        }
    }
    if max_steps:
        overlay["trainer"]["max_steps"] = max_steps
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(overlay, f)  # JSON is YAML
    cmd = [
        sys.executable,
        "-m",
        "lightning_zero_offload",
        "fit",
        "--config",
        str(config),
        "--config",
        f.name,
        *cli_args,
    ]
    subprocess.run(cmd, check=True, cwd=ROOT)
    metrics = sorted((runs / name).glob("version_*/metrics.csv"))[-1]
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    keys = ("val_loss", "train_loss", "offload/rollbacks", "offload/speculated_fraction")
    return {key: [(int(r["step"]), float(r[key])) for r in rows if r.get(key)] for key in keys}


def resolved_precision(config: Path, cli_args: list[str]) -> list[str]:
    """``--trainer.precision=...`` for both runs when neither the config nor the overrides give one.

    Left to the CLI, each run would measure bf16 against fp32 anew at its start (cli.cpu_precision), and
    on a CPU near the threshold the two runs could train in different precisions: resolved once here.
    """
    import yaml

    from lightning_zero_offload.cli import measured_cpu_precision

    if any(a.startswith("--trainer.precision") for a in cli_args):
        return []
    trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer", {})
    if trainer.get("precision") is not None or trainer.get("accelerator") != "cpu":
        return []
    return [f"--trainer.precision={measured_cpu_precision()['precision']}"]


def first_rollback_step(run: dict[str, list[tuple[int, float]]]) -> int | None:
    """The first logged step whose cumulative rollback count is above zero (None: nothing was rolled back)."""
    return next((step for step, count in run["offload/rollbacks"] if count > 0), None)


def bitwise_equal_before(a: dict, b: dict, step: int | None) -> bool:
    """Every logged loss of the two runs is bitwise equal up to (not including) ``step``."""
    limit = float("inf") if step is None else step
    return all(
        [x for x in a[key] if x[0] < limit] == [y for y in b[key] if y[0] < limit] for key in ("val_loss", "train_loss")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu_demo.yaml")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--schedule", choices=("delayed", "speculative"), default="delayed", help="compared to sync")
    parser.add_argument("--warmup", type=int, default=40, help="dpu_warmup_steps")
    parser.add_argument("--weight-prediction", action="store_true", help="dpu_weight_prediction=True")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "dpu_convergence")
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "dpu_convergence.png")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dpu_convergence.json")
    parser.add_argument("cli_args", nargs="*", help="extra CLI overrides for both runs, after --")
    args = parser.parse_args()

    if args.schedule == "delayed":
        label = f"DPU (warm-up {args.warmup}{', weight prediction' if args.weight_prediction else ''})"
        other = {"cpu_step": "delayed", "dpu_warmup_steps": args.warmup}
        other["dpu_weight_prediction"] = args.weight_prediction
        sync = {"cpu_step": "sync"}
    else:  # overlap on for both: on a CPU device "auto" turns the worker off, and speculation runs on it
        label = "speculative"
        other, sync = {"cpu_step": "speculative", "overlap": True}, {"cpu_step": "sync", "overlap": True}
    cli_args = [*args.cli_args, *resolved_precision(args.config, args.cli_args)]
    runs = {
        "synchronous": train("sync", args.config, sync, args.max_steps, args.runs, cli_args),
        label: train(args.schedule, args.config, other, args.max_steps, args.runs, cli_args),
    }
    curves = {name: run["val_loss"] for name, run in runs.items()}
    (sync_step, sync_loss), (dpu_step, dpu_loss) = (c[-1] for c in curves.values())
    assert sync_step == dpu_step, "both runs must end at the same step"
    sync_run, other_run = runs.values()
    first_rollback = first_rollback_step(other_run)
    result = {
        "config": str(args.config.relative_to(ROOT)) if args.config.is_relative_to(ROOT) else str(args.config),
        "schedule": args.schedule,
        "steps": sync_step,
        "warmup": args.warmup,
        "weight_prediction": args.weight_prediction,
        "overrides": cli_args,
        "final_val_loss": {"synchronous": sync_loss, args.schedule: dpu_loss},
        "relative_difference": (dpu_loss - sync_loss) / sync_loss,
        "every_logged_loss_bitwise_equal": bitwise_equal_before(sync_run, other_run, None),
        "max_abs_loss_difference": max(
            abs(a[1] - b[1]) for key in ("val_loss", "train_loss") for a, b in zip(sync_run[key], other_run[key])
        ),
        "curves": curves,
        "rollbacks": other_run["offload/rollbacks"][-1][1] if other_run["offload/rollbacks"] else None,
        "first_rollback_logged_at_step": first_rollback,
        "bitwise_equal_before_first_rollback": bitwise_equal_before(sync_run, other_run, first_rollback),
        "speculated_fraction": other_run["offload/speculated_fraction"],
        "train_curves": {name: run["train_loss"] for name, run in runs.items()},
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(
        f"final val loss after {sync_step} steps: sync {sync_loss:.4f}, {args.schedule} {dpu_loss:.4f} "
        f"({100 * result['relative_difference']:+.2f}%); every logged loss bitwise equal: "
        f"{result['every_logged_loss_bitwise_equal']} (max abs difference {result['max_abs_loss_difference']:.3g})"
    )
    if args.schedule == "speculative":
        print(
            f"rollbacks: {result['rollbacks']}, first logged at step {result['first_rollback_logged_at_step']}; "
            f"bitwise equal before it: {result['bitwise_equal_before_first_rollback']}"
        )

    title = f"{args.schedule} vs synchronous (demo GPT) {' '.join(args.cli_args)}".strip()
    plot_curves(curves, title, args.figure)
    print(f"wrote {args.figure} and {args.out}")


def plot_curves(curves: dict[str, list[tuple[int, float]]], title: str, figure: Path) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in curves.items():
        ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o", label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(textwrap.fill(title, 80), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(figure, dpi=120)


if __name__ == "__main__":
    main()
