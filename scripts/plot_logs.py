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
* ``time_breakdown.png``: only if columns named ``offload/*_ms`` exist (``offload/forward_ms``,
  ``offload/backward_ms``, ``offload/cpu_step_ms``, ...): one panel per run with each phase against the
  step, and one panel with each phase's mean per step as its own bar, labelled with its share of the
  whole step (``offload/step_ms``) and grouped by run; both on a log scale, so phases a hundred times
  smaller than backward stay visible (runs without such columns are left out of this figure).

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
STEP_COLUMN = "offload/step_ms"  # OffloadMetrics' wall time of the whole optimizer step
# The phases OffloadMetrics logs, in the order a step runs them (others found in a CSV follow, sorted).
PHASE_ORDER = [
    f"{TIME_PREFIX}{name}{TIME_SUFFIX}"
    for name in ("forward", "backward", "transfer_wait", "cpu_step", "update_wait", "copy_back")
]


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


def phase_columns(columns: list[str]) -> tuple[list[str], str | None]:
    """The columns to draw as phases, in the order a step runs them, and the whole-step column if logged.

    ``offload/step_ms`` is the wall time of the step, not a phase: it is drawn as the total the phases add
    up to (the gap is what no phase measures: zero_grad, hooks, logging).
    """
    total = STEP_COLUMN if STEP_COLUMN in columns else None
    known = [c for c in PHASE_ORDER if c in columns]
    return known + [c for c in columns if c not in known and c != STEP_COLUMN], total


def plot_time_breakdown(plt, runs, labels, columns: list[str], out: Path) -> Path:
    phases, total = phase_columns(columns)
    short = {c: c[len(TIME_PREFIX) : -len(TIME_SUFFIX)] for c in columns}
    color = {c: f"C{k % 10}" for k, c in enumerate(phases)}
    keep = [i for i, run in enumerate(runs) if any(c in run for c in columns)]
    runs, labels = [runs[i] for i in keep], [labels[i] for i in keep]
    n = len(runs)
    # One phase usually dominates (backward on a CPU), so both panels use a log scale: a linear stacked bar
    # shows one colour. Zeros cannot be drawn on it and are named in a note instead.
    fig, axes = plt.subplots(1, n + 1, figsize=(6 * (n + 1), 4.8), squeeze=False)
    for j, (run, label) in enumerate(zip(runs, labels)):
        ax = axes[0][j]
        for col in phases + ([total] if total else []):
            points = [(s, v) for s, v in run.get(col, []) if v > 0]
            if not points:
                continue
            steps, values = zip(*points)
            if col == total:
                ax.plot(steps, values, color="black", linestyle="--", linewidth=1.2, label="whole step")
            else:
                ax.plot(steps, values, color=color[col], linewidth=1, label=short[col])
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("ms (log scale)")
        ax.set_title(f"{label}: time per step", fontsize="medium")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax = axes[0][n]
    means = [{c: mean([v for _, v in run.get(c, [])]) for c in phases} for run in runs]
    steps = [mean([v for _, v in run.get(total, [])]) if total else 0.0 for run in runs]
    # A phase at 0 ms in every run (update_wait outside DPU, transfers in place) gets no row, only the note.
    drawn = [c for c in phases if any(m[c] > 0 for m in means)]
    zero = [short[c] for c in phases if c not in drawn]
    rows = (["whole step"] if any(steps) else []) + [short[c] for c in drawn]
    height = 0.8 / n
    smallest = min([m[c] for m in means for c in drawn if m[c] > 0] or [1.0])
    for j, label in enumerate(labels):
        whole = steps[j] or sum(means[j].values())  # shares of the measured step, else of the phases' sum
        bars = ([("whole step", steps[j], "0.6" if n == 1 else f"C{j % 10}")] if any(steps) else []) + [
            (short[c], means[j][c], color[c] if n == 1 else f"C{j % 10}") for c in drawn
        ]
        for k, (name, value, colour) in enumerate(bars):
            y = k + (j - (n - 1) / 2) * height
            if value <= 0:
                continue
            ax.barh(y, value, height=height * 0.9, color=colour, label=label if k == len(bars) - 1 and n > 1 else None)
            share = f" ({100 * value / whole:.1f}%)" if whole > 0 and name != "whole step" else ""
            text = f"{value:,.0f}" if value >= 10 else f"{value:.2g}"
            ax.text(value, y, f" {text} ms{share}", va="center", fontsize="small")
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows)
    ax.invert_yaxis()  # the whole step on top, then the phases in the order a step runs them
    ax.set_xlim(smallest / 5, max([*steps, *(m[c] for m in means for c in drawn)]) * 20)  # room for labels
    ax.set_xlabel("mean ms per step (log scale)")
    ax.set_title("Mean time per phase (% of the whole step)", fontsize="medium")
    ax.grid(alpha=0.3, axis="x", which="both")
    if n > 1:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if zero:
        ax.annotate(f"0 ms on every step (no bar): {', '.join(zero)}", (0, -0.14), xycoords="axes fraction",
                    fontsize="small", va="top")  # fmt: skip
    fig.tight_layout()
    path = out / "time_breakdown.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")  # keeps the legends placed outside the axes
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
