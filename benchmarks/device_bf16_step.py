"""The device share's bf16-state step (kernels/device.py) fused by torch.compile against its unfused pass, side by
side on one device: milliseconds per step of 100M elements (best of the rounds, alternated, after a first call
that compiles), the first call's compile time, and what the unfused step launches per pass (kernels, and the bytes
of the pass's size they read and write, counted by a dispatch mode), which bounds it on a GPU. Both must give the
same bits; this checks it.

    python benchmarks/device_bf16_step.py                  # the CPU device here; cuda where there is one
    python benchmarks/device_bf16_step.py --n 16777216 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_zero_offload.kernels import AdamArgs, device, reference
from lightning_zero_offload.kernels.arguments import FlatAdamCall

HPARAMS = AdamArgs(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True)
VIEWS = ("view", "detach", "slice", "unbind", "select", "alias")  # no traffic


class KernelCount(TorchDispatchMode):
    """Operations that write a tensor of the pass's size, and the bytes of their inputs and outputs of that size."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.kernels, self.bytes = size, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(name in func.__name__ for name in VIEWS):
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.numel() == self.size]
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if outputs or func.__name__.startswith("copy_"):
                self.kernels += 1
                touched = outputs + [t for t in inputs if t.numel() == self.size]
                self.bytes += sum(t.numel() * t.element_size() for t in touched)
        return out


def state(n: int, where: torch.device) -> list[torch.Tensor]:
    """p, g, m, v in bf16 on ``where``."""
    gen = torch.Generator().manual_seed(0)
    p, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen) * 1e-4
    return [t.to(torch.bfloat16).to(where) for t in (p, g, m * 0.01, v)]


def synchronize(where: torch.device) -> None:
    if where.type != "cpu":
        torch.accelerator.synchronize(where)


def timed_step(run_pass, tensors: list[torch.Tensor], step: int, where: torch.device) -> float:
    p, g, m, v = tensors
    call = FlatAdamCall(HPARAMS, p, g, m, v, step, 1.0, 1, 7, 0)
    synchronize(where)
    start = time.perf_counter()
    reference.bf16_state_step(call, device.BF16_STATE_CHUNK, run_pass)
    synchronize(where)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4 * device.BF16_STATE_CHUNK, help="elements (default: 4 passes)")
    parser.add_argument("--rounds", type=int, default=3, help="timed steps of each, after the first")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    where = torch.device(args.device)
    steps = {"unfused": reference.bf16_state_pass, "fused": device.FusedPass()}
    tensors = {name: state(args.n, where) for name in steps}
    first = {name: timed_step(run, tensors[name], 1, where) for name, run in steps.items()}
    if steps["fused"].failure is not None:
        raise SystemExit(f"torch.compile failed on {where}: {steps['fused'].failure}")
    per_100m = 1e3 * 1e8 / args.n  # ms per 100M elements, from seconds per step
    rounds: dict[str, list[float]] = {name: [] for name in steps}
    for step in range(2, 2 + args.rounds):  # alternated, so that both see the same machine
        for name, run in steps.items():
            rounds[name].append(per_100m * timed_step(run, tensors[name], step, where))
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(*tensors.values()))
    size = min(args.n, device.BF16_STATE_CHUNK)
    count = KernelCount(size)
    with count:  # one pass of the unfused step
        timed_step(reference.bf16_state_pass, state(size, where), 1, where)
    best = {name: min(ms) for name, ms in rounds.items()}
    figures = {
        "device": str(where),
        "torch": torch.__version__,
        "n": args.n,
        "same_bits": same,
        "compile_s": first["fused"] - best["fused"] / per_100m,
        "ms_per_100M": best,
        "ms_per_100M_rounds": rounds,
        "unfused_over_fused": best["unfused"] / best["fused"],
        "unfused_pass": {"kernels": count.kernels, "bytes_per_element": count.bytes / size},
    }
    print(
        f"{args.n:,} bf16 elements on {where}, torch {torch.__version__}: best of {args.rounds} steps after the first"
    )
    for name, ms in rounds.items():
        print(f"  {name:8s} {best[name]:10.1f} ms per 100M elements   (rounds {min(ms):.1f}-{max(ms):.1f})")
    print(
        f"  unfused / fused: {figures['unfused_over_fused']:.1f}x; same bits: {same}; the first fused call compiled"
        f" for about {figures['compile_s']:.1f} s"
    )
    print(f"  the unfused step per pass: {count.kernels} kernels, {count.bytes / size:.0f} bytes per element")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if not same:
        raise SystemExit("the fused and the unfused steps gave different bits")


if __name__ == "__main__":
    main()
