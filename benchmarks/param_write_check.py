"""What watching for writes to the parameters costs the offload path (engine/step/param_writes.py), step by step
in one process.

Two engines over the same model shape take turns step by step (the order alternates every round): one as
built, one whose checks are switched off (the write watch's checksums skipped). The ratio of their median
step times is the watch's cost: a checksum of the device copy after each publish and one before the step
(and one before backward for the speculative schedule). Medians over ``--steps`` after ``--warmup``.

    python benchmarks/param_write_check.py --preset llama-optimizer --precision bf16-mixed --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import PRESETS, build_net, lm_loss, vocab_of  # noqa: E402

from lightning_zero_offload.engine import OffloadEngine, OffloadOptions  # noqa: E402
from lightning_zero_offload.mixed_precision import forward_context  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16-mixed": torch.bfloat16, "32-true": torch.float32}


def make_loop(spec: dict, dtype: torch.dtype, cpu_step: str, watch: bool):
    torch.manual_seed(0)
    net = build_net(spec)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.01)
    options = OffloadOptions(in_place_on_cpu=False, cpu_step=cpu_step)
    engine = OffloadEngine(optimizer, torch.device("cpu"), dtype, options)
    if not watch:
        engine.publisher.writes.checksums = False  # the baseline: no checksum after publish, none before the step

    def step(tokens: torch.Tensor) -> float:
        start = time.perf_counter()
        engine.expect_step(publish_early=True)
        with forward_context("cpu", dtype):
            loss = lm_loss(net, tokens)
        engine.begin_backward()
        loss.backward()
        engine.step()
        return time.perf_counter() - start

    return step, sum(p.numel() for p in net.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-optimizer")
    parser.add_argument("--precision", choices=sorted(DTYPES), default="bf16-mixed")
    parser.add_argument("--cpu-step", choices=["sync", "speculative"], default="sync")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    spec = PRESETS[args.preset]
    dtype = DTYPES[args.precision]
    loops = {
        "watched": make_loop(spec, dtype, args.cpu_step, watch=True),
        "unwatched": make_loop(spec, dtype, args.cpu_step, watch=False),
    }
    numel = loops["watched"][1]
    generator = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for round_index in range(args.warmup + args.steps):
        tokens = torch.randint(0, vocab_of(spec), (spec["batch"], spec["seq"] + 1), generator=generator)
        order = list(loops) if round_index % 2 == 0 else list(reversed(loops))
        for name in order:
            seconds = loops[name][0](tokens)
            if round_index >= args.warmup:
                times[name].append(seconds)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["watched"] / medians["unwatched"]
    result = {
        "preset": args.preset,
        "precision": args.precision,
        "cpu_step": args.cpu_step,
        "params": numel,
        "steps": args.steps,
        "median_ms": {name: round(value * 1e3, 2) for name, value in medians.items()},
        "spread_ms": {name: [round(min(v) * 1e3, 2), round(max(v) * 1e3, 2)] for name, v in times.items()},
        "watched_over_unwatched": round(ratio, 4),
    }
    print(json.dumps(result, indent=2))
    out = ROOT / "benchmarks" / "results" / f"param_write_check_{args.preset}_{args.precision}_{args.cpu_step}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
