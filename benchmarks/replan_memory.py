"""Host memory a re-plan adds on top of training: a layer unfrozen mid-run (``requires_grad_(True)``, as
``BackboneFinetuning`` does), per rank, at 1 and 2 ranks.

    python benchmarks/replan_memory.py                       # ~100M parameters, 1 and 2 ranks
    python benchmarks/replan_memory.py --params 20e6 --label quick

Each world size runs in fresh processes (``lightning_zero_offload/testing/ranks.py``, gloo). The engine on the
CPU device with ``in_place_on_cpu=False`` (separate fp32 master, moments and gradient buffer, as with a GPU), the
``--precision`` parameters, the sync schedule: one step with the first layer frozen, then that layer is unfrozen
and the engine re-plans, while a thread samples the RSS every millisecond. Reported per rank: the RSS before
the re-plan, its peak during it, and the difference per trained parameter (the whole model's, not this rank's
shard), for the RSS and its anonymous part. Writes ``benchmarks/results/replan_memory[_LABEL].json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import PeakSampler, anonymous_rss, rss  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def unfreeze(rank: int, params: float, width: int, precision: str) -> dict:
    import torch
    from torch import nn

    from lightning_zero_offload.engine import OffloadEngine, OffloadOptions

    torch.manual_seed(0)
    layers = max(2, round(params / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model[0].requires_grad_(False)
    dtype = {"bf16-mixed": torch.bfloat16, "32-true": torch.float32}[precision]
    model.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    options = OffloadOptions(in_place_on_cpu=False, cpu_step="sync")
    engine = OffloadEngine(optimizer, torch.device("cpu"), dtype, options)
    x = torch.randn(4, width, dtype=dtype)

    def step() -> None:
        engine.replan_if_changed()
        engine.begin_backward()
        model(x).float().pow(2).mean().backward()
        engine.step()
        engine.zero_grad()

    step()
    model[0].requires_grad_(True)
    gc.collect()
    before = {"rss": rss(), "anon": anonymous_rss()}
    samplers = {"rss": PeakSampler(rss), "anon": PeakSampler(anonymous_rss)}
    for sampler in samplers.values():
        sampler.start()
    start = time.perf_counter()
    replanned = engine.replan_if_changed()
    seconds = time.perf_counter() - start
    peaks = {name: sampler.stop() for name, sampler in samplers.items()}
    assert replanned and len(engine.params) == 2 * layers
    step()  # the unfrozen layer trains
    assert engine.state.steps[engine._param_index[id(model[0].weight)]] == 1
    trained = sum(p.numel() for p in model.parameters())
    engine.close()
    return {
        "rank": rank,
        "params": trained,
        "seconds": seconds,
        **{f"{k}_before": v for k, v in before.items()},
        **{f"{k}_peak": v for k, v in peaks.items()},
        **{f"{k}_extra_bytes_per_param": (peaks[k] - before[k]) / trained for k in before},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "32-true"])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    from lightning_zero_offload.testing.ranks import run_ranks

    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            job = partial(unfreeze, params=args.params, width=args.width, precision=args.precision)
            results = run_ranks(job, world, tmp, timeout=900)
        for result in results:
            result["world"] = world
            rows.append(result)
            print(
                f"world {world} rank {result['rank']}: {result['params'] / 1e6:.1f}M params, re-plan "
                f"{result['seconds']:.2f} s, RSS {result['rss_before'] / 2**20:.0f} -> {result['rss_peak'] / 2**20:.0f}"
                f" MiB (+{result['rss_extra_bytes_per_param']:.1f} B/param), anonymous "
                f"+{result['anon_extra_bytes_per_param']:.1f} B/param"
            )
    name = "replan_memory" + (f"_{args.label}" if args.label else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    print(f"wrote benchmarks/results/{name}.json")


if __name__ == "__main__":
    main()
