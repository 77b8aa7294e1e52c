"""fp32 on a CPU device, step by step in one process: plain fused AdamW against the engine in place and
against its offload data path (``in_place_on_cpu=False``).

The Trainer-level benchmark (train_step.py) measures what a user gets, but on a shared 2-core machine
its runs spread by 10-30% from one to the next. Here the three loops take turns step by step on the
same model and batch (the order alternates every round), with no Lightning in between, so the ratio
of their per-step times is the engine's own cost. Medians over ``--steps`` after ``--warmup``.

    python benchmarks/in_place_step.py --preset llama-optimizer --steps 30
    python benchmarks/in_place_step.py --preset llama-compute --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import PRESETS, build_net, lm_loss  # noqa: E402

from lightning_zero_offload import kernels  # noqa: E402
from lightning_zero_offload.engine import OffloadEngine, OffloadOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("forward", "backward", "optimizer", "total")


def make_loop(kind: str, spec: dict):
    net = build_net(spec)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.01, fused=kind == "plain")
    engine = None
    if kind != "plain":
        options = OffloadOptions(in_place_on_cpu=kind == "in place")
        engine = OffloadEngine(optimizer, torch.device("cpu"), torch.float32, options)
        assert engine.in_place == (kind == "in place")

    def step(tokens: torch.Tensor) -> tuple[float, ...]:
        t0 = time.perf_counter()
        loss = lm_loss(net, tokens)
        t1 = time.perf_counter()
        if engine is not None:
            engine.begin_backward()
        loss.backward()
        t2 = time.perf_counter()
        if engine is not None:
            engine.step()
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2, t3 - t0

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-optimizer")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", help="JSON path (default benchmarks/results/in_place_step_<preset>.json)")
    args = parser.parse_args()
    spec = PRESETS[args.preset]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, spec["config"].get("vocab_size", 256), (spec["batch"], spec["seq"] + 1), generator=generator
    )
    kinds = ["plain", "in place", "offload path"]
    loops = {kind: make_loop(kind, spec) for kind in kinds}
    samples: dict[str, list[tuple[float, ...]]] = {kind: [] for kind in kinds}
    for index in range(args.warmup + args.steps):
        for kind in kinds if index % 2 else kinds[::-1]:
            times = loops[kind](tokens)
            if index >= args.warmup:
                samples[kind].append(times)
    rows = {}
    for kind in kinds:
        columns = list(zip(*samples[kind]))
        rows[kind] = {f"{phase}_ms": 1e3 * statistics.median(c) for phase, c in zip(PHASES, columns)}
        if kind != "plain":
            ratios = [a[3] / b[3] for a, b in zip(samples[kind], samples["plain"])]
            rows[kind]["step_time_ratio_to_plain"] = statistics.median(ratios)
    print(f"{args.preset}: fp32 on the CPU, {torch.get_num_threads()} threads, {args.steps} steps per loop")
    for kind, row in rows.items():
        phases = "  ".join(f"{phase} {row[f'{phase}_ms']:7.1f} ms" for phase in PHASES)
        ratio = f"  / plain: {row['step_time_ratio_to_plain']:.3f}x" if "step_time_ratio_to_plain" in row else ""
        print(f"{kind:<13} {phases}{ratio}")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"in_place_step_{args.preset}.json")
    record = {
        "command": " ".join(["python", *sys.argv]),
        "preset": args.preset,
        "spec": spec,
        "torch": torch.__version__,
        "kernels": kernels.backend(),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "ratio": "median over steps of (this loop's step time / plain's step time in the same round)",
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
