"""Training-step time with overlap off/on and Delayed Parameter Update off/on, with the time breakdown.

Drives the offload engine directly (no Trainer, so nothing but the step is timed) on the demo GPT in
bf16 on the CPU "device". All configurations are built once and run interleaved, round after round,
so machine noise hits them alike; medians are reported with ratios to the synchronous, no-overlap
baseline measured in the same run.

    python benchmarks/train_step.py            # full run (~5 min on 2 cores)
    python benchmarks/train_step.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_zero_offload import kernels
from lightning_zero_offload.demo.model import GPT
from lightning_zero_offload.engine import OffloadEngine, OffloadOptions, StepStats

MODES = {  # name: (overlap, delayed_param_update)
    "sync, no overlap": (False, False),
    "sync, overlap": (True, False),
    "DPU, no overlap": (False, True),
    "DPU, overlap": (True, True),
}


def build(mode: str, threads: int, size: dict) -> tuple[GPT, OffloadEngine]:
    overlap, dpu = MODES[mode]
    torch.manual_seed(0)
    model = GPT(**size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    options = OffloadOptions(
        bucket_size_mb=8, cpu_threads=threads, overlap=overlap, delayed_param_update=dpu, dpu_warmup_steps=2
    )
    return model, OffloadEngine(optimizer, torch.device("cpu"), torch.bfloat16, options)


def one_step(model: GPT, engine: OffloadEngine, tokens: torch.Tensor) -> tuple[float, StepStats]:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    engine.begin_backward()
    loss.backward()
    engine.finish_backward()
    stats = engine.step()
    return time.perf_counter() - start, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "train_step.json"))
    args = parser.parse_args()
    size = (
        {"n_layer": 2, "n_embd": 256, "block_size": 64}
        if args.quick
        else {"n_layer": 6, "n_embd": 512, "block_size": 128}
    )
    batch = 2 if args.quick else 4
    rounds, steps = (2, 3) if args.quick else (5, 6)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (batch, size["block_size"] + 1), generator=g)

    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        runs = {mode: build(mode, threads, size) for mode in MODES}
        for model, engine in runs.values():  # warm-up, past the DPU warm-up steps
            for _ in range(3):
                one_step(model, engine, tokens)
        samples: dict[str, list[tuple[float, StepStats]]] = {mode: [] for mode in MODES}
        for _ in range(rounds):
            for mode, (model, engine) in runs.items():
                samples[mode] += [one_step(model, engine, tokens) for _ in range(steps)]
        for mode, rows in samples.items():
            fields = {k: statistics.median(asdict(s)[k] for _, s in rows) for k in asdict(rows[0][1]) if k != "skipped"}
            cpu = fields["cpu_step_s"]
            results.append(
                {
                    "threads": threads,
                    "mode": mode,
                    "step_ms": 1e3 * statistics.median(t for t, _ in rows),
                    **{k[:-2] + "_ms": 1e3 * v for k, v in fields.items() if k.endswith("_s")},
                    "hidden_transfer": statistics.median(s.hidden_transfer_fraction for _, s in rows),
                    "hidden_update": (1 - fields["update_wait_s"] / cpu) if MODES[mode][1] and cpu > 0 else 0.0,
                }
            )
        for _, engine in runs.values():
            engine.close()

    params = sum(p.numel() for p in GPT(**size).parameters())
    print(f"\nGPT {size} = {params / 1e6:.1f}M params, batch {batch}, bf16 on the CPU device")
    print(f"CPU-Adam kernels: {kernels.backend()}")
    header = f"{'thr':>3} {'mode':<18} {'step ms':>8} {'vs base':>7} {'bwd':>7} {'xfer':>7} {'wait':>6} {'hid%':>5}"
    header += f" {'cpu step':>8} {'upd wait':>8} {'hid%':>5} {'copyback':>8}"
    print(header)
    for threads in (1, 2):
        base = next(r for r in results if r["threads"] == threads and r["mode"] == "sync, no overlap")
        for r in (r for r in results if r["threads"] == threads):
            r["speedup_vs_sync_no_overlap"] = base["step_ms"] / r["step_ms"]
            print(
                f"{threads:>3} {r['mode']:<18} {r['step_ms']:8.1f} {r['speedup_vs_sync_no_overlap']:6.2f}x"
                f" {r['backward_ms']:7.1f} {r['transfer_ms']:7.1f} {r['transfer_wait_ms']:6.1f}"
                f" {100 * r['hidden_transfer']:4.0f}% {r['cpu_step_ms']:8.1f} {r['update_wait_ms']:8.1f}"
                f" {100 * r['hidden_update']:4.0f}% {r['copy_back_ms']:8.1f}"
            )
    out = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cores": torch.get_num_threads(),
        },
        "torch": torch.__version__,
        "kernels": kernels.backend(),
        "model": {**size, "params": params, "batch": batch},
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
