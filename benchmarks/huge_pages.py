"""Does backing the host state with 2 MiB pages speed the CPU step? Two engines side by side, one process.

Both engines train the same 2^25-element parameter on the CPU, on the offload path (``in_place_on_cpu=False``,
the sync step), with the state of ``--cpu-state``; one allocates its host buffers as ``engine/infra/memory.py``
does (``advise_huge_pages``), the other with the advice switched off while it is built (4 KiB pages).
Steps alternate between the two, so the machine's noise hits both alike; the engine's own ``cpu_step_s``
and the whole step (backward of a one-multiply loss, then ``engine.step()``) are reported as medians with
their ratio, and the mappings' AnonHugePages (from /proc/self/smaps) show which pages each engine got.

    python benchmarks/huge_pages.py                      # fp32 and bf16 state, 1 and 2 threads
    python benchmarks/huge_pages.py --steps 5 --numel 4194304
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from lightning_zero_offload.core import make_offload_options
from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.infra import memory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import mappings, transparent_huge_pages  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "huge_pages.json"


def anon_huge_kib(tensors: list[torch.Tensor]) -> int:
    """AnonHugePages (KiB) of the mappings that overlap ``tensors``, each mapping counted once."""
    found = {}
    for t in tensors:
        start = t.untyped_storage().data_ptr()
        found |= {m["Range"]: m for m in mappings(start, start + t.untyped_storage().nbytes())}
    return sum(int(m["AnonHugePages"].split()[0]) for m in found.values())


def build(numel: int, cpu_state: str, threads: int, huge: bool) -> tuple[nn.Parameter, OffloadEngine]:
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(numel) * 0.02)
    options = make_offload_options(in_place_on_cpu=False, cpu_state=cpu_state, cpu_threads=threads)
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    with mock.patch.object(memory, "advise_huge_pages", memory.advise_huge_pages if huge else lambda t: False):
        engine = OffloadEngine(optimizer, torch.device("cpu"), torch.float32, options)
    return param, engine


def run(numel: int, cpu_state: str, threads: int, steps: int) -> dict[str, object]:
    weight = torch.randn(numel)
    arms = {
        "huge pages": build(numel, cpu_state, threads, True),
        "4 KiB pages": build(numel, cpu_state, threads, False),
    }
    times: dict[str, dict[str, list[float]]] = {name: {"cpu_step_s": [], "step_s": []} for name in arms}
    for i in range(steps + 2):  # the first two steps warm up
        for name, (param, engine) in arms.items():
            start = time.perf_counter()
            (param * weight).sum().backward()
            stats = engine.step()
            elapsed = time.perf_counter() - start
            engine.zero_grad()
            if i >= 2:
                times[name]["cpu_step_s"].append(stats.cpu_step_s)
                times[name]["step_s"].append(elapsed)
    state = {name: engine.state for name, (_, engine) in arms.items()}
    huge_kib = {
        name: anon_huge_kib([t.host for t in (s.master, s.exp_avg, s.exp_avg_sq, s.grad) if t is not None])
        for name, s in state.items()
    }
    medians = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    ratios = {k: medians["4 KiB pages"][k] / medians["huge pages"][k] for k in ("cpu_step_s", "step_s")}
    return {
        "cpu_state": cpu_state,
        "threads": threads,
        "numel": numel,
        "steps": steps,
        "medians_s": medians,
        "speedup_of_huge_pages": ratios,
        "anon_huge_pages_kib": huge_kib,
        "load_average_1min": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 25)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cpu-state", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    mode = transparent_huge_pages()
    print(f"transparent_hugepage/enabled: {mode}")
    rows = []
    for cpu_state in args.cpu_state:
        for threads in args.threads:
            row = run(args.numel, cpu_state, threads, args.steps)
            rows.append(row)
            med, ratio = row["medians_s"], row["speedup_of_huge_pages"]
            print(
                f"cpu_state={cpu_state} threads={threads} N={args.numel}: cpu step "
                f"{med['huge pages']['cpu_step_s'] * 1e3:.1f} ms on huge pages, "
                f"{med['4 KiB pages']['cpu_step_s'] * 1e3:.1f} ms on 4 KiB: {ratio['cpu_step_s']:.2f}x; whole step "
                f"{ratio['step_s']:.2f}x; AnonHugePages {row['anon_huge_pages_kib']} KiB"
            )
    if args.out:
        args.out.write_text(
            json.dumps({"transparent_hugepage": mode, "torch": torch.__version__, "rows": rows}, indent=1)
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
