"""Host memory of the ZeRO-2 mode's setup: the module built whole (eagerly) against built on the meta device
and filled by the engine block by block (``OffloadSession.placeholders``), on the CPU device, one rank.

    python benchmarks/zero2_setup.py                    # ~100M parameters (24 blocks of 2048 x 2048)
    python benchmarks/zero2_setup.py --params 20e6      # quicker

Each case runs in a fresh process: the model is built (eagerly, or on the meta device), the session started
(bf16-mixed, the offload data path, ``cpu_state`` fp32 or bf16, the sync step), then two training steps. Printed
per parameter: the growth of the peak RSS (VmHWM) through the build and setup, and through the two steps, over
the RSS before the build. On the CPU device the "device" copy (2 B/param) is host memory too.
``MALLOC_MMAP_THRESHOLD_=131072`` in every child, as for the other memory benchmarks: freed tensors leave.

Writes JSON to ``benchmarks/results/zero2_setup.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import reset_peak, status  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def case(params: float, width: int, built: str, cpu_state: str) -> dict:
    import torch
    from torch import nn

    from lightning_zero_offload.core import OffloadSession, make_offload_options

    depth = max(2, round(params / (width * width + width)))
    torch.set_num_threads(2)
    options = make_offload_options(in_place_on_cpu=False, cpu_state=cpu_state, cpu_step="sync")
    cpu = torch.device("cpu")
    gc.collect()
    base = status("VmRSS")
    reset_peak()
    start = time.perf_counter()
    with torch.device("meta") if built == "meta" else contextlib.nullcontext():
        model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)))
    blockwise = OffloadSession.placeholders(model, cpu)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    session = OffloadSession.start(model, [optimizer], cpu, "bf16-mixed", options, 1, 1, blockwise=blockwise)
    setup_s = time.perf_counter() - start
    gc.collect()
    setup_peak = status("VmHWM") - base
    x = torch.randn(8, width)
    for _ in range(2):
        session.before_training_forward()
        session.zero_grad()
        session.begin_backward()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        session.finish_backward()
        session.step()
    training_peak = status("VmHWM") - base
    count = sum(p.numel() for p in model.parameters())
    session.close()
    return {
        "built": built,
        "cpu_state": cpu_state,
        "params": count,
        "setup_seconds": setup_s,
        "setup_peak_B_per_param": setup_peak / count,
        "peak_through_training_B_per_param": training_peak / count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # built/cpu_state, in a child process
    args = parser.parse_args()
    if args.case:
        built, cpu_state = args.case.split("/")
        print(json.dumps(case(args.params, args.width, built, cpu_state)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    rows = []
    for cpu_state in ("fp32", "bf16"):
        for built in ("eager", "meta"):
            command = [sys.executable, __file__, "--params", str(args.params), "--width", str(args.width)]
            out = subprocess.run([*command, "--case", f"{built}/{cpu_state}"], env=env, capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-3000:])
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    head = f"{rows[0]['params'] / 1e6:.1f}M parameters, bf16-mixed on the CPU device, sync step"
    print(f"{head}; B/param of peak RSS growth")
    print(f"  {'cpu_state':<10} {'built':<6} {'setup peak':>11} {'through 2 steps':>16} {'setup s':>8}")
    for row in rows:
        print(
            f"  {row['cpu_state']:<10} {row['built']:<6} {row['setup_peak_B_per_param']:>11.2f}"
            f" {row['peak_through_training_B_per_param']:>16.2f} {row['setup_seconds']:>8.2f}"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "zero2_setup.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
