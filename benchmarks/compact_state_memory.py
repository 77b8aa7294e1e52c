"""Host memory per parameter of each ``cpu_state``: the engine's ledger against the resident set it causes.

Each case runs in a fresh interpreter: build a model of ``--params`` parameters (fp32, on the CPU), measure
the anonymous RSS, build the engine (bf16-mixed parameters on a CPU device, the offload path) and take two
optimizer steps, measure again. On a CPU device the "device" buffers (the bf16 parameters, gradient buckets)
are host memory too, and the module's own fp32 tensors are freed when the engine takes the parameters over,
so the RSS growth the ledger predicts is ``host_total + device_total - 4 B x params``.

    python benchmarks/compact_state_memory.py [--params 64e6] [--cpu-step sync]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from torch import nn


def one_case(cpu_state: str, cpu_step: str, params: int) -> dict:
    sys.path.insert(0, os.path.dirname(__file__))
    from memory_probe import anonymous_rss

    from lightning_zero_offload.core import make_offload_options
    from lightning_zero_offload.engine import OffloadEngine

    torch.manual_seed(0)
    width = 2048
    layers = max(1, round(params / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    numel = sum(p.numel() for p in model.parameters())
    x = torch.randn(4, width)
    before = anonymous_rss()
    options = make_offload_options(cpu_state=cpu_state, cpu_step=cpu_step, in_place_on_cpu=False, cpu_threads=2)
    engine = OffloadEngine(torch.optim.AdamW(model.parameters(), lr=1e-3), torch.device("cpu"), torch.bfloat16, options)
    for _ in range(2):
        engine.expect_step(publish_early=True)
        engine.begin_backward()
        model(x.bfloat16()).float().square().mean().backward()
        engine.step(clip_norm=1.0)
    engine.sync()
    after = anonymous_rss()
    report = engine.memory_report()
    predicted = report["host_total_bytes"] + report["device_total_bytes"] - 4 * numel
    return {
        "cpu_state": cpu_state,
        "cpu_step": cpu_step,
        "params": numel,
        "host_state_bytes_per_param": report["host_state_bytes"] / numel,
        "host_total_bytes_per_param": report["host_total_bytes"] / numel,
        "rss_growth_bytes": after - before,
        "ledger_predicted_growth_bytes": predicted,
        "unexplained_bytes_per_param": (after - before - predicted) / numel,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=64e6)
    parser.add_argument("--cpu-step", default="sync", choices=("sync", "speculative", "delayed"))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(one_case(args.case, args.cpu_step, int(args.params))))
        return
    rows = []
    for cpu_state in ("fp32", "bf16"):
        command = [sys.executable, __file__, "--case", cpu_state, "--params", str(args.params)]
        output = subprocess.run([*command, "--cpu-step", args.cpu_step], capture_output=True, text=True)
        if output.returncode != 0:
            raise SystemExit(f"the {cpu_state} case failed:\n{output.stderr[-3000:]}")
        rows.append(json.loads(output.stdout.strip().splitlines()[-1]))
    print(f"cpu_step={args.cpu_step}, {rows[0]['params'] / 1e6:.1f}M params, bf16-mixed on a CPU device, one rank")
    header = ("cpu_state", "ledger host state B/param", "RSS growth MB", "ledger MB", "unexplained B/param")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (9, 26, 14, 10, 20))))
    for r in rows:
        print(
            f"{r['cpu_state']:>9} {r['host_state_bytes_per_param']:26.2f} {r['rss_growth_bytes'] / 1e6:14.1f} "
            f"{r['ledger_predicted_growth_bytes'] / 1e6:10.1f} {r['unexplained_bytes_per_param']:20.3f}"
        )
    print(
        f"host state bf16 / fp32: {rows[1]['host_state_bytes_per_param'] / rows[0]['host_state_bytes_per_param']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
