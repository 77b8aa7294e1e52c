"""Parameter offload (``offload_params=True``) against what a user would pick instead: torch FSDP2 with
``CPUOffloadPolicy`` and torch's ``AdamW(fused=True)`` stepping after backward, on the simulated accelerator.

The simulated device is benchmarks/sim_device.py's: every block sleeps for its device time in forward and
backward (the GIL released and the host CPU idle, as while a GPU kernel runs) and hands back gradients of
real size for real parameters. FSDP2's hooks, all-gathers and reduce-scatters (on a CPU device: host copies
and casts, which both sides pay alike), the gradient shards on the host and both CPU steps are real.

Both sides run the Lightning loop on the same model, put on FSDP2 the same way (``fully_shard`` per block,
then the root; shards on the host; bf16 compute, fp32 reduce), with clipping by norm at a threshold the
gradients never reach (the norm is computed every step, nothing is clipped):

- the anchor: Lightning's ``ModelParallelStrategy``, the user's ``fully_shard(..., offload_policy=
  CPUOffloadPolicy(pin_memory=False))`` in ``configure_model``, ``torch.optim.AdamW(fused=True)``, and
  ``precision="32-true"`` with FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``: under
  ``"bf16-mixed"`` Lightning refuses gradient clipping with a fused optimizer;
- ours: ``ZeroOffloadStrategy(offload_params=True)``, ``precision="bf16-mixed"``, the CPU step set
  explicitly as an accelerator would (on a CPU device the defaults are sync with nothing overlapped):
  fp32 state speculative with overlap (the ZeRO-2 mode's default on an accelerator), fp32 sync (this
  mode's default), bf16 state sync and bf16 state speculative; and fp32 state, sync and speculative, with the
  first block (whose gradient arrives last) in the device share, as ``device_share="auto"`` chooses with the
  speculative step on an accelerator. The share's step and norm are device time: asleep for the bytes they
  move at an H100's memory bandwidth (:func:`simulate_device_steps`), the host free meanwhile.

The configurations alternate, fit after fit, round after round, each fit in a fresh interpreter; each
fit's first ``--warmup`` steps are not measured. The device time is set relative to our fp32 CPU step,
measured first with no device time (``--ratio`` = backward time / CPU step time, 1 by default: the
targets' point).

``--real`` runs the CPU-only comparison instead: a real model (residual MLP blocks, fp32, no sleeping) on
the CPU device, the anchor against ours with its CPU-device defaults.

    python benchmarks/sim_device_params.py               # 64M params in 8 blocks, 3 rounds (minutes)
    python benchmarks/sim_device_params.py --real        # the CPU-only run with the real model
    python benchmarks/sim_device_params.py --quick       # a small model, one round: the logic only
    python benchmarks/sim_device_params.py --profile 12  # where each configuration's time goes
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_device import CLIP_QUIET, GRAD_NORM, quiet_fit, set_device_time, sleeping_blocks  # noqa: E402

from lightning_zero_offload import ZeroOffloadStrategy, kernels  # noqa: E402
from lightning_zero_offload.engine.offload_params.heap import limit_retained_heap  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "offload_params"
ANCHOR = "anchor: FSDP2 + AdamW(fused)"
FSDP2_ALONE = "FSDP2 alone, no step"


@dataclass(frozen=True)
class Config:
    """One side of the comparison; ``cpu_step`` None: the strategy's own default for the device;
    ``device_blocks``: the first blocks kept in the device share."""

    name: str
    cpu_state: str = "fp32"
    cpu_step: str | None = None
    device_blocks: int = 0


SHARED_SPECULATIVE = "ours fp32, speculative, block 0 on device"
SHARED_SYNC = "ours fp32, sync, block 0 on device"
DEVICE_BANDWIDTH = 3.35e12  # bytes/s: an H100 SXM's HBM3, the simulated device's memory


SIMULATED = [
    Config(ANCHOR),
    Config(FSDP2_ALONE),
    Config("ours fp32, speculative", "fp32", "speculative"),
    Config("ours fp32, sync", "fp32", "sync"),
    Config("ours bf16, sync", "bf16", "sync"),
    Config("ours bf16, speculative", "bf16", "speculative"),
    Config(SHARED_SYNC, "fp32", "sync", device_blocks=1),
    Config(SHARED_SPECULATIVE, "fp32", "speculative", device_blocks=1),
]
REAL = [Config(ANCHOR), Config(FSDP2_ALONE), Config("ours fp32, CPU defaults")]
TARGETS = {  # (ours, the least ratio anchor step time / ours): the targets
    "simulated": [("ours fp32, speculative", 1.2), ("ours bf16, sync", 1.5), ("ours bf16, speculative", 1.5)],
    "real": [("ours fp32, CPU defaults", 1.0)],  # "no slower than that anchor"
}


# --------------------------------------------------------------------------------------------------
# the models


class SleepingNet(nn.Module):
    """sim_device's sleeping blocks (two matrices and a bias each, fixed gradients of norm ``GRAD_NORM`` in
    all) in a ModuleList run in order: the shape FSDP2 wraps per block."""

    def __init__(self, blocks: int, params_per_block: int) -> None:
        super().__init__()
        self.blocks = sleeping_blocks(blocks, params_per_block)

    def set_device_time(self, forward_s: float, backward_s: float) -> None:
        set_device_time(self.blocks, forward_s, backward_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class MlpBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class MlpNet(nn.Module):
    """The real model of ``--real``: residual MLP blocks (about 8 width^2 parameters each)."""

    def __init__(self, blocks: int, params_per_block: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        width = max(8, round(math.sqrt(params_per_block / 8)))
        self.blocks = nn.ModuleList(MlpBlock(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Trained(L.LightningModule):
    """The LightningModule both sides train: ``net`` on inputs standing for an embedding's output."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        # An embedding's output requires grad: so FSDP2 reduces the first block during backward, as in an
        # LLM (an input without grad would leave it to FSDP2's final callback: docs/design/offload-params-spike.md, 2)
        return self.net(batch[0].requires_grad_()).float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)


class Anchor(Trained):
    """What a user of ``ModelParallelStrategy`` writes: ``fully_shard`` in ``configure_model``, a fused AdamW.

    Times, per step, the clipping and then torch's step (from the clipping's end to ``optimizer.step``'s,
    which runs Lightning's closure, forward and backward, first): the host work the device waits for.
    """

    def __init__(self, net: nn.Module, param_dtype: torch.dtype) -> None:
        super().__init__(net)
        self.param_dtype = param_dtype
        self.clip_s: list[float] = []
        self.optimizer_s: list[float] = []
        self._clipped = 0.0

    def configure_model(self) -> None:
        policy = {
            "mesh": self.device_mesh["data_parallel"],
            "offload_policy": CPUOffloadPolicy(pin_memory=False),  # pinning needs an accelerator
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32),
        }
        for block in self.net.blocks:
            fully_shard(block, **policy)
        fully_shard(self.net, **policy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        super().configure_gradient_clipping(optimizer, *args, **kwargs)
        self._clipped = time.perf_counter()
        self.clip_s.append(self._clipped - start)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)
        self.optimizer_s.append(time.perf_counter() - self._clipped)


class Fsdp2Alone(Anchor):
    """The anchor's loop without its step and clipping: the part of every step both sides share (on a CPU
    device FSDP2's all-gathers and reduce-scatters are host copies; on an accelerator, device work)."""

    def configure_gradient_clipping(self, *args: Any, **kwargs: Any) -> None:
        pass

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()


# --------------------------------------------------------------------------------------------------
# one fit


class StepClock(L.Callback):
    """Wall time at the end of every training batch, and our engine's statistics of that step. (No
    on_before_optimizer_step here: such a hook would keep the speculative step from running in backward.)"""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.faults: list[tuple[int, int]] = []  # this process's (minor, major) page faults so far
        self.stats: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.faults.append((usage.ru_minflt, usage.ru_majflt))
        stats = getattr(trainer.strategy, "last_step_stats", None)
        if stats is not None:
            self.stats.append({k: float(getattr(stats, k)) for k in ("cpu_step_s", "speculated_fraction", "total_s")})


def run(config: Config, args: argparse.Namespace, device_s: tuple[float, float], steps: int) -> dict[str, Any]:
    """One short fit of ``config``; returns its per-step times (seconds) and what each side reports."""
    if args.real:
        net: nn.Module = MlpNet(args.blocks, args.params_per_block)
        param_dtype, precision = torch.float32, "32-true"
    else:
        net = SleepingNet(args.blocks, args.params_per_block)
        net.set_device_time(*device_s)
        param_dtype, precision = torch.bfloat16, "bf16-mixed"
    if config.name in (ANCHOR, FSDP2_ALONE):
        module: Trained = (Anchor if config.name == ANCHOR else Fsdp2Alone)(net, param_dtype)
        strategy: Any = ModelParallelStrategy()
        precision = "32-true"  # FSDP2's mp_policy casts to param_dtype; Lightning's bf16-mixed refuses clipping
    else:
        module = Trained(net)
        schedule = {} if config.cpu_step is None else {"cpu_step": config.cpu_step, "overlap": True}
        # whole blocks within the share (the LightningModule, the root, holds no parameter of its own)
        share = (config.device_blocks + 0.5) / args.blocks if config.device_blocks else 0.0
        strategy = ZeroOffloadStrategy(
            offload_params=True,
            cpu_state=config.cpu_state,
            cpu_threads=args.cpu_threads,
            metrics=False,
            device_share=share,
            **schedule,
        )
    clock = StepClock()
    width = net.blocks[0].fc1.in_features if args.real else 1
    data = DataLoader(TensorDataset(torch.randn(steps * args.rows, width)), batch_size=args.rows)
    quiet_fit(module, data, strategy, steps, CLIP_QUIET, [clock], precision)
    out = {"times": [b - a for a, b in zip(clock.ends, clock.ends[1:])], "stats": clock.stats}
    out["faults"] = [[b - a for a, b in zip(x, y)] for x, y in zip(clock.faults, clock.faults[1:])]
    out["optimizer_s"] = getattr(module, "optimizer_s", []) if config.name == ANCHOR else []
    out["clip_s"] = getattr(module, "clip_s", []) if config.name == ANCHOR else []
    return out


def run_child(script: str, job: dict[str, Any], what: str, echo: bool = False) -> dict[str, Any]:
    """``script`` run again with this command line plus ``--fit job --fit-out FILE`` in a fresh interpreter, its
    result read from that file; a failure raised with the child's output (``what``: the fit, for the message)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fit.json"
        command = [sys.executable, script, *sys.argv[1:], "--fit", json.dumps(job), "--fit-out", str(out)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            output = f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
            raise RuntimeError(f"the fit {what} failed (exit status {done.returncode}):\n{output}")
        if echo:
            print(done.stdout, end="", flush=True)
        return json.loads(out.read_text())


def fit_in_a_fresh_process(
    config: Config, args: argparse.Namespace, device_s: tuple[float, float], steps: int
) -> dict[str, Any]:
    """:func:`run` in a fresh interpreter: the heap each fit starts from is its own (glibc serves FSDP2's
    per-unit buffers from a heap that every earlier fit in a process shapes, and the step time of FSDP2's
    copies on a CPU device varied 2-3x with that history)."""
    job = {"config": config.name, "device_s": list(device_s), "steps": steps}
    return run_child(__file__, job, f"of {config.name!r}", echo=args.profile)


def one_fit(args: argparse.Namespace) -> None:
    """The child of :func:`fit_in_a_fresh_process` (``--fit``): one fit, its result in ``--fit-out``;
    under ``--profile``, cProfile's view of the training thread (a step speculated on the worker shows
    as waiting): the functions with the most own time, ms per step (the fit's setup spread over them)."""
    job = json.loads(args.fit)
    config = next(c for c in (REAL if args.real else SIMULATED) if c.name == job["config"])
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    if config.device_blocks:
        simulate_device_steps()
    result = run(config, args, tuple(job["device_s"]), job["steps"])
    if profiler is not None:
        import pstats

        profiler.disable()
        stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive, own s, total s, callers)
        print(f"\n{config.name}: own time per step, ms ({job['steps']} steps, setup included)")
        for (file, line, name), row in sorted(stats.items(), key=lambda item: -item[1][2])[: args.profile]:
            print(f"  {1e3 * row[2] / job['steps']:8.1f}  {name} ({Path(file).name}:{line})")
    Path(args.fit_out).write_text(json.dumps(result))


def simulate_device_steps() -> None:
    """The device share's step and gradient norm (kernels/device.py) as device time: asleep, the GIL released,
    for the bytes each moves at :data:`DEVICE_BANDWIDTH` (read p, m, v and the gradient, write p, m, v), the
    host free meanwhile, as while a GPU kernel runs. The arithmetic is skipped: the sleeping blocks' gradients
    are fixed and nothing here reads the weights, and the share's part of the gradient norm counts as 0 (the
    clipping threshold is never reached, with it or without: CLIP_QUIET)."""
    from lightning_zero_offload.kernels import device

    def adam_step_multi(params: list[torch.Tensor], grads: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
        time.sleep(sum(6 * p.nbytes + g.nbytes for p, g in zip(params, grads)) / DEVICE_BANDWIDTH)

    def adam_step_bf16_state(param: torch.Tensor, grad: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        time.sleep((6 * param.nbytes + grad.nbytes) / DEVICE_BANDWIDTH)

    def sum_of_squares(src: torch.Tensor) -> tuple[float, bool]:
        time.sleep(src.nbytes / DEVICE_BANDWIDTH)
        return 0.0, False

    device.adam_step_multi = adam_step_multi  # type: ignore[assignment]
    device.adam_step_bf16_state = adam_step_bf16_state  # type: ignore[assignment]
    device.sum_of_squares = sum_of_squares  # type: ignore[assignment]


def summarize(fits: list[dict[str, Any]], warmup: int, device_ms: float) -> dict[str, Any]:
    """Medians over the measured steps of every fit of one configuration; each fit's median (the spread)."""
    times = [t for fit in fits for t in fit["times"][warmup:]]
    out: dict[str, Any] = {"step_ms": 1e3 * statistics.median(times), "steps": len(times)}
    out["fit_median_step_ms"] = [1e3 * statistics.median(fit["times"][warmup:]) for fit in fits]
    out["exposed_ms"] = out["step_ms"] - device_ms  # the host work the device waited for
    # a fresh page costs a fault (and its zeroing): where FSDP2's per-unit buffers are mapped afresh each step
    faults = [f for fit in fits for f in fit["faults"][warmup:]]
    out["minor_faults_per_step"] = statistics.median(minor for minor, _ in faults)
    out["major_faults_per_step"] = statistics.median(major for _, major in faults)
    stats = [row for fit in fits for row in fit["stats"][warmup + 1 :]]
    if stats:  # ours: the CPU step (during backward where speculated), and the share stepped during backward
        out["cpu_step_ms"] = 1e3 * statistics.median(r["cpu_step_s"] for r in stats)
        out["speculated_fraction"] = statistics.median(r["speculated_fraction"] for r in stats)
        out["after_backward_ms"] = 1e3 * statistics.median(r["total_s"] for r in stats)  # the engine's step()
    optimizer = [s for fit in fits for s in fit["optimizer_s"][warmup + 1 :]]
    if optimizer:  # the anchor: clipping, then torch's fused AdamW step
        clip = [s for fit in fits for s in fit["clip_s"][warmup + 1 :]]
        out["clip_ms"] = 1e3 * statistics.median(clip)
        out["optimizer_step_ms"] = 1e3 * statistics.median(optimizer)
        out["after_backward_ms"] = 1e3 * statistics.median(a + b for a, b in zip(clip, optimizer))
    return out


def compare(results: dict[str, dict[str, Any]]) -> None:
    """Each configuration's speed-up over the anchor: of the medians, and per round (the spread); and the
    time it adds to FSDP2 alone (``added_to_fsdp2_alone_ms``; negative where FSDP2's own host copies ran
    faster beside it than alone: on a CPU device their cost depends on what else the host does)."""
    anchor, alone = results[ANCHOR], results[FSDP2_ALONE]
    for r in results.values():
        r["speedup_vs_anchor"] = anchor["step_ms"] / r["step_ms"]
        rounds = zip(anchor["fit_median_step_ms"], r["fit_median_step_ms"])
        r["speedup_vs_anchor_per_round"] = [a / b for a, b in rounds]
        r["added_to_fsdp2_alone_ms"] = r["step_ms"] - alone["step_ms"]


# --------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model, one round, few steps: the logic only")
    parser.add_argument("--real", action="store_true", help="the CPU-only run: a real model, no sleeping")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--params-per-block", type=float, default=None, help="default 8M (--real 4M, quick 64k)")
    parser.add_argument("--rows", type=int, default=None, help="--real: input rows per step (default 64)")
    parser.add_argument("--ratio", type=float, default=1.0, help="backward time / our fp32 CPU step time")
    parser.add_argument("--forward-ratio", type=float, default=0.5, help="forward time / backward time")
    parser.add_argument("--rounds", type=int, default=None, help="fits per configuration (default 3, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per fit (default 10, quick 2)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps at the start of each fit")
    parser.add_argument("--cpu-threads", type=int, default=None, help="our CPU Adam threads (default: usable cores)")
    parser.add_argument("--configs", nargs="+", help="only these of ours (by name; the anchor and FSDP2 alone run)")
    parser.add_argument(
        "--limit-heap",
        action="store_true",
        help="fix glibc's mmap threshold for the whole run first (limit_retained_heap(), as "
        "MALLOC_MMAP_THRESHOLD_=131072 does): FSDP2's per-unit buffers are then mapped afresh every step",
    )
    parser.add_argument("--profile", type=int, metavar="N", help="no timing: each configuration once under cProfile")
    parser.add_argument("--out", default=None, help="default benchmarks/results/offload_params/<sim|real>.json")
    parser.add_argument("--fit", help=argparse.SUPPRESS)  # internal: run one fit in this process
    parser.add_argument("--fit-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.limit_heap:
        limit_retained_heap()
    args.cpu_threads = args.cpu_threads or kernels.usable_cores()
    default_size = 2**16 if args.quick else (4 * 2**20 if args.real else 8 * 2**20)
    args.params_per_block = int(args.params_per_block or default_size)
    args.rows = args.rows or (4 if args.quick else 64)
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.steps or (2 if args.quick else 10)
    kind = "real" if args.real else "simulated"
    configs = [
        c
        for c in (REAL if args.real else SIMULATED)
        if not args.configs or c.name in (ANCHOR, FSDP2_ALONE, *args.configs)
    ]
    out_path = Path(args.out or RESULTS / f"{'real' if args.real else 'sim'}.json")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # one fit per measurement: no banners
    if args.fit:
        one_fit(args)
        return
    net = (MlpNet if args.real else SleepingNet)(args.blocks, args.params_per_block)
    params = sum(p.numel() for p in net.parameters())
    del net
    fit_steps = args.warmup + steps + 1  # +1: the first step has no step before it to be timed from
    if args.profile:
        for config in configs:
            fit_in_a_fresh_process(config, args, (0.0, 0.0), fit_steps)
        return

    device_s, device_ms, calibration = (0.0, 0.0), 0.0, {}
    if not args.real:
        # our fp32 CPU step with no device time (sync: all of it after backward) is the unit of device time
        named = {c.name: c for c in SIMULATED}
        ours = fit_in_a_fresh_process(named["ours fp32, sync"], args, (0.0, 0.0), fit_steps)
        anchor = fit_in_a_fresh_process(named[ANCHOR], args, (0.0, 0.0), fit_steps)
        ours, anchor = summarize([ours], args.warmup, 0.0), summarize([anchor], args.warmup, 0.0)
        calibration = {"ours_fp32_cpu_step_ms": ours["cpu_step_ms"]}
        calibration |= {"anchor_clip_ms": anchor["clip_ms"], "anchor_optimizer_step_ms": anchor["optimizer_step_ms"]}
        calibration |= {"step_ms_without_device_time": {"ours fp32, sync": ours["step_ms"], ANCHOR: anchor["step_ms"]}}
        backward_s = args.ratio * calibration["ours_fp32_cpu_step_ms"] / 1e3 / args.blocks
        device_s = (args.forward_ratio * backward_s, backward_s)
        device_ms = 1e3 * args.blocks * sum(device_s)
    print(header(args, params, calibration, device_s))

    fits: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
    for _ in range(rounds):  # alternate the configurations, round after round
        for config in configs:
            fits[config.name].append(fit_in_a_fresh_process(config, args, device_s, fit_steps))
    results = {name: summarize(f, args.warmup, device_ms) for name, f in fits.items()}
    compare(results)
    print_results(results)
    verdict = judge(results, TARGETS[kind])

    record = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cores": kernels.usable_cores(),
            "torch": torch.__version__,
            "lightning": L.__version__,
            "load_average_1_5_15min_at_end": os.getloadavg(),  # how shared the machine was
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["python", *sys.argv]),
        "glibc_mmap_threshold": heap_setting(args.limit_heap),
        "kind": kind,
        "kernel_backend": kernels.backend(),
        "cpu_threads": args.cpu_threads,
        "params": params,
        "blocks": args.blocks,
        "rows": args.rows if args.real else None,
        "clip_norm": CLIP_QUIET,
        "grad_norm": None if args.real else GRAD_NORM,
        "rounds": rounds,
        "steps_per_fit": steps,
        "warmup_steps_per_fit": args.warmup,
        "calibration": calibration,
        "backward_over_cpu_step": None if args.real else args.ratio,
        "device_forward_ms": 1e3 * args.blocks * device_s[0],
        "device_backward_ms": 1e3 * args.blocks * device_s[1],
        "results": results,
        "targets": verdict,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out_path}")


def heap_setting(limited: bool) -> str:
    if limited:
        return "fixed at 128 KiB by limit_retained_heap()"
    fixed = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    return f"MALLOC_MMAP_THRESHOLD_={fixed}" if fixed else "glibc's default (dynamic)"


def header(args: argparse.Namespace, params: int, calibration: dict[str, Any], device_s: tuple[float, float]) -> str:
    what = f"{params / 1e6:.1f}M params in {args.blocks} blocks"
    if args.real:
        return f"{what}, real MLP blocks, fp32, {args.rows} rows per step, CPU device, no simulated device time"
    return (
        f"{what}, sleeping blocks, bf16 compute; CPU Adam on {kernels.backend()} with {args.cpu_threads} thread(s).\n"
        f"Without device time: our fp32 CPU step {calibration['ours_fp32_cpu_step_ms']:.1f} ms; the anchor's "
        f"clipping {calibration['anchor_clip_ms']:.1f} ms, fused AdamW step "
        f"{calibration['anchor_optimizer_step_ms']:.1f} ms.\n"
        f"Device time per step: forward {1e3 * args.blocks * device_s[0]:.0f} ms + backward "
        f"{1e3 * args.blocks * device_s[1]:.0f} ms (backward / our fp32 CPU step = {args.ratio:g})"
    )


def print_results(results: dict[str, dict[str, Any]]) -> None:
    """One row per configuration. exposed: step time less the device time; added: step time less FSDP2
    alone's; cpu step: ours, wherever it ran (speculated: on the worker during backward); clip+adamw: the
    anchor's, after backward; after bwd: the host time after backward, which a GPU would wait for (the
    anchor's clipping and step; our engine's step(): the norm, validation and what was not speculated);
    faults: minor page faults (fresh pages) per step."""
    print(
        f"\n  {'configuration':<42} {'step ms':>8} {'fits':>11} {'vs anchor':>9} {'rounds':>11} {'exposed':>8}"
        f" {'added':>7} {'cpu step':>9} {'speculated':>10} {'clip+adamw':>11} {'after bwd':>9} {'faults':>7}"
    )
    for name, r in results.items():
        fits = f"{min(r['fit_median_step_ms']):.0f}-{max(r['fit_median_step_ms']):.0f}"
        per_round = r["speedup_vs_anchor_per_round"]
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
        cpu = f"{r['cpu_step_ms']:.1f}" if "cpu_step_ms" in r else "-"
        speculated = f"{100 * r['speculated_fraction']:.0f}%" if "speculated_fraction" in r else "-"
        anchor = f"{r['clip_ms']:.0f}+{r['optimizer_step_ms']:.0f}" if "optimizer_step_ms" in r else "-"
        after = f"{r['after_backward_ms']:.1f}" if "after_backward_ms" in r else "-"
        print(
            f"  {name:<42} {r['step_ms']:8.1f} {fits:>11} {r['speedup_vs_anchor']:8.2f}x {spread:>11}"
            f" {r['exposed_ms']:8.1f} {r['added_to_fsdp2_alone_ms']:7.1f} {cpu:>9} {speculated:>10} {anchor:>11}"
            f" {after:>9} {r['minor_faults_per_step']:>7.0f}"
        )


def judge(results: dict[str, dict[str, Any]], targets: list[tuple[str, float]]) -> dict[str, Any]:
    """The targets on the measured step times. Beside each, the ratio of the host time after backward
    (the anchor's over ours): the part of the step a GPU waits for, free of FSDP2's copies, which are host
    work on a CPU device only."""
    print("\ntargets (anchor step time / ours, medians; per-round range in brackets; host time after backward):")
    verdict = {}
    after = results[ANCHOR]["after_backward_ms"]
    for name, needed in (target for target in targets if target[0] in results):  # --configs may leave some out
        r = results[name]
        ratio, rounds = r["speedup_vs_anchor"], r["speedup_vs_anchor_per_round"]
        verdict[f"{name} vs anchor"] = {"ratio": ratio, "per_round": rounds, "needed": needed, "met": ratio >= needed}
        verdict[f"{name} vs anchor"]["after_backward_ratio"] = after / r["after_backward_ms"]
        met = "met" if ratio >= needed else "NOT met"
        print(
            f"  {name} vs anchor: {ratio:.3f}x [{min(rounds):.2f}-{max(rounds):.2f}] (target >= {needed}) {met};"
            f" after backward {after:.0f} / {r['after_backward_ms']:.0f} ms = {after / r['after_backward_ms']:.2f}x"
        )
    return verdict


if __name__ == "__main__":
    main()
