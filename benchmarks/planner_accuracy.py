"""The planner's predictions against measured training steps, for three model sizes, side by side.

The demo GPT on the CPU "device", driven through the engine (sync CPU step, no overlap); each
round measures the machine's rates (probes) and then runs the steps, rounds interleaved over the sizes,
so load changes on a shared machine hit prediction and measurement alike. Prints predicted/measured for
forward+backward (with the gradient transfers), CPU step and whole step; the acceptance bound is 25%
(ratios 0.75-1.25). Sizes start above the L3 cache (16 B/param of state), where the planner's DRAM
bandwidth model applies. fp32 by default: CPUs without AVX-512 BF16 run bf16 matmuls some 30x slower,
which would make a run take minutes; the CPU step moves 28 B/param either way (--precision bf16-mixed).

    python benchmarks/planner_accuracy.py            # three sizes, 1 and 2 threads (~2 min on 2 cores)
    python benchmarks/planner_accuracy.py --quick    # smaller sizes, fewer rounds
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from functools import partial
from pathlib import Path

from lightning_zero_offload import kernels
from lightning_zero_offload.demo.model import GPT
from lightning_zero_offload.planner.validate import compare

SIZES = {"small": (2, 384), "medium": (3, 512), "large": (6, 512)}  # name: (n_layer, n_embd)
QUICK_SIZES = {"small": (2, 384), "medium": (2, 448), "large": (2, 512)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner_accuracy.json"))
    args = parser.parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    seq_len, batch = (32, 2) if args.quick else (64, 4)
    rounds, steps = (2, 2) if args.quick else (3, 2)
    rows = []
    for threads in args.threads:
        builders = {name: partial(GPT, n_layer=n, n_embd=d, block_size=seq_len) for name, (n, d) in sizes.items()}
        layers = {name: n for name, (n, _) in sizes.items()}
        result = compare(
            builders,
            batch_size=batch,
            seq_len=seq_len,
            n_layer=layers,
            threads=threads,
            rounds=rounds,
            steps=steps,
            precision=args.precision,
        )
        for name, c in result.items():
            rows.append({"threads": threads, "model": name, "params": c.params, **{
                f"{kind}_{key}_ms": 1e3 * getattr(c, kind)[key]
                for kind in ("predicted", "measured") for key in c.predicted
            }, **{f"ratio_{key}": c.ratio(key) for key in c.predicted}})  # fmt: skip
    print(f"\nGPT, batch {batch} x {seq_len} tokens, {args.precision} on the CPU device; kernels: {kernels.backend()}")
    print("predicted / measured ms (ratio)")
    print(f"{'thr':>3} {'model':<7} {'params':>7} {'fwd+bwd':>22} {'CPU step':>22} {'whole step':>22}")
    for r in rows:
        cells = [
            f"{r[f'predicted_{k}_ms']:7.1f} / {r[f'measured_{k}_ms']:7.1f} ({r[f'ratio_{k}']:.2f})"
            for k in ("forward_backward", "cpu_step", "total")
        ]
        print(f"{r['threads']:>3} {r['model']:<7} {r['params'] / 1e6:6.1f}M " + " ".join(f"{c:>22}" for c in cells))
    if not args.quick:
        out = {
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor(),
                "backend": kernels.backend(),
            },
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "batch": batch,
            "precision": args.precision,
            "seq_len": seq_len,
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
