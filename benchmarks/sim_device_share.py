"""The ZeRO-2 mode's device share on the simulated accelerator, with a model whose embedding's gradient arrives last.

The model has a Hugging Face GPT-2's parameters (``GPT2Config()``, 124M: the shapes read from ``GPT2LMHeadModel``
built on the meta device), grouped into the blocks its forward runs: the embeddings (``wte``, ``wpe``), each
transformer layer, the final norm, and the output layer, **tied** (``wte`` used again, as GPT-2 has it) or
**untied** (an ``lm_head`` of its own, registered last). Every block sleeps for its device time in forward and
backward and hands back gradients of real size (benchmarks/sim_device.py's simulated device): the layers and the
output layer in proportion to their parameters (their matmuls), the embedding lookup none. With tied weights the
embedding's gradient is complete only when backward ends (autograd adds the output's use to the input's, a device
kernel here asleep for its bytes); untied, the output layer's arrives first and the embedding's still last. The
embedding (38.6M) is larger than a bucket, so it is split across three (engine/step/layout.py).

What a GPU does from its own memory is device time, asleep for the bytes it moves at an H100's bandwidth, the host
free meanwhile: the share's step and gradient norm (sim_device_params.py's :func:`simulate_device_steps`), its
gradient accumulation and its cast into the device parameters, the gradient hooks' copies into the bucket buffers,
the checksums of the weights (:func:`simulate_device_state_work`); the transfer of a bucket to the host is queued on
a copy engine at a PCIe link's bandwidth, the gradient worker waiting for it (:func:`wait_for_transfers`). So the
host does what it does on a GPU machine: the CPU step, the accumulation into the fp32 buffer, the copy-back, and the
engine's bookkeeping. Gradients are fresh zeros each pass (autograd hands them over instead of copying them; the
host's work does not depend on the values).

Configurations alternate fit by fit, round after round, each fit in a fresh interpreter (a model-sized state
freed in a process is not all given back to the system, and the next fit's memory check then refuses it):
``speculative`` with ``device_share="auto"`` (the engine's own choice after its second step, from what that step
measured, the device's free memory pretended ample: on a CPU device "auto" keeps nothing), then ``sync`` with no
share and with the share auto chose, and ``speculative`` with none. Reported per configuration: the step time, the
host time the device waited for (``exposed_ms``: the step time less the simulated device time), and the time from
the end of the device's backward (the embedding block's, the last to run) to the end of the step
(``after_backward_ms``: the last buckets' transfer and step, the validation, the copy-back; of it, the host's CPU
Adam and gradient accumulation apart, timed around their kernels), against one bucket's CPU step
(``bucket_size_mb`` of the bf16 copy: the issue's bound on what may stay exposed).

    python benchmarks/sim_device_share.py                 # tied and untied, 3 rounds (minutes)
    python benchmarks/sim_device_share.py --quick         # a 4-layer model, one round: the logic only
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_device import CLIP_QUIET, StepClock, quiet_fit  # noqa: E402
from sim_device_params import DEVICE_BANDWIDTH, run_child, simulate_device_steps  # noqa: E402

from lightning_zero_offload import ZeroOffloadStrategy, kernels  # noqa: E402
from lightning_zero_offload.engine.infra import memory  # noqa: E402
from lightning_zero_offload.engine.step import cpu_state, device_share, streamer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
_BACKWARD_ENDS: list[float] = []  # when each step's device backward ended (the first block's, the last to run)


class _SleepingBlock(torch.autograd.Function):
    """Identity on the activations; the block's device time asleep; a fixed gradient for each weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, block: tuple[int, float, float, float], *weights: torch.Tensor):
        ctx.block, ctx.shapes = block, [(w.shape, w.dtype) for w in weights]
        time.sleep(block[1])
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        index, _, backward_s, tied_use = ctx.block
        time.sleep(backward_s)
        # Fresh each pass, as a GPU's backward makes them: autograd then hands the tensor over instead of copying
        # it into .grad. Zeros (pages mapped only when read): the host work does not depend on the values.
        grads: list[torch.Tensor | None] = [torch.zeros(shape, dtype=dtype) for shape, dtype in ctx.shapes]
        if tied_use == "output":  # autograd holds it until the input's use adds its own, on the device
            grads[0] = None
        elif tied_use == "input":  # the sum of the two uses' gradients: a device kernel, its bytes' time
            time.sleep(3 * grads[0].nbytes / DEVICE_BANDWIDTH)  # type: ignore[union-attr]
        if index == 0:
            _BACKWARD_ENDS.append(time.perf_counter())
        return (grad_out, None, *grads)


def gpt2_shapes(n_layer: int) -> dict[str, torch.Size]:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer))
    return {name.removeprefix("transformer."): p.shape for name, p in model.named_parameters()}


class SleepingGpt2(L.LightningModule):
    """GPT-2's parameters in its registration order, its forward's blocks asleep for their device time."""

    def __init__(self, n_layer: int, tied: bool) -> None:
        super().__init__()
        shapes = gpt2_shapes(n_layer)
        self.n_layer, self.tied = n_layer, tied

        def params(prefix: str | tuple[str, ...]) -> nn.ParameterList:
            chosen = [s for name, s in shapes.items() if name.startswith(prefix)]
            return nn.ParameterList(nn.Parameter(torch.full(s, 0.01)) for s in chosen)

        self.embed = params(("wte.", "wpe."))
        self.layers = nn.ModuleList(params(f"h.{i}.") for i in range(n_layer))
        self.final = params("ln_f.")
        # a submodule, as GPT2LMHeadModel's lm_head: its parameter is listed last (a root's own would come first)
        self.head = None if tied else nn.ParameterList([nn.Parameter(torch.full(shapes["wte.weight"], 0.01))])
        # (weights, share of the backward time) per block in forward order
        head = [self.embed[0]] if tied else list(self.head)
        self.blocks = [(list(self.embed), 0.0)]
        self.blocks += [(list(layer), 1.0) for layer in self.layers]
        self.blocks += [(list(self.final), 0.0), (head, head[0].numel() / sum(p.numel() for p in self.layers[0]))]
        self.forward_s = self.backward_s = 0.0  # of one layer; the others in proportion

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch[0]
        last = len(self.blocks) - 1
        for index, (weights, share) in enumerate(self.blocks):
            tied_use = ("input" if index == 0 else "output" if index == last else None) if self.tied else None
            block = (index, share * self.forward_s, share * self.backward_s, tied_use)
            x = _SleepingBlock.apply(x, block, *weights)
        return x.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01)

    def device_time_units(self) -> float:
        """Backward time of the whole model in units of one layer's."""
        return sum(share for _, share in self.blocks)


class _DeviceBuffer(torch.Tensor):
    """A gradient bucket buffer of the simulated accelerator: what writes into it (the hooks' copies of the
    gradients, the zeroing of padding and of parameters without a gradient) is a device kernel, asleep for the bytes
    it moves; its transfer to the host takes the bytes' time at :data:`LINK_BANDWIDTH` on a copy engine, after the
    transfers queued before it, and whoever reads the host buffer waits for it (on a GPU a copy engine moves them;
    here a host copy would compete with the CPU step for two cores). Its contents stay the zeros it began with, and
    a host buffer it is copied into is zeroed once."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _DEVICE_WRITES and isinstance(args[0], cls):
            time.sleep(_DEVICE_WRITES[func] * args[0].nbytes / DEVICE_BANDWIDTH)
            return args[0]
        if func is torch.Tensor.copy_ and isinstance(args[1], cls):  # to the host, queued on the copy engine
            target = args[0]
            if _ZEROED.get(target.data_ptr(), 0) < target.numel():
                target.zero_()
                _ZEROED[target.data_ptr()] = target.numel()
            start = max(time.perf_counter(), _LINK_FREE_AT[0])
            _LINK_FREE_AT[0] = _COPIED_AT[target.data_ptr()] = start + target.nbytes / LINK_BANDWIDTH
            return target
        return super().__torch_function__(func, types, args, kwargs or {})


_DEVICE_WRITES = {torch.Tensor.copy_: 2, torch.Tensor.zero_: 1}  # bytes moved per byte written
_ZEROED: dict[int, int] = {}  # host buffers a transfer wrote into: their zeroed elements from the start
LINK_BANDWIDTH = 25e9  # bytes/s: a PCIe 4.0 x16 link's copies from the device (pinned host memory)
_LINK_FREE_AT = [0.0]  # when the copy engine has done the transfers queued so far
_COPIED_AT: dict[int, float] = {}  # a host buffer's pending transfer: when it completes


def wait_for_transfers() -> None:
    """The gradient worker waits for a bucket's transfer where a GPU's waits for its event (the hook only queued
    it, as ``non_blocking=True`` does)."""
    accumulate = streamer.GradientStreamer._accumulate

    def accumulate_once_copied(self: Any, bucket: Any, staging: torch.Tensor, *args: Any) -> None:
        copied_in = _COPIED_AT.pop(staging.data_ptr(), 0.0) - time.perf_counter()
        if copied_in > 0:
            time.sleep(copied_in)
        accumulate(self, bucket, staging, *args)

    streamer.GradientStreamer._accumulate = accumulate_once_copied  # type: ignore[method-assign]


_HOST_WORK: list[tuple[str, float, float]] = []  # (kind, start, end) of each CPU Adam and accumulate kernel


def time_host_work() -> None:
    """Record when each CPU Adam step and gradient accumulation ran (the host work after backward, apart)."""

    def timed(kind: str, kernel: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return kernel(*args, **kwargs)
            finally:
                _HOST_WORK.append((kind, start, time.perf_counter()))

        return run

    for name in ("adam_step", "adam_step_bf16_state"):
        setattr(kernels, name, timed("adam", getattr(kernels, name)))
    kernels.grad_accumulate = timed("accumulate", kernels.grad_accumulate)  # type: ignore[assignment]


def host_work_after(start: float, end: float) -> dict[str, float]:
    """Seconds of each kind of host work between ``start`` and ``end``."""
    spent = {"adam": 0.0, "accumulate": 0.0}
    for kind, a, b in _HOST_WORK:
        spent[kind] += max(0.0, min(b, end) - max(a, start))
    return spent


def simulate_device_state_work() -> None:
    """What the device does besides its blocks, as device time: the device share's gradient accumulation, its cast
    into the device parameters, the gradient buckets' fills (:class:`_DeviceBuffer`) and the checksums of the
    weights, asleep for the bytes they move (on a CPU device they are host work that a GPU runs from its own
    memory, and on 2 cores it would compete with the CPU step)."""
    storages: set[int] = set()
    allocate = cpu_state.device_zeros

    def device_zeros(numel: int, dtype: torch.dtype, device: torch.device, kind: str, ledger: Any = None):
        tensor = allocate(numel, dtype, device, kind, ledger)
        storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    def on_device(tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in storages

    accumulate = cpu_state.CpuState.accumulate_torch

    def accumulate_torch(dst: torch.Tensor, src: torch.Tensor, scale: float, overwrite: bool) -> None:
        if not on_device(dst):
            return accumulate(dst, src, scale, overwrite)
        time.sleep((2 * dst.nbytes + src.nbytes) / DEVICE_BANDWIDTH)

    copy = memory.HostToDevice.copy

    def host_to_device(self: memory.HostToDevice, target: torch.Tensor, source: torch.Tensor) -> None:
        if not on_device(source):
            return copy(self, target, source)
        time.sleep((target.nbytes + source.nbytes) / DEVICE_BANDWIDTH)

    def fingerprint16(words: torch.Tensor, *, num_threads: int | None = None) -> torch.Tensor:
        time.sleep(words.nbytes / DEVICE_BANDWIDTH)  # nothing here writes the weights: every bucket as recorded
        return torch.zeros((), dtype=torch.int64)

    acquire = memory.DeviceBufferPool.acquire

    def acquire_device_buffer(self: memory.DeviceBufferPool) -> torch.Tensor:
        buffer = acquire(self)
        return buffer if isinstance(buffer, _DeviceBuffer) else buffer.zero_().as_subclass(_DeviceBuffer)

    memory.DeviceBufferPool.acquire = acquire_device_buffer  # type: ignore[method-assign]
    kernels.fingerprint16 = fingerprint16  # type: ignore[assignment]
    cpu_state.device_zeros = device_zeros  # type: ignore[assignment]
    cpu_state.CpuState.accumulate_torch = staticmethod(accumulate_torch)  # type: ignore[method-assign]
    memory.HostToDevice.copy = host_to_device  # type: ignore[method-assign]


def pretend_device_memory() -> None:
    """``device_share="auto"`` as on an accelerator with ample free memory (on a CPU device it keeps nothing): the
    engine's own rule, from the first step's measured times and landings (engine/step/device_share.py)."""
    device_share.room_after_peak = lambda device: 2**62  # type: ignore[assignment]


def fit(n_layer: int, tied: bool, schedule: str, share: float | str, layer_s: tuple[float, float], steps: int, args):
    model = SleepingGpt2(n_layer, tied)
    model.forward_s, model.backward_s = layer_s
    clock = StepClock()
    strategy = ZeroOffloadStrategy(
        cpu_step=schedule, overlap=True, device_share=share, cpu_threads=args.cpu_threads, metrics=False
    )
    data = DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1)
    trainer = quiet_fit(model, data, strategy, steps, CLIP_QUIET, [clock])
    engine = trainer.strategy.engine
    info = {"bucket_numel": engine.options.bucket_numel(2), "share_params": engine.state.device_share_numel}
    if engine.share_choice is not None:
        info["auto"] = {"share": engine.share_choice.share, "why": engine.share_choice.why}
    after = [host_work_after(backward, end) for backward, end in zip(_BACKWARD_ENDS, clock.ends)]
    return {
        "ends": clock.ends,
        "backward_ends": list(_BACKWARD_ENDS),
        "host_work_after_backward": after,
        "stats": clock.stats,
        "info": info,
    }


def fit_in_a_fresh_process(n_layer: int, tied: bool, schedule: str, share: float, layer_s, steps: int, args):
    """:func:`fit` in a fresh interpreter (``--fit``), its result through a file."""
    job = {"n_layer": n_layer, "tied": tied, "schedule": schedule, "share": share, "layer_s": layer_s, "steps": steps}
    return run_child(__file__, job, str(job))


def one_fit(args: argparse.Namespace) -> None:
    """The child of :func:`fit_in_a_fresh_process`."""
    job = json.loads(args.fit)
    simulate_device_steps()
    simulate_device_state_work()
    wait_for_transfers()
    time_host_work()
    pretend_device_memory()
    result = fit(job["n_layer"], job["tied"], job["schedule"], job["share"], tuple(job["layer_s"]), job["steps"], args)
    Path(args.fit_out).write_text(json.dumps(result))


def summarize(runs: list[dict[str, Any]], warmup: int, device_ms: float, cpu_ms_per_param: float):
    times, rows, fit_medians, tails, work = [], [], [], [], []
    for run in runs:
        fit_times = [b - a for a, b in zip(run["ends"][warmup:], run["ends"][warmup + 1 :])]
        times += fit_times
        fit_medians.append(1e3 * statistics.median(fit_times))
        rows += run["stats"][warmup + 1 :]
        tails += [end - backward for backward, end in zip(run["backward_ends"], run["ends"])][warmup + 1 :]
        work += run["host_work_after_backward"][warmup + 1 :]
    info = runs[0]["info"]
    out: dict[str, Any] = {"step_ms": 1e3 * statistics.median(times), "fit_median_step_ms": fit_medians}
    out["exposed_ms"] = out["step_ms"] - device_ms
    # from the device's backward end to the step's end: what no backward hid (the last buckets' transfer and
    # step, the validation, the copy-back)
    out["after_backward_ms"] = 1e3 * statistics.median(tails)
    # of which the host's CPU Adam and gradient accumulation (the rest: hooks, the transfers' wait, the step's tail)
    out["adam_after_backward_ms"] = 1e3 * statistics.median(w["adam"] for w in work)
    out["accumulate_after_backward_ms"] = 1e3 * statistics.median(w["accumulate"] for w in work)
    out["engine_step_ms"] = 1e3 * statistics.median(r["total_s"] for r in rows)  # the engine's step() alone
    out["cpu_step_ms"] = 1e3 * statistics.median(r["cpu_step_s"] for r in rows)
    out["speculated_fraction"] = statistics.median(r["speculated_fraction"] for r in rows)
    out["share_params"] = info["share_params"]
    out["one_bucket_step_ms"] = cpu_ms_per_param * info["bucket_numel"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 4-layer model, one round: the logic only")
    parser.add_argument("--layers", type=int, default=None, help="GPT-2 layers (default 12, quick: 4)")
    parser.add_argument("--ratio", type=float, default=1.0, help="backward time / CPU step time of the model")
    parser.add_argument("--forward-ratio", type=float, default=0.5, help="forward time / backward time")
    parser.add_argument("--rounds", type=int, default=None, help="fits per configuration (default 3, quick: 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per fit (default 8, quick: 3)")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured steps at the start of each fit")
    parser.add_argument("--cpu-threads", type=int, default=None, help="CPU Adam threads (default: usable cores)")
    parser.add_argument("--models", choices=("both", "tied", "untied"), default="both", help="which GPT-2 embeddings")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sim_device_share.json"))
    parser.add_argument("--fit", help=argparse.SUPPRESS)  # the child's job (fit_in_a_fresh_process)
    parser.add_argument("--fit-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.cpu_threads = args.cpu_threads or len(os.sched_getaffinity(0))
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if args.fit:
        one_fit(args)
        return
    n_layer = args.layers or (4 if args.quick else 12)
    rounds = args.rounds or (1 if args.quick else 3)
    steps = args.warmup + 1 + (args.steps or (3 if args.quick else 8))

    # The CPU step of this machine with no device time (untied: the larger model), the unit of the device time.
    calibration = fit_in_a_fresh_process(n_layer, False, "sync", 0.0, (0.0, 0.0), steps, args)
    cpu_ms = 1e3 * statistics.median(r["cpu_step_s"] for r in calibration["stats"][args.warmup + 1 :])
    params = sum(p.numel() for p in SleepingGpt2(n_layer, False).parameters())
    backend = kernels.backend()
    print(f"GPT-2 shapes, {n_layer} layers, untied {params / 1e6:.1f}M params: CPU step {cpu_ms:.1f} ms ({backend})")

    models = []
    for tied in {"both": (True, False), "tied": (True,), "untied": (False,)}[args.models]:
        model = SleepingGpt2(n_layer, tied)
        n = sum(p.numel() for p in model.parameters())
        layer_backward_s = args.ratio * cpu_ms * (n / params) / 1e3 / model.device_time_units()
        layer_s = (args.forward_ratio * layer_backward_s, layer_backward_s)
        device_ms = 1e3 * sum(layer_s) * model.device_time_units()
        # "auto" first: the sync rows take the share it chose (each round's first fit; the same every round here)
        runs: dict[tuple[str, float | str], list] = {("speculative", "auto"): []}
        for _ in range(rounds):
            auto = fit_in_a_fresh_process(n_layer, tied, "speculative", "auto", layer_s, steps, args)
            runs["speculative", "auto"].append(auto)
            share = auto["info"]["auto"]["share"]
            for schedule, fraction in (("sync", 0.0), ("sync", share), ("speculative", 0.0)):
                result = fit_in_a_fresh_process(n_layer, tied, schedule, fraction, layer_s, steps, args)
                runs.setdefault((schedule, fraction), []).append(result)
        per_param = cpu_ms / params
        results = {
            f"{s}, share {f if f == 'auto' else f'{f:.3f}'}": summarize(r, args.warmup, device_ms, per_param)
            for (s, f), r in runs.items()
        }
        base = results["sync, share 0.000"]["step_ms"]
        for r in results.values():
            r["speedup_vs_sync_no_share"] = base / r["step_ms"]
        chosen = [run["info"]["auto"] for run in runs["speculative", "auto"]]
        results["speculative, share auto"]["speedup_vs_sync_same_share"] = (
            results[f"sync, share {share:.3f}"]["step_ms"] / results["speculative, share auto"]["step_ms"]
        )
        models.append({"tied": tied, "params": n, "device_ms": device_ms, "auto": chosen, "results": results})
        print(f"\n{'tied' if tied else 'untied'}: {n / 1e6:.1f}M params, device time {device_ms:.1f} ms a step")
        shares = ", ".join(f"{c['share']:.3f}" for c in chosen)
        print(f"  {chosen[-1]['why']} (share {shares}, a round each)")
        for name, r in results.items():
            spread = "/".join(f"{t:.0f}" for t in r["fit_median_step_ms"])
            print(
                f"  {name:<26} step {r['step_ms']:7.1f} ms (fits {spread})  exposed {r['exposed_ms']:6.1f} ms  "
                f"after backward {r['after_backward_ms']:6.1f} ms (Adam {r['adam_after_backward_ms']:5.1f}, accumulate "
                f"{r['accumulate_after_backward_ms']:4.1f}; a bucket's step {r['one_bucket_step_ms']:4.1f} ms)"
                f"  x{r['speedup_vs_sync_no_share']:.2f} vs sync"
            )

    out = {
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_average_1_5_15min_at_end": os.getloadavg(),
        },
        "command": " ".join(["python", *sys.argv]),
        "kernel_backend": kernels.backend(),
        "cpu_threads": args.cpu_threads,
        "device_bandwidth": DEVICE_BANDWIDTH,
        "calibration_cpu_step_ms": cpu_ms,
        "backward_over_cpu_step": args.ratio,
        "rounds": rounds,
        "measured_steps_per_fit": steps - args.warmup - 1,
        "models": models,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
