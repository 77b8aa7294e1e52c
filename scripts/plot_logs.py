#!/usr/bin/env python
"""Plot Lightning ``CSVLogger`` metrics: loss curves and, when logged, the offload time breakdown.

Usage::

    python scripts/plot_logs.py runs/cpu_demo/version_0/metrics.csv
    python scripts/plot_logs.py runs/gpu_bf16/version_0 runs/dpu/version_0 \\
        --label sync --label dpu --out plots/

Each positional argument is a ``metrics.csv`` or a log directory holding one. Writes into ``--out``
(default: the first run's directory):

* ``loss.png``: ``train_loss`` (line) and ``val_loss`` (markers) against the step, one colour per run, and
  ``val_ppl`` in a second panel when logged;
* ``time_breakdown.png``: only if columns named ``offload/*_ms`` exist (e.g. ``offload/cpu_step_ms``,
  ``offload/transfer_wait_ms``, ``offload/copy_back_ms``, ``offload/backward_ms``): each of them against
  the step per run, and a stacked bar of their per-step means, one bar per run (runs without such columns
  are left out of this figure).

Needs matplotlib, an optional extra: ``pip install lightning-zero-offload[plot]``.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

TIME_PREFIX = "offload/"
TIME_SUFFIX = "_ms"
INSTALL_HINT = "pip install 'lightning-zero-offload[plot]'"


def resolve_metrics_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.csv"
    if not p.is_file():
        raise FileNotFoundError(f"No metrics file at {str(p)!r} (expected a CSVLogger metrics.csv or its directory)")
    return p


def read_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Column name -> ``[(step, value), ...]`` for every non-empty numeric cell, in file order.

    ``CSVLogger`` writes one row per logging call with empty cells for the metrics not logged in it.
    """
    series: dict[str, list[tuple[int, float]]] = {}
    with open(resolve_metrics_path(path), newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError(f"{str(path)!r} has no 'step' column: not a Lightning CSVLogger metrics.csv")
        for row in reader:
            try:
                step = int(float(row["step"]))
            except (TypeError, ValueError):
                continue
            for key, cell in row.items():
                if key in (None, "step", "epoch") or cell in (None, ""):
                    continue
                try:
                    value = float(cell)
                except ValueError:
                    continue
                series.setdefault(key, []).append((step, value))
    return series


def time_columns(runs: list[dict[str, list[tuple[int, float]]]]) -> list[str]:
    """The ``offload/*_ms`` columns present in any run, in a stable order."""
    names = {k for run in runs for k in run if k.startswith(TIME_PREFIX) and k.endswith(TIME_SUFFIX)}
    return sorted(names)


def mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else 0.0


def default_labels(paths: list[Path]) -> list[str]:
    # ".../runs/cpu_demo/version_0/metrics.csv" -> "cpu_demo/version_0"
    return [f"{p.parent.parent.name}/{p.parent.name}" if p.parent.parent.name else p.parent.name for p in paths]


def plot_losses(plt, runs, labels, out: Path) -> Path:
    has_ppl = any("val_ppl" in run for run in runs)
    fig, axes = plt.subplots(1, 2 if has_ppl else 1, figsize=(12 if has_ppl else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for i, (run, label) in enumerate(zip(runs, labels)):
        color = f"C{i % 10}"
        if "train_loss" in run:
            steps, values = zip(*run["train_loss"])
            ax.plot(steps, values, color=color, alpha=0.6, linewidth=1, label=f"{label} train")
        if "val_loss" in run:
            steps, values = zip(*run["val_loss"])
            ax.plot(steps, values, color=color, marker="o", linewidth=2, label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    if has_ppl:
        ax = axes[0][1]
        for i, (run, label) in enumerate(zip(runs, labels)):
            if "val_ppl" in run:
                steps, values = zip(*run["val_ppl"])
                ax.plot(steps, values, color=f"C{i % 10}", marker="o", label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("perplexity")
        ax.set_yscale("log")
        ax.set_title("Validation perplexity")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_time_breakdown(plt, runs, labels, columns: list[str], out: Path) -> Path:
    short = [c[len(TIME_PREFIX) : -len(TIME_SUFFIX)] for c in columns]
    keep = [i for i, run in enumerate(runs) if any(c in run for c in columns)]
    runs, labels = [runs[i] for i in keep], [labels[i] for i in keep]
    n = len(runs)
    fig, axes = plt.subplots(1, n + 1, figsize=(5 * (n + 1), 4.5), squeeze=False)
    for j, (run, label) in enumerate(zip(runs, labels)):
        ax = axes[0][j]
        for k, (col, name) in enumerate(zip(columns, short)):
            if col in run:
                steps, values = zip(*run[col])
                ax.plot(steps, values, color=f"C{k % 10}", linewidth=1, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel("ms")
        ax.set_title(f"{label}: time per step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    ax = axes[0][n]
    bottoms = [0.0] * n
    for k, (col, name) in enumerate(zip(columns, short)):
        heights = [mean([v for _, v in run.get(col, [])]) for run in runs]
        ax.bar(range(n), heights, bottom=bottoms, color=f"C{k % 10}", label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(n))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize="small")
    ax.set_ylabel("mean ms per step")
    ax.set_title("Mean time breakdown")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = out / "time_breakdown.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", help="CSVLogger metrics.csv files or the directories holding them")
    parser.add_argument(
        "--label", action="append", default=None, help="a name per run, in order (default: logger dir names)"
    )
    parser.add_argument("--out", default=None, help="output directory (default: the first run's directory)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"plot_logs.py needs matplotlib, an optional extra. Install it with:\n    {INSTALL_HINT}",
            file=sys.stderr,
        )
        return 1

    try:
        paths = [resolve_metrics_path(p) for p in args.metrics]
        runs = [read_metrics(p) for p in paths]
    except (FileNotFoundError, ValueError) as err:
        print(f"plot_logs.py: {err}", file=sys.stderr)
        return 2
    labels = args.label if args.label else default_labels(paths)
    if len(labels) != len(runs):
        print(f"plot_logs.py: got {len(labels)} --label for {len(runs)} runs", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else paths[0].parent
    out.mkdir(parents=True, exist_ok=True)

    written = [plot_losses(plt, runs, labels, out)]
    columns = time_columns(runs)
    if columns:
        written.append(plot_time_breakdown(plt, runs, labels, columns, out))
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
