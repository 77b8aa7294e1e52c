"""What taking a speculated Adam step back costs: a snapshot (bitwise) against the algebraic undo (rounding).

``cpu_step="speculative"`` runs each bucket's Adam step during backward; when clipping triggers (or the
hyperparameters change, or a gradient overflows) the bucket is rolled back and redone. Two ways:

- ``snapshot``: copy the bucket's fp32 master and moments (12 B/param read + 12 written) before every
  speculated step, copy them back on a rollback. Bitwise; costs 12 B/param of host memory and the copy on
  every step, rolled back or not.
- ``undo``: invert the step from the new state and the gradient (``kernels.adam_undo``, float64): the
  native kernel (native/undo_body.h) and, for comparison, the same arithmetic in torch ops (``undo_torch``,
  the torch backend). No memory and nothing on steps that stand; a rollback costs one pass, and the
  restored state is within fp32 rounding of the original.

Side by side on one bucket, medians of ``--repeats``; prints the time of each against the Adam step itself
and undo's largest error, and writes ``--out``.

    python benchmarks/speculation_rollback.py
    python benchmarks/speculation_rollback.py --numel 1048576 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lightning_zero_offload import kernels

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 22, help="elements in the bucket (default 2^22)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=kernels.get_num_threads())
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "speculation_rollback.json")
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    n = args.numel
    param, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)  # the engine's fp32 CPU gradient
    exp_avg, exp_avg_sq = torch.randn(n, generator=g) * 1e-2, torch.rand(n, generator=g) * 1e-4
    hp = kernels.AdamArgs(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True, maximize=False)
    state = (param, exp_avg, exp_avg_sq)
    saved = [t.clone() for t in state]
    step, scale = 10, 1.0 / 1024

    def adam() -> None:
        kernels.adam_step(
            param, grad, exp_avg, exp_avg_sq, hparams=hp, step=step, grad_scale=scale, num_threads=args.threads
        )

    def restore() -> None:
        for t, s in zip(state, saved):
            t.copy_(s)

    def snapshot() -> None:
        for s, t in zip(saved, state):
            s.copy_(t)

    def undo() -> None:
        kernels.adam_undo(
            param, grad, exp_avg, exp_avg_sq, hparams=hp, step=step, grad_scale=scale, num_threads=args.threads
        )

    def undo_torch() -> None:
        native = kernels.backend()
        kernels.set_backend("torch")
        try:
            undo()
        finally:
            kernels.set_backend(native)

    original = [t.clone() for t in state]
    adam()
    stepped = [t.clone() for t in state]
    undo()
    # the restored state's largest error, as a fraction of the largest change the step made
    errors = {
        name: float((t - o).abs().max() / (s - o).abs().max())
        for name, t, o, s in zip(("param", "exp_avg", "exp_avg_sq"), state, original, stepped)
    }
    restore()

    seconds = {
        "adam_step": timed(adam, args.repeats),
        "snapshot_save": timed(snapshot, args.repeats),
        "snapshot_restore": timed(restore, args.repeats),
        "undo": timed(undo, args.repeats),
        "undo_torch": timed(undo_torch, args.repeats),
    }
    result = {
        "numel": n,
        "threads": args.threads,
        "backend": kernels.backend(),
        "ms": {k: 1e3 * v for k, v in seconds.items()},
        "relative_to_adam_step": {k: v / seconds["adam_step"] for k, v in seconds.items()},
        "undo_max_error_over_max_update": errors,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"{n:,} elements, {args.threads} thread(s), {kernels.backend()} kernels; ms (x the Adam step):")
    for name, ms in result["ms"].items():
        print(f"  {name:17s} {ms:8.2f}  ({result['relative_to_adam_step'][name]:.2f}x)")
    print("  undo's largest error / the step's largest change: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
