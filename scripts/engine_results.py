"""The engine's results in 28 configurations, saved so that two trees can be compared bitwise.

A change to the engine's structure must not change a single bit of what it computes. Run ``save`` with
the tree before the change and with the tree after it (``PYTHONPATH`` or the installed package decides
which one is imported), then ``compare``:

    PYTHONPATH=/path/to/old/tree python scripts/engine_results.py save /tmp/before.pt
    python scripts/engine_results.py save /tmp/after.pt
    python scripts/engine_results.py compare /tmp/before.pt /tmp/after.pt

Each configuration trains the tests' small two-group network for 8 steps on the offload path (every
schedule, bf16 and fp32 parameters, with and without clipping, fp32 and bf16 CPU state; plus in place,
weight prediction and the undo rollback), with a write to the parameters between two steps, one
between a backward and its step, and one clip-by-value step, and keeps the master weights, the
optimizer state and the device parameters. Set ``LZO_BACKEND`` to compare another kernel backend.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from engine_helpers import CPU, batches, loss_fn, make_net, options, two_groups  # noqa: E402

from lightning_zero_offload.engine import OffloadEngine  # noqa: E402

Config = tuple[torch.dtype, str, float | None, str, dict[str, Any]]


def configs() -> list[Config]:
    out: list[Config] = []
    for dtype in (torch.float32, torch.bfloat16):
        for schedule in ("sync", "speculative", "delayed"):
            for clip in (None, 0.05):
                for state in ("fp32", "bf16"):
                    snapshot = state == "bf16" and schedule == "speculative"  # bf16 state's only rollback
                    out.append((dtype, schedule, clip, state, {"speculation_rollback": "snapshot"} if snapshot else {}))
    out.append((torch.float32, "sync", None, "fp32", {"in_place_on_cpu": True}))
    out.append((torch.float32, "sync", 0.05, "fp32", {"in_place_on_cpu": True}))
    out.append((torch.bfloat16, "delayed", None, "fp32", {"dpu_weight_prediction": True}))
    out.append((torch.bfloat16, "speculative", 0.05, "fp32", {"speculation_rollback": "undo"}))
    return out


def train(dtype: torch.dtype, schedule: str, clip: float | None, state: str, extra: dict[str, Any]) -> tuple:
    net = make_net()
    kwargs = dict(extra, cpu_step=schedule, cpu_state=state)
    if schedule == "delayed":
        kwargs["dpu_warmup_steps"] = 2
    engine = OffloadEngine(two_groups(net), CPU, dtype, options(**kwargs))
    for step, (x, y) in enumerate(batches(8)):
        if step == 2:
            with torch.no_grad():
                net[2].bias.add_(0.25)  # between steps, as a callback would
        written_after_backward = step == 3 and schedule != "delayed"  # delayed refuses such a write
        engine.expect_step(publish_early=not written_after_backward)
        engine.begin_backward()
        loss_fn(net, (x.to(dtype), y)).backward()
        engine.finish_backward()
        if written_after_backward:
            with torch.no_grad():
                net[0].weight.mul_(0.5)
        engine.step(clip_norm=clip, clip_value=0.3 if step == 5 else None)
    engine.sync()
    device_params = [p.detach().clone() for p in net.parameters()]
    result = (engine.master_params(), engine.optimizer_state_dict()["state"], device_params)
    engine.close()
    return result


def name(config: Config) -> str:
    dtype, schedule, clip, state, extra = config
    return f"{str(dtype).removeprefix('torch.')} {schedule} clip={clip} state={state} {extra or ''}".strip()


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("save", help="train every configuration, save the results").add_argument("out", type=Path)
    compare = sub.add_parser("compare", help="compare two saved files bitwise")
    compare.add_argument("before", type=Path)
    compare.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "save":
        warnings.simplefilter("ignore")  # the options the tests' helper sets that a schedule does not use
        results = {name(config): train(*config) for config in configs()}
        torch.save(results, args.out)
        print(f"{len(results)} configurations -> {args.out}")
        return 0
    before, after = (torch.load(path, weights_only=True) for path in (args.before, args.after))
    if before.keys() != after.keys():
        print(f"different configurations: {sorted(before.keys() ^ after.keys())}")
        return 1
    differ = [key for key in before if not equal(before[key], after[key])]
    for key in differ:
        print(f"differs: {key}")
    print(f"{len(before) - len(differ)} of {len(before)} configurations bitwise equal")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
