"""Does Delayed Parameter Update converge like synchronous training? The demo model, trained twice.

Runs ``configs/cpu_demo.yaml`` (or ``--config``) once synchronously and once with
``delayed_param_update=True`` (same seed, data and steps), then writes both validation-loss curves to
``docs/figures/dpu_convergence.png`` and the final numbers to ``benchmarks/results/dpu_convergence.json``.

    python benchmarks/dpu_convergence.py                      # ~2 x 3 minutes on 2 CPU cores
    python benchmarks/dpu_convergence.py --max-steps 100      # a shorter run
    python benchmarks/dpu_convergence.py --weight-prediction  # DPU with dpu_weight_prediction=True
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
    dpu: bool,
    warmup: int,
    prediction: bool,
    max_steps: int | None,
    runs: Path,
    cli_args: list[str],
) -> list[tuple[int, float]]:
    strategy_args = {"delayed_param_update": dpu, "dpu_warmup_steps": warmup, "dpu_weight_prediction": prediction}
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
        return [(int(r["step"]), float(r["val_loss"])) for r in csv.DictReader(f) if r.get("val_loss")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu_demo.yaml")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=40, help="dpu_warmup_steps")
    parser.add_argument("--weight-prediction", action="store_true", help="dpu_weight_prediction=True")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "dpu_convergence")
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "dpu_convergence.png")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dpu_convergence.json")
    parser.add_argument("cli_args", nargs="*", help="extra CLI overrides for both runs, after --")
    args = parser.parse_args()

    label = f"DPU (warm-up {args.warmup}{', weight prediction' if args.weight_prediction else ''})"
    curves = {
        "synchronous": train("sync", args.config, False, args.warmup, False, args.max_steps, args.runs, args.cli_args),
        label: train(
            "dpu", args.config, True, args.warmup, args.weight_prediction, args.max_steps, args.runs, args.cli_args
        ),
    }
    (sync_step, sync_loss), (dpu_step, dpu_loss) = (c[-1] for c in curves.values())
    assert sync_step == dpu_step, "both runs must end at the same step"
    result = {
        "config": str(args.config.relative_to(ROOT)) if args.config.is_relative_to(ROOT) else str(args.config),
        "steps": sync_step,
        "warmup": args.warmup,
        "weight_prediction": args.weight_prediction,
        "overrides": args.cli_args,
        "final_val_loss": {"synchronous": sync_loss, "dpu": dpu_loss},
        "relative_difference": (dpu_loss - sync_loss) / sync_loss,
        "curves": curves,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(
        f"final val loss after {sync_step} steps: sync {sync_loss:.4f}, DPU {dpu_loss:.4f} "
        f"({100 * result['relative_difference']:+.2f}%)"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curve in curves.items():
        ax.plot([s for s, _ in curve], [v for _, v in curve], marker="o", label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(f"DPU vs synchronous (demo GPT, bf16) {' '.join(args.cli_args)}".strip(), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.figure, dpi=120)
    print(f"wrote {args.figure} and {args.out}")


if __name__ == "__main__":
    main()
