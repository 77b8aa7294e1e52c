"""The first-GPU check, in sub-checks with time budgets; run by ``benchmarks/gpu_check.sh`` (read that first).

Order = priority: what matters most runs first, and every sub-check leaves its result on disk the moment
it ends (``<results>/summary.json`` is rewritten after each one). (1) ``env``, ``micro``: versions,
host<->device bandwidth pinned and pageable both ways, the CPU-Adam kernel at cores / cores-2 / cores-4
threads; (2) ``cuda_tests``: tests/cuda; (3) ``correctness``: zero_offload's default schedule against
plain bf16 AMP AdamW through the Trainer, 30 steps, ``offload_params``: the parameter-offload mode's
tokens/s and peak device memory against the ZeRO-2 mode's on a 100M-parameter GPT, and the device share
(``device_step``, ``zero2_share``, ``zero2_share_start``); (4) ``throughput``:
train_step.py on a 1.26B Llama at 16k tokens per step, one process per variant, rows in
``<results>/throughput.json`` as each variant ends; (5) the engine-level checks (sanitizer, determinism,
fit/resume, ...) while time remains.

Each sub-check runs in its own process session with a hard timeout: min(its budget, the time left before
the global ``--deadline``), so the whole run ends in time by construction; on a timeout the whole session
(children and their ranks too) is killed and checked gone, and whatever the sub-check had written to
``<results>/<name>.json`` is kept as its partial result. Output goes to ``<results>/log.txt``. On a
machine without CUDA it says so and exits 2, unless ``--device cpu`` is given: then every check runs at
toy sizes on the CPU (a dry run of the logic; timing and memory targets are not judged there).

    python benchmarks/gpu_check.py --results /tmp/gpu              # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu --results /tmp/dry  # CPU dry run of the sub-checks
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time at ~2 GHz, per delayed copy
DEADLINE = float("inf")  # this sub-check's own end (time.time()), set by --run from the driver's timeout


def time_left(reserve: float = 2.0) -> float:
    return DEADLINE - time.time() - reserve


def usable_cores() -> int:
    from lightning_zero_offload import kernels  # built by gpu_check.sh before any sub-check runs

    return kernels.usable_cores()


def save_partial(results: Path, name: str, data: dict[str, Any]) -> None:
    """``<results>/<name>.json``, atomically: what a sub-check has so far, kept if it is killed later."""
    tmp = results / f".{name}.json.part"
    tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(results / f"{name}.json")


# -- shared engine-level helpers ---------------------------------------------------------------------


def gpt(device: torch.device, tiny: bool, **size: int) -> nn.Module:
    from lightning_zero_offload.demo.model import GPT

    torch.manual_seed(0)
    dims = {"n_layer": 2, "n_embd": 64, "n_head": 2} if tiny else {"n_layer": 4, "n_embd": 512, "n_head": 8}
    return GPT(block_size=256, **{**dims, **size}).to(device)


def engine_for(model: nn.Module, device: torch.device, dtype: torch.dtype, **options: Any) -> Any:
    from lightning_zero_offload.core import make_offload_options
    from lightning_zero_offload.engine import OffloadEngine

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return OffloadEngine(optimizer, device, dtype, make_offload_options(**options))


def batches(device: torch.device, tiny: bool, n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 33) if tiny else (8, 257)
    return [torch.randint(0, 256, shape, generator=g).to(device) for _ in range(n)]


def step(model: nn.Module, engine: Any, tokens: torch.Tensor) -> Any:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    # As the strategy does (no hook reads the weights before the step): without it the speculative
    # schedule (the GPU default) runs as sync.
    engine.expect_step(publish_early=True)
    engine.begin_backward()
    engine.scale_loss(loss).backward()
    engine.finish_backward()
    return engine.step()


def master(engine: Any) -> torch.Tensor:
    engine.sync()
    return torch.cat([t.detach().float().flatten().cpu() for t in engine.master_params()])


def record_reads(model: nn.Module) -> list[torch.Tensor]:
    """A forward pre-hook that checksums, on the device and in stream order, every parameter forward reads."""
    reads: list[torch.Tensor] = []
    params = list(model.parameters())
    model.register_forward_pre_hook(lambda *_: reads.append(torch.stack([p.float().sum() for p in params])))
    return reads


@contextlib.contextmanager
def delayed_copies(cycles: int):
    """Hold every asynchronous host<->device copy ``cycles`` GPU cycles on its stream before it starts.

    Covers the gradient transfers (side stream) and the copy-backs wherever the engine issues them. A copy
    whose source or destination is reused too early then reads or lands at the wrong time, so results
    change; correct code gives bitwise the same results. No-op on the CPU.
    """
    if not torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.copy_

    def slow_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if non_blocking and self.device != src.device:
            torch.cuda._sleep(cycles)
        return original(self, src, non_blocking)

    torch.Tensor.copy_ = slow_copy  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.copy_ = original  # type: ignore[method-assign]


def quiet_trainer(device: torch.device, strategy: Any, callbacks: list[Any], **limits: Any) -> Any:
    """A one-device bf16-mixed Trainer that logs, saves and prints nothing of its own (``limits``: ``max_steps``
    or ``max_epochs``, and ``enable_checkpointing=True`` for a check that keeps checkpoints)."""
    import lightning as L

    settings = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    return L.Trainer(
        accelerator=device.type,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        enable_model_summary=False,
        callbacks=callbacks,
        **{**settings, **limits},
    )


def train(device: torch.device, tiny: bool, steps: int = 5, sleep: int = 0, **options: Any) -> dict[str, Any]:
    model = gpt(device, tiny)
    dtype = options.pop("dtype", torch.bfloat16)
    engine = engine_for(model, device, dtype, **options)
    reads = record_reads(model)
    with delayed_copies(sleep) if sleep else contextlib.nullcontext():
        stats = [step(model, engine, tokens) for tokens in batches(device, tiny, steps)]
        final = master(engine)
    out = {"master": final, "reads": torch.stack(reads).cpu(), "stats": stats, "engine": engine}
    engine.close()
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["master"], b["master"]) and torch.equal(a["reads"], b["reads"])


# -- sub-checks: each returns a JSON-able dict with "ok" -------------------------------------------------


def check_env(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """Versions from package metadata: importing deepspeed/torchao/transformers cold takes tens of seconds
    (more while DeepSpeed's JIT build runs beside), and whether they import is what the later checks find."""
    import psutil

    from lightning_zero_offload import kernels

    found = {}
    for name in ("deepspeed", "torchao", "cffi", "transformers", "lightning"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "missing"
    openmp = kernels.has_openmp()
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "kernels": kernels.backend()}
    info |= {"kernels_openmp": openmp, **found, "cpu_cores_usable": usable_cores(), "cpu_count": os.cpu_count()}
    info["host_memory_gib"] = psutil.virtual_memory().total / 2**30
    from cpu_adam import cpu_model  # the one /proc/cpuinfo reader of the benchmarks

    info["cpu"] = cpu_model()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
        info["gpus"] = torch.cuda.device_count()
    setup = os.environ.get("GPU_CHECK_SETUP_ERRORS", "")
    info["setup_errors"] = [e for e in setup.split(";") if e.strip()]
    native = kernels.backend() != "torch" and openmp
    return {"ok": (native or device.type == "cpu") and not info["setup_errors"], **info}


def bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> dict[str, float]:
    """GB/s of one ``nbytes`` copy, host->device and device->host, from pinned and from pageable memory."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for pinned in (True, False):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)  # fault the pages in: the first copy should not time page faults
        for direction in ("h2d", "d2h"):
            times = []
            for _ in range(reps + 1):  # the first one warms up the copy engines and the driver's staging
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                (dev.copy_(host, non_blocking=pinned) if direction == "h2d" else host.copy_(dev, non_blocking=pinned))
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            out[f"{direction}_{'pinned' if pinned else 'pageable'}"] = nbytes / statistics.median(times[1:]) / 1e9
        del host
    return out


def micro_thread_counts(tiny: bool) -> list[int]:
    """cores, cores - 2 (the launch and autograd threads need a core each) and, on the GPU box, cores - 4."""
    cores = usable_cores()
    return list(dict.fromkeys([cores, max(1, cores - 2)] + ([] if tiny else [max(1, cores - 4)])))


def check_micro(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """Host<->device bandwidth (pinned and pageable, both ways) and the fused CPU-Adam step per thread count,
    alone and beside 2 spinning processes (the launch and autograd threads' stand-ins); each part is
    saved to ``micro.json`` as it ends. The engine's real thread mix is measured in ``throughput``."""
    from cpu_adam import thread_rows

    out: dict[str, Any] = {}
    if device.type == "cuda":
        out["bandwidth_gb_per_s"] = bandwidth(device, 512 << 20)
        save_partial(results, "micro", out)
    n, reps = (1 << 20, 5) if tiny else (1 << 25, 15)  # 2^25: 0.9 GB of Adam traffic per step, far beyond L3
    out["cpu_adam"] = []
    for busy in (0, 2):
        out["cpu_adam"].append(thread_rows(micro_thread_counts(tiny), n, reps, busy))
        save_partial(results, "micro", out)
    # the fastest count alone and beside busy threads: the number the default thread count is chosen on
    out["fastest_threads"] = {
        f"busy={row['busy']}": min(row["threads"], key=lambda t: row["offload_time_vs_first"][t])
        for row in out["cpu_adam"]
    }
    bw = out.get("bandwidth_gb_per_s", {})
    # physics: page-locked copies are what DMA engines do directly; pageable ones go through a bounce buffer
    # (10% for noise: on some hosts the two are close)
    pinned_faster = all(bw[f"{d}_pinned"] >= 0.9 * bw[f"{d}_pageable"] for d in ("h2d", "d2h")) if bw else None
    return {"ok": pinned_faster is not False, "pinned_at_least_pageable": pinned_faster, **out}


PYTEST = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]


def check_cuda_tests(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """tests/cuda (skipped without CUDA), its output straight into pytest.txt, so a timeout keeps what ran. Not its
    sanitizer test (a fresh process under TORCH_CUDA_SANITIZER, tens of seconds): the sanitizer sub-check runs it."""
    path = results / "pytest.txt"
    command = [*PYTEST, str(ROOT / "tests" / "cuda"), "-k", f"not {SANITIZER_TEST}"]
    with open(path, "w") as out:
        rc, left = run_in_group(command, time_left(), out)
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return {"ok": rc in (0, 5) and not left, "returncode": rc, "summary": lines[-1] if lines else "", "left": left}


def learnable_tokens(count: int, length: int, vocab: int = 256) -> torch.Tensor:
    """Sequences a model can learn within a few steps: each token is the previous one plus 1 or 2, mod vocab."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (count, 1), generator=g)
    return (start + torch.randint(1, 3, (count, length), generator=g).cumsum(1)) % vocab


def check_correctness(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """zero_offload with its defaults (speculative on a GPU) against plain bf16 AMP AdamW, through the Trainer.

    Same weights, batches and 30 steps. Under AMP the weights are fp32, under zero_offload bf16 on the
    device, so the losses differ by weight rounding only: within 2% step by step (tests/trainer/test_models.py's
    bound), and both learn the same amount (the data is learnable, the lr high enough to show it).
    """
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from train_step import LM, PRESETS

    spec = PRESETS["quick" if tiny else "gpt-19m"]
    steps = 30
    data = TensorDataset(learnable_tokens(steps * spec["batch"], spec["seq"] + 1))

    class Module(LM):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)  # torch's default AdamW (foreach on CUDA)

    class Watch(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.engine: dict[str, Any] = {}

        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
        ) -> None:
            self.losses.append(float(outputs["loss"]))
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                speculated = max(self.engine.get("speculated_fraction_max", 0.0), engine.last.speculated_fraction)
                rolled = self.engine.get("rolled_back_steps", 0) + int(engine.last.rolled_back)
                self.engine = {"cpu_step": engine.cpu_step, "speculated_fraction_max": speculated}
                self.engine["rolled_back_steps"] = rolled

    def fit(strategy: Any) -> tuple[Watch, torch.Tensor]:
        module, watch = Module(spec, "adamw", device), Watch()
        trainer = quiet_trainer(device, strategy, [watch], max_steps=steps)
        trainer.fit(module, DataLoader(data, batch_size=spec["batch"]))
        return watch, torch.cat([p.detach().float().flatten().cpu() for p in module.parameters()])

    start = torch.cat([p.detach().float().flatten().cpu() for p in Module(spec, "adamw", device).parameters()])
    plain, plain_w = fit("auto")
    ours, ours_w = fit("zero_offload")
    rel = [abs(a - b) / abs(b) for a, b in zip(ours.losses, plain.losses)]
    drop_plain = statistics.mean(plain.losses[:3]) - statistics.mean(plain.losses[-3:])
    drop_ours = statistics.mean(ours.losses[:3]) - statistics.mean(ours.losses[-3:])
    speculative = device.type != "cuda" or (
        ours.engine.get("cpu_step") == "speculative" and ours.engine.get("speculated_fraction_max", 0) > 0
    )
    learned = drop_plain > 0.05 and 0.8 <= drop_ours / drop_plain <= 1.25
    return {
        "ok": len(rel) == steps and max(rel) <= 0.02 and learned and speculative,
        "steps": len(rel),
        "max_relative_loss_difference": max(rel),
        "loss_drop": {"plain": drop_plain, "zero_offload": drop_ours},
        "losses": {"plain": plain.losses, "zero_offload": ours.losses},
        "weights_distance_over_update": float((ours_w - plain_w).norm() / (plain_w - start).norm()),
        "engine": ours.engine,
    }


def offload_params_spec(tiny: bool) -> dict[str, Any]:
    """train_step's GPT with small activations (batch 2 x 256): its weights, not its activations, decide
    which mode holds more on the device (about 100M parameters: 200 MB of bf16 weights under ZeRO-2)."""
    if tiny:
        return {"model": "gpt", "config": {"n_layer": 2, "n_embd": 64, "n_head": 2}, "batch": 2, "seq": 32}
    return {"model": "gpt", "config": {"n_layer": 8, "n_embd": 1024, "n_head": 16}, "batch": 2, "seq": 256}


OFFLOAD_PARAMS_VARIANTS = {  # name: ZeroOffloadStrategy options (each mode's defaults otherwise)
    "zero2": {},
    "offload_params": {"offload_params": True},
    "offload_params, speculative": {"offload_params": True, "cpu_step": "speculative"},  # faster than the default?
    "offload_params, bf16 state": {"offload_params": True, "cpu_state": "bf16"},
    # the device share: "auto" with the speculative step (the last unit at least), and half the model
    "offload_params, speculative, device_share auto": {
        "offload_params": True,
        "cpu_step": "speculative",
        "device_share": "auto",
    },
    "offload_params, bf16 state, device_share 0.5": {"offload_params": True, "cpu_state": "bf16", "device_share": 0.5},
}


def check_offload_params(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """The parameter-offload mode against the ZeRO-2 mode through the Trainer, same model and batches, each
    with its defaults (on a GPU: speculative, overlapped): tokens/s and peak device memory over the measured
    steps; ``offload_params.json`` is rewritten as each variant ends. The parameter-offload mode holds only
    the blocks in flight on the device (ZeRO-2 holds every bf16 weight), so its peak must be the lower one;
    its speed is reported (it moves the weights over PCIe twice a step), not judged; the default
    (sync) and speculative side by side say which schedule is the faster on a GPU."""
    import lightning as L
    from torch.utils.data import DataLoader
    from train_step import LM, token_data

    from lightning_zero_offload import ZeroOffloadStrategy
    from lightning_zero_offload.core import release_process_group

    spec = offload_params_spec(tiny)
    warmup, steps = (1, 2) if tiny else (3, 8)
    cuda = device.type == "cuda"

    class Clock(L.Callback):
        reads_weights_before_step = False  # no hook before the step: the speculative step runs in backward

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.speculated: list[float] = []

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if cuda:
                torch.cuda.synchronize(device)
                if len(self.starts) == warmup:  # setup's peak (the model built whole) is not training's
                    torch.cuda.reset_peak_memory_stats(device)
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            self.speculated.append(trainer.strategy.last_step_stats.speculated_fraction)

    out: dict[str, Any] = {"spec": spec, "warmup": warmup, "steps": steps, "rows": {}}
    for name, options in OFFLOAD_PARAMS_VARIANTS.items():
        clock = Clock()
        module = LM(spec, "adamw")  # on the host: each mode takes the weights where it keeps them
        out["params"] = sum(p.numel() for p in module.parameters())
        strategy = ZeroOffloadStrategy(metrics=False, **options)
        trainer = quiet_trainer(device, strategy, [clock], max_steps=warmup + steps + 1)
        trainer.fit(module, DataLoader(token_data(spec, warmup + steps + 1), batch_size=spec["batch"]))
        step_s = statistics.median(b - a for a, b in zip(clock.starts[warmup:], clock.starts[warmup + 1 :]))
        row = {"step_ms": 1e3 * step_s, "tokens_per_s": spec["batch"] * spec["seq"] / step_s}
        row["cpu_step"] = trainer.strategy.session.resolved.cpu_step
        row["speculated_fraction_max"] = max(clock.speculated[warmup:])
        if options.get("offload_params"):
            held = trainer.strategy.session.engine.memory_report()
            row["device_share_params"] = held["device_share_params"]
            choice = trainer.strategy.session.share_choice
            row["device_share_why"] = choice.why if choice is not None else ""
        if cuda:
            row["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
            row["peak_device_bytes_per_param"] = row["peak_device_bytes"] / out["params"]
        out["rows"][name] = row
        del trainer, module
        if options.get("offload_params"):
            release_process_group()  # the one-process group FSDP2 needed: the next fit starts its own
        save_partial(results, "offload_params", out)
    rows = out["rows"]
    base = rows["zero2"]
    for row in rows.values():
        row["tokens_per_s_vs_zero2"] = row["tokens_per_s"] / base["tokens_per_s"]
    verdicts = {"every_variant_ran": len(rows) == len(OFFLOAD_PARAMS_VARIANTS)}
    if cuda:
        for name in ("offload_params", "offload_params, bf16 state"):
            verdicts[f"{name} peak device memory below zero2's"] = (
                rows[name]["peak_device_bytes"] < base["peak_device_bytes"]
            )
        # each shard's step starts in FSDP2's gradient hook, during backward
        verdicts["offload_params, speculative speculates in backward"] = (
            rows["offload_params, speculative"]["speculated_fraction_max"] > 0
        )
        # "auto" with the speculative step keeps at least the last unit on the device; half the model there
        # holds its bf16 state (8 B/param) on the device beside the blocks in flight
        verdicts["device_share auto keeps a unit on the device"] = (
            rows["offload_params, speculative, device_share auto"]["device_share_params"] > 0
        )
        half = rows["offload_params, bf16 state, device_share 0.5"]
        verdicts["device_share 0.5 holds its state on the device"] = (
            half["peak_device_bytes"]
            >= rows["offload_params, bf16 state"]["peak_device_bytes"] + 6 * half["device_share_params"]
        )
    out["verdicts"] = verdicts
    save_partial(results, "offload_params", out)
    return {"ok": all(verdicts.values()), **out}


def check_device_step(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """The device share's step (kernels/device.py) on the device against the native CPU kernels on the same
    numbers: bf16 state bitwise (the same widened arithmetic, hash and rounding, in float64 on the GPU, in the pass
    torch.compile fuses: the Triton code here, the CPU's inductor code in the tests), fp32 state within the
    kernels' rounding; its time per step of 100M parameters (the planner leaves it out), the fused bf16 pass's
    first call (compiling) and the unfused pass's time beside the fused one's; last (a second compile, so that
    running out of time loses only this), the compiled update's fp32 values before the stochastic rounding against
    the CPU's eager ones, bit for bit."""
    from lightning_zero_offload import kernels
    from lightning_zero_offload.kernels import device as on_device
    from lightning_zero_offload.kernels import reference
    from lightning_zero_offload.kernels.arguments import FlatAdamCall

    n = 2**12 + 5 if tiny else 2**22 + 5
    hparams = kernels.AdamArgs(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=True)
    out: dict[str, Any] = {"numel": n}
    gen = torch.Generator().manual_seed(0)
    state = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.01, torch.rand(n, generator=gen) * 1e-4]
    # gradients over six orders of magnitude, so eps and the square root both matter
    grads = [torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 3, (n,), generator=gen) for _ in range(3)]
    for dtype in (torch.bfloat16, torch.float32):
        host = [t.to(dtype) for t in state]
        there = [t.to(device) for t in host]
        for step, grad in enumerate(grads, start=1):
            g = grad.bfloat16()
            common = {"hparams": hparams, "grad_scale": 0.5}
            if dtype == torch.bfloat16:
                rounding = {"step": step, "seed": 7, "offset": 3, **common}
                kernels.adam_step_bf16_state(host[0], g, host[1], host[2], **rounding)
                start = time.perf_counter()
                on_device.adam_step_bf16_state(there[0], g.to(device), there[1], there[2], **rounding)
                if step == 1:  # on a GPU the pass compiles here
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    out["bf16_first_call_s"] = time.perf_counter() - start
            else:
                kernels.adam_step_multi([host[0]], [g], [host[1]], [host[2]], [step], **common)
                on_device.adam_step_multi([there[0]], [g.to(device)], [there[1]], [there[2]], [step], **common)
        got = [t.cpu() for t in there]
        if dtype == torch.bfloat16:
            same = [torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, host)]
            out["bf16_state_bitwise"] = all(same)
        else:
            out["fp32_max_abs_diff"] = float((got[0] - host[0]).abs().max())
            out["fp32_within_rounding"] = bool(torch.allclose(got[0], host[0], rtol=3 * 2**-23, atol=3 * 1e-2 * 2**-21))
    out["bf16_fused"] = on_device.FUSED_PASS.failure is None or on_device.FUSED_PASS.failure
    save_partial(results, "device_step", out)
    sizes = 100_000_000 if not tiny else 2**12

    def unfused(p, g, m, v, step):  # what runs where torch.compile fails
        call = FlatAdamCall(hparams, p, g, m, v, step, 1.0, 1, 7, 0)
        reference.bf16_state_step(call, on_device.BF16_STATE_CHUNK, reference.bf16_state_pass)

    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.bfloat16, "bf16_unfused")):
        p, m, v = (torch.zeros(sizes, dtype=dtype, device=device) for _ in range(3))
        g = torch.zeros(sizes, dtype=torch.bfloat16, device=device)
        times = []
        for step in range(1, 4):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            if dtype == torch.float32:
                on_device.adam_step_multi([p], [g], [m], [v], [step], hparams=hparams)
            elif name == "bf16":
                on_device.adam_step_bf16_state(p, g, m, v, hparams=hparams, step=step, seed=7)
            else:
                unfused(p, g, m, v, step)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        out[f"{name}_step_ms_per_100M_params"] = 1e3 * min(times[1:]) * 100_000_000 / sizes
        del p, m, v, g
        save_partial(results, "device_step", out)

    # The compiled update's fp32 values before the stochastic rounding, which hides an ulp in all but about 1 in
    # 65536 elements: against the CPU's eager ones bit for bit, subnormals included (v of tiny gradients).
    def before_rounding(p, g, m, v, constants):
        return tuple(x.float() for x in reference.update_values(constants, *(t.double() for t in (p, g, m, v))))

    p_, m_, v_, g_ = [t.bfloat16() for t in state] + [grads[0].bfloat16()]
    g_[: n // 8] *= 1e-19
    v_[: n // 8] = 0.0
    differing = {}
    for adamw_mode in (True, False):
        rule = kernels.AdamArgs(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, adamw_mode=adamw_mode)
        constants = torch.tensor(reference.update_constants(rule, 3, 0.5), dtype=torch.float64)
        eager = before_rounding(p_, g_, m_, v_, constants)
        compiled = torch.compile(before_rounding, **on_device.COMPILE_OPTIONS)(
            *(t.to(device) for t in (p_, g_, m_, v_, constants))
        )
        name = "adamw" if adamw_mode else "adam_l2"
        differing[name] = [
            int((a.view(torch.int32) != b.cpu().view(torch.int32)).sum()) for a, b in zip(eager, compiled)
        ]
    out["bf16_update_values_differing"] = differing  # p, m, v per rule
    out["bf16_update_values_bitwise"] = not any(any(counts) for counts in differing.values())
    save_partial(results, "device_step", out)
    fused = out["bf16_fused"] is True and out["bf16_update_values_bitwise"]
    return {"ok": out["bf16_state_bitwise"] and out["fp32_within_rounding"] and fused, **out}


def check_zero2_share(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """The ZeRO-2 mode's device share on the GPU (the last buckets' state and step there): the same training as
    without it (bf16 state bitwise, fp32 within rounding), sync and speculative; its device bytes; and what
    device_share="auto" chooses after the second step on this GPU, and why."""
    out: dict[str, Any] = {}
    ok = True
    buckets = {"bucket_size_mb": 0.05 if tiny else 4.0}  # several buckets on each side
    for cpu_state in ("bf16", "fp32"):
        for schedule in ("sync", "speculative"):
            base = train(device, tiny, cpu_state=cpu_state, cpu_step=schedule, **buckets)
            shared = train(device, tiny, cpu_state=cpu_state, cpu_step=schedule, device_share=0.5, **buckets)
            report = shared["engine"].memory_report()
            if cpu_state == "bf16":
                agree = torch.equal(base["master"], shared["master"])
            else:
                agree = bool(torch.allclose(shared["master"], base["master"], rtol=1e-5, atol=1e-7))
            diff = float((shared["master"] - base["master"]).abs().max())
            key = f"{cpu_state},{schedule}"
            out[key] = {"agrees": agree, "max_abs_diff": diff, "device_state_bytes": report["device_state_bytes"]}
            out[key]["device_share_params"] = report["device_share_params"]
            ok = ok and agree and report["device_share_params"] > 0
    auto = train(device, tiny, cpu_step="speculative", device_share="auto")
    choice = auto["engine"].share_choice
    out["auto"] = {"share": choice.share, "params": choice.params, "why": choice.why} if choice else None
    save_partial(results, "zero2_share", out)
    return {"ok": ok and choice is not None, **out}


def check_zero2_share_start(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """The ZeRO-2 mode's ``device_share="auto"`` on a host pretended short (85% of the least memory with which the
    run fits without a share, found by the pre-flight itself): the pre-flight starts the engine with the smallest
    share the host needs, this GPU's free memory probed, and the run trains as one without a share (bf16 state:
    bitwise). Mid-fit a full save (the share's buckets copied from the GPU one run at a time) and, with
    ``device_share=0.5``, a sharded one (a buffer's device part at a time): each file holds the engine's weights.
    On a CPU device (the dry run) the host is not pretended short: its memory is the device's."""
    from dataclasses import replace

    import lightning as L
    from torch.utils.data import DataLoader
    from train_step import LM, PRESETS, token_data

    from lightning_zero_offload import ZeroOffloadStrategy
    from lightning_zero_offload.checkpoints.export import convert_checkpoint_to_fp32_state_dict
    from lightning_zero_offload.core import session
    from lightning_zero_offload.planner.machine import probes

    spec, steps, save_at = PRESETS["quick"], 6, 3
    real_check, real_limit = session.check_host_memory, probes.host_memory_limit
    started: dict[str, Any] = {}

    def short_host(module: nn.Module, options: Any, *args: Any, **kwargs: Any) -> Any:
        if options.device_share != "auto" or device.type == "cpu":
            return real_check(module, options, *args, **kwargs)

        def fits(available: int) -> bool:
            probes.host_memory_limit = lambda *_, **__: (available, "pretended")
            try:
                real_check(module, replace(options, device_share=0.0), *args, **kwargs)
                return True
            except MemoryError:
                return False

        low, high = 1, real_limit()[0]
        try:
            while high - low > max(1, low // 200):
                mid = (low + high) // 2
                low, high = (low, mid) if fits(mid) else (mid, high)
            started["fits_without_share_bytes"] = high
            probes.host_memory_limit = lambda *_, **__: (int(0.85 * high), "pretended")
            start = real_check(module, options, *args, **kwargs)
        finally:
            probes.host_memory_limit = real_limit
        started["start"] = None if start is None else {"share": start.share, "why": start.why}
        return start

    class SaveMidFit(L.Callback):
        def __init__(self, path: Path) -> None:
            self.path, self.master = path, None

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == save_at and self.master is None:
                trainer.save_checkpoint(self.path)
                session_ = trainer.strategy.session
                keys = [keys[0] for keys in session_.param_keys]
                self.master = dict(zip(keys, (m.float().cpu() for m in session_.engine.master_params())))
                self.share_params = session_.engine.memory_report()["device_share_params"]

    def fit(tmp: str, name: str, **options: Any) -> dict[str, Any]:
        saves = SaveMidFit(Path(tmp) / name)
        module = LM(spec, "adamw")
        strategy = ZeroOffloadStrategy(metrics=False, cpu_state="bf16", cpu_step="sync", bucket_size_mb=0.05, **options)
        trainer = quiet_trainer(device, strategy, [saves], max_steps=steps)
        trainer.fit(module, DataLoader(token_data(spec, steps), batch_size=spec["batch"]))
        exported = convert_checkpoint_to_fp32_state_dict(saves.path)
        file_holds = all(torch.equal(exported[k].float(), m) for k, m in (saves.master or {}).items())
        weights = torch.cat([p.detach().float().flatten().cpu() for p in module.parameters()])
        return {"weights": weights, "file_holds_engine": file_holds, "share_params_at_save": saves.share_params}

    session.check_host_memory = short_host
    try:
        with tempfile.TemporaryDirectory() as tmp:
            base = fit(tmp, "base.ckpt")
            auto = fit(tmp, "auto.ckpt", device_share="auto")
            sharded = fit(tmp, "sharded", device_share=0.5, checkpoint_format="sharded")
    finally:
        session.check_host_memory = real_check
    out: dict[str, Any] = {**started}
    for name, run in (("auto, full save", auto), ("0.5, sharded save", sharded)):
        out[name] = {
            "bitwise_as_without_share": torch.equal(run["weights"], base["weights"]),
            "file_holds_engine": run["file_holds_engine"],
            "share_params_at_save": run["share_params_at_save"],
        }
    save_partial(results, "zero2_share_start", out)
    started_with_share = device.type == "cpu" or (out.get("start") or {}).get("share", 0) > 0
    runs_ok = all(
        r["bitwise_as_without_share"] and r["file_holds_engine"]
        for r in (out["auto, full save"], out["0.5, sharded save"])
    )
    return {"ok": started_with_share and runs_ok and base["file_holds_engine"], **out}


def check_determinism(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """Bitwise the same weights and forward reads across overlap on/off, pinning on/off, tiny/default buckets."""
    runs = {}
    for overlap in (True, False):
        for pin in (True, False):
            for bucket in (0.05, 25.0):
                key = f"overlap={overlap},pin={pin},bucket_mb={bucket}"
                runs[key] = train(device, tiny, overlap=overlap, pin_memory=pin, bucket_size_mb=bucket)
    reference = next(iter(runs.values()))
    differ = [k for k, r in runs.items() if not same(r, reference)]
    return {"ok": not differ, "configs": list(runs), "differ_from_first": differ}


def check_compact_state(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """cpu_state="bf16" on the device: 8 B/param of host state, bitwise the same across overlap and pinning
    (the bf16 master goes through pinned staging to the device), speculative (snapshot rollback) == sync,
    and it trains (the loss falls over 30 steps of learnable data)."""
    runs = {}
    for key, options in {
        "sync": {"cpu_step": "sync"},
        "sync,overlap=False,pin=False": {"cpu_step": "sync", "overlap": False, "pin_memory": False},
        "speculative": {"cpu_step": "speculative"},
    }.items():
        runs[key] = train(device, tiny, cpu_state="bf16", **options)
    reference = runs["sync"]
    differ = [k for k, r in runs.items() if not same(r, reference)]
    report = reference["engine"].memory_report()
    per_param = report["host_state_bytes"] / report["params"]
    model = gpt(device, tiny)
    engine = engine_for(model, device, torch.bfloat16, cpu_state="bf16")
    tokens = learnable_tokens(30 * 2, 65 if tiny else 257).to(device)
    losses = []
    for i in range(30):
        batch = tokens[2 * i : 2 * i + 2]
        losses.append(float(F.cross_entropy(model(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten())))
        step(model, engine, batch)
    engine.close()
    learned = statistics.mean(losses[-5:]) < 0.9 * statistics.mean(losses[:5])
    return {
        "ok": not differ and per_param == 8.0 and learned,
        "differ_from_sync": differ,
        "host_state_bytes_per_param": per_param,
        "losses": losses,
    }


SANITIZER_TEST = "test_reused_device_buffers_pass_the_cuda_sanitizer"


def check_sanitizer(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """Under TORCH_CUDA_SANITIZER=1 (set by the driver), with every side-stream copy and copy-back held back:
    the same results, for the speculative schedule (the GPU default; bitwise the synchronous step's
    without clipping) and for DPU. Then tests/cuda's sanitizer test, its output after the others' in pytest.txt."""
    sync = train(device, tiny, bucket_size_mb=0.05, cpu_step="sync")
    speculative = train(device, tiny, bucket_size_mb=0.05, cpu_step="speculative")
    speculative_delayed = train(device, tiny, bucket_size_mb=0.05, cpu_step="speculative", sleep=SLEEP_CYCLES)
    dpu = train(device, tiny, bucket_size_mb=0.05, cpu_step="delayed", dpu_warmup_steps=1)
    dpu_delayed = train(device, tiny, bucket_size_mb=0.05, cpu_step="delayed", dpu_warmup_steps=1, sleep=SLEEP_CYCLES)
    speculated = max(s.speculated_fraction for s in speculative["stats"])
    result = {
        "speculative_equals_sync": same(speculative, sync),
        "speculative_same_with_delays": same(speculative, speculative_delayed),
        "dpu_same_with_delays": same(dpu, dpu_delayed),
        "speculated_fraction_max": speculated,
        "sanitizer_on": os.environ.get("TORCH_CUDA_SANITIZER") == "1",
    }
    test = f"{ROOT / 'tests' / 'cuda' / 'test_cuda_paths.py'}::{SANITIZER_TEST}"
    with open(results / "pytest.txt", "a") as out:
        rc, left = run_in_group([*PYTEST, test], time_left(), out)
    result["reused_buffers_test"] = rc == 0 and not left  # 0 also where it skipped (no CUDA)
    return {"ok": all(v for k, v in result.items() if k != "sanitizer_on") and speculated > 0, **result}


def check_dpu_reads(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """DPU: forward must read exactly the weights it reads without delays, while copy-backs are held back."""
    kwargs = {"cpu_step": "delayed", "dpu_warmup_steps": 2, "steps": 8}
    plain = train(device, tiny, **kwargs)
    delayed = train(device, tiny, sleep=4 * SLEEP_CYCLES, **kwargs)
    changed = [i for i in range(len(plain["reads"])) if not torch.equal(plain["reads"][i], delayed["reads"][i])]
    return {"ok": not changed and torch.equal(plain["master"], delayed["master"]), "steps_read_differently": changed}


def check_fp16_overflow(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """An inf gradient at step 3 is skipped (weights untouched), the next step trains again."""
    model = gpt(device, tiny)
    engine = engine_for(model, device, torch.float16)
    data = batches(device, tiny, 5)
    for tokens in data[:2]:
        step(model, engine, tokens)
    before = master(engine)
    poisoned = next(iter(model.parameters()))
    handle = poisoned.register_hook(lambda g: torch.full_like(g, float("inf")))
    skipped = step(model, engine, data[2])
    handle.remove()
    after_skip = master(engine)
    resumed = step(model, engine, data[3])
    after = master(engine)
    result = {
        "skipped": skipped.skipped,
        "weights_untouched_by_skipped_step": torch.equal(before, after_skip),
        "next_step_trains": not resumed.skipped and not torch.equal(after_skip, after),
        "skipped_steps": engine.skipped_steps,
        "loss_scale": engine.loss_scale,
    }
    engine.close()
    return {
        "ok": result["skipped"] and result["weights_untouched_by_skipped_step"] and result["next_step_trains"],
        **result,
    }


def _rank(rank: int, device_name: str, tiny: bool) -> torch.Tensor:
    """One of two gloo ranks sharing one device (``testing.ranks`` made the group): its final master weights."""
    device = torch.device(device_name)
    model = gpt(device, tiny)
    engine = engine_for(model, device, torch.bfloat16, bucket_size_mb=0.05)
    for tokens in batches(device, tiny, 4):
        half = tokens.shape[0] // 2
        step(model, engine, tokens[rank * half : (rank + 1) * half])
    final = master(engine)
    engine.close()
    return final


def check_two_ranks(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """Two gloo ranks sharing one GPU against world size 1 on the full batch (same global batch)."""
    from lightning_zero_offload.testing.ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        # The package (and with it Lightning) imported before the group exists: see testing/ranks.py.
        preload = ("lightning_zero_offload.demo.model", "lightning_zero_offload.engine")
        rank = functools.partial(_rank, device_name=str(device), tiny=tiny)
        two = run_ranks(rank, 2, tmp, timeout=time_left(), preload=preload)[0]
    model = gpt(device, tiny)
    start = torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])
    engine = engine_for(model, device, torch.bfloat16, bucket_size_mb=0.05)
    for tokens in batches(device, tiny, 4):
        step(model, engine, tokens)
    one = master(engine)
    engine.close()
    diff, moved = (two - one).norm().item(), (one - start).norm().item()
    # bf16 gradients summed in another order: a small fraction of how far the weights moved (norms: Adam's
    # first steps are ~lr * sign(grad), so single near-zero gradients may flip; a wrong average would not be small)
    return {"ok": diff <= 0.1 * moved, "diff_norm": diff, "update_norm": moved, "relative": diff / moved}


class OutOfOrder(nn.Module):
    """Declares its layers in the reverse of the order forward runs them, plus an unused early parameter."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.head = nn.Linear(width, width)
        self.unused = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.embed = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in reversed(self.layers):
            x = torch.relu(layer(x))
        return self.head(x)


def check_out_of_order(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """A model declared out of execution order keeps at most 2 gradient buckets on the device."""
    torch.manual_seed(0)
    width = 64 if tiny else 1024
    model = OutOfOrder(width, 12).to(device)
    bucket_mb = width * width * 2 / 2**20  # about one layer per bucket
    engine = engine_for(model, device, torch.bfloat16, bucket_size_mb=bucket_mb)
    x = torch.randn(8, width, device=device)
    stats = []
    for _ in range(3):
        engine.begin_backward()
        model(x.bfloat16()).float().square().mean().backward()
        engine.finish_backward()
        stats.append(engine.step())
    peak = engine.memory_report()["device_grad_buffers_peak"]
    engine.close()
    return {"ok": peak <= 2, "device_grad_buffers_peak": peak, "buckets": len(engine.layout.buckets)}


def check_fit_resume(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """Lightning fit 3 epochs == fit 2 (checkpoint) + resume to 3, bitwise; memory_report vs max_memory_allocated."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader
    from train_step import LM, PRESETS, engine_device_bytes, token_data

    from lightning_zero_offload import ZeroOffloadStrategy

    class Report(L.Callback):  # the engine is closed at teardown: read its accounting while training
        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.report = trainer.strategy.engine.memory_report()
            if device.type == "cuda":
                self.report["max_memory_allocated"] = torch.cuda.max_memory_allocated()

    spec = PRESETS["quick" if tiny else "gpt-19m"]

    def fit(epochs: int, tmp: str, ckpt: str | None = None) -> tuple[torch.Tensor, dict[str, int]]:
        module, report = LM(spec, "adamw", device), Report()
        keep = ModelCheckpoint(dirpath=tmp, filename="{epoch}", save_top_k=-1)
        strategy = ZeroOffloadStrategy(metrics=False)
        trainer = quiet_trainer(device, strategy, [report, keep], max_epochs=epochs, enable_checkpointing=True)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.fit(module, DataLoader(token_data(spec, 2), batch_size=spec["batch"]), ckpt_path=ckpt)
        return torch.cat([p.detach().float().flatten().cpu() for p in module.parameters()]), report.report

    with tempfile.TemporaryDirectory() as tmp:
        straight, report = fit(3, f"{tmp}/a")
        fit(2, f"{tmp}/b")
        resumed, _ = fit(3, f"{tmp}/c", ckpt=f"{tmp}/b/epoch=1.ckpt")
    states = engine_device_bytes(report)
    peak = report.get("max_memory_allocated")
    return {
        "ok": torch.equal(straight, resumed) and (peak is None or states <= peak),
        "resume_bitwise": torch.equal(straight, resumed),
        "memory_report": report,
        "model_states_over_max_allocated": None if peak is None else states / peak,
    }


def throughput_variants(tiny: bool) -> list[tuple[str, int]]:
    """(variant, budget in seconds on the GPU), in priority order: the default schedule and plain first;
    DeepSpeed last (optional, and its JIT build gets the longest to finish beside the others)."""
    fewer = max(1, usable_cores() - 2)  # the engine's real thread mix at cores and cores - 2
    return [
        ("zero_offload:speculative", 50),
        ("plain", 40),
        ("zero_offload:sync", 50),
        # the exact rollback (a snapshot copied behind the forward) against the undo, the default before it
        ("zero_offload:speculative@speculation_rollback=undo", 50),
        (f"zero_offload:speculative@cpu_threads={fewer}", 50),
        ("zero_offload:delayed", 50),
        ("deepspeed", 90),
    ]


def deepspeed_build_status() -> str | None:
    """None while gpu_check.sh's background build of DeepSpeed's CPU Adam runs (or was not started), else
    its last line: ``DEEPSPEED_BUILD ok`` or ``DEEPSPEED_BUILD failed rc=N``."""
    log = os.environ.get("GPU_CHECK_DEEPSPEED_BUILD_LOG")
    if not log or not Path(log).exists():
        return None
    lines = [x for x in Path(log).read_text(errors="replace").splitlines() if x.startswith("DEEPSPEED_BUILD")]
    return lines[-1] if lines else None


def check_throughput(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """train_step.py per variant, in its own process group under its own budget (a crash or hang costs that
    variant only); ``throughput.json`` is rewritten as each variant ends. 1.26B Llama, 32 x 512 tokens."""
    from train_step import PRESETS, build_net

    preset, batch = ("quick", 4) if tiny else ("llama-1b", 32)  # llama-1b: 16,384 tokens per step
    spec = dict(PRESETS[preset], batch=batch)
    with torch.device("meta"):  # the count only: building 1.26B parameters on the CPU takes longer than a step
        params = sum(p.numel() for p in build_net(spec).parameters())
    micro = results / "micro.json"
    out: dict[str, Any] = {"preset": preset, "batch": batch, "tokens_per_step": batch * spec["seq"], "params": params}
    out |= {"rows": {}, "not_run": {}, "seconds": {}}
    warmup, steps = (1, 2) if tiny else (2, 4)
    with tempfile.TemporaryDirectory() as tmp:
        for variant, budget in throughput_variants(tiny):
            timeout = min(budget * (4 if tiny else 1), time_left())
            if timeout < 10:
                out["not_run"][variant] = "the throughput budget is spent"
                continue
            if variant == "deepspeed" and (status := deepspeed_build_status()) and "ok" not in status:
                out["not_run"][variant] = f"its JIT build failed ({status}; see deepspeed_build.txt)"
                continue
            row_path, log_path = Path(tmp) / "row.json", Path(tmp) / "out.txt"
            row_path.unlink(missing_ok=True)
            command = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--preset", preset]
            command += ["--batch", str(batch), "--device", str(device), "--variants", variant, "--rounds", "1"]
            command += ["--warmup", str(warmup), "--steps", str(steps), "--out", str(row_path), "--figure", "none"]
            print(f"--- throughput: {variant} (budget {timeout:.0f} s)", flush=True)
            if device.type == "cuda" and deepspeed_build_status() is None:  # a compiler beside: flag the row
                out.setdefault("started_while_deepspeed_built", []).append(variant)
            start = time.monotonic()
            with open(log_path, "w") as log:
                rc, left = run_in_group(command, timeout, log)
            text = log_path.read_text(errors="replace")
            print(text[-8000:], flush=True)
            out["seconds"][variant] = round(time.monotonic() - start, 1)
            rows = json.loads(row_path.read_text())["rows"] if row_path.exists() else {}
            if variant in rows:
                out["rows"][variant] = rows[variant]
            else:
                skipped = [x for x in text.splitlines() if x.startswith(f"skipping {variant}:")]
                out["not_run"][variant] = skipped[0] if skipped else f"failed (rc={rc}): {text.strip()[-300:]}"
            if left:
                out.setdefault("left_running", {})[variant] = left
            out |= judge_throughput(out, json.loads(micro.read_text()) if micro.exists() else {}, device)
            save_partial(results, "throughput", out)
    out |= judge_throughput(out, json.loads(micro.read_text()) if micro.exists() else {}, device)
    save_partial(results, "throughput", out)
    ok = all(out["verdicts"].values()) and not out.get("left_running")
    return {"ok": ok, **{k: v for k, v in out.items() if k != "rows"}}


def judge_throughput(out: dict[str, Any], micro: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Per row: the engine's breakdown, hidden fractions and device bytes per parameter; side by side the
    step-time ratios; verdicts against the physics of the measured machine (GPU only).

    zero_offload's backward streams 2 B/param of bf16 gradients over PCIe while backward runs, so it cannot
    beat max(plain backward, 2 B/param / measured device->host bandwidth): judged within 1.25x of that.
    The synchronous CPU step is the fused kernel over every parameter: judged within 1.5x of
    params / the kernel's measured rate at the row's thread count (alone: the GPU waits in sync).
    """
    rows, params = out["rows"], out["params"]
    table: dict[str, Any] = {}
    sync = rows.get("zero_offload:sync")
    for name, r in rows.items():
        e = r.get("engine_ms", {})
        entry = {k: r[k] for k in ("step_ms", "tokens_per_s", "forward_ms", "backward_ms", "optimizer_ms")}
        entry["engine_ms"] = e
        if r.get("device_model_states_bytes") is not None:
            entry["device_model_state_bytes_per_param"] = r["device_model_states_bytes"] / params
        if r.get("peak_device_bytes") is not None:
            entry["peak_device_bytes_per_param"] = r["peak_device_bytes"] / params
        if e.get("transfer", 0) > 0:
            entry["hidden_transfer_fraction"] = max(0.0, 1 - e["transfer_wait"] / e["transfer"])
        if sync is not None and name.startswith("zero_offload") and name != "zero_offload:sync":
            entry["optimizer_time_hidden_vs_sync"] = 1 - r["optimizer_ms"] / sync["optimizer_ms"]
        entry["step_time_ratio_to"] = {o: r["step_ms"] / rows[o]["step_ms"] for o in rows if o != name}
        table[name] = entry
    required = ["zero_offload:speculative", "zero_offload:sync", "zero_offload:delayed", "plain"]
    verdicts = {"required_variants_ran": all(v in rows for v in required)}
    physics: dict[str, Any] = {}
    bw = micro.get("bandwidth_gb_per_s", {})
    if device.type == "cuda" and bw and "plain" in rows:
        transfer_ms = 1e3 * 2 * params / (bw["d2h_pinned"] * 1e9)
        bound = max(rows["plain"]["backward_ms"], transfer_ms)
        physics["gradient_transfer_ms_at_measured_bandwidth"] = transfer_ms
        physics["backward_bound_ms"] = bound
        for name in ("zero_offload:sync", "zero_offload:speculative"):
            if name in rows:
                physics[f"{name} backward / bound"] = rows[name]["backward_ms"] / bound
                verdicts[f"{name} backward within 1.25x of the bound"] = rows[name]["backward_ms"] <= 1.25 * bound
    kernel = next((row for row in micro.get("cpu_adam", []) if row["busy"] == 0), None)
    if device.type == "cuda" and kernel and sync is not None and "cpu_step" in sync.get("engine_ms", {}):
        threads = usable_cores()  # the sync row runs with the default thread count
        rate = kernel["mparam_per_s"].get(f"ours offload @{threads}")
        if rate:
            expected_ms = 1e3 * params / (rate * 1e6)
            physics["cpu_step_ms_at_kernel_rate"] = expected_ms
            physics["sync cpu_step / kernel"] = sync["engine_ms"]["cpu_step"] / expected_ms
            verdicts["sync cpu_step within 1.5x of the kernel's rate"] = (
                sync["engine_ms"]["cpu_step"] <= 1.5 * expected_ms
            )
    fewer = [n for n in rows if n.startswith("zero_offload:speculative@cpu_threads=")]
    threads_row: dict[str, Any] = {}
    if fewer and "zero_offload:speculative" in rows:
        base, other = rows["zero_offload:speculative"], rows[fewer[0]]
        threads_row = {
            "cores": usable_cores(),
            "fewer": int(fewer[0].rsplit("=", 1)[1]),
            "step_ms": {"cores": base["step_ms"], "fewer": other["step_ms"]},
            "cpu_step_ms": {k: r.get("engine_ms", {}).get("cpu_step") for k, r in (("cores", base), ("fewer", other))},
            "step_time_fewer_over_cores": other["step_ms"] / base["step_ms"],
        }
    return {"table": table, "physics": physics, "threads": threads_row, "verdicts": verdicts}


# -- driver -----------------------------------------------------------------------------------------------


def members(sid: int | None = None, pgid: int | None = None) -> list[int]:
    """Live processes (zombies excluded: they run nothing, and init reaps them) of a session or group."""
    import psutil

    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            if (sid is not None and os.getsid(proc.pid) == sid) or (pgid is not None and os.getpgid(proc.pid) == pgid):
                found.append(proc.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def kill_all(sid: int | None = None, pgid: int | None = None, grace: float = 1.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process of the session or group (also those that changed group);
    returns the ones still alive after that (should be none)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in {sid or pgid} | set(members(sid, pgid)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig) if pid == (sid or pgid) else os.kill(pid, sig)
        end = time.monotonic() + wait
        while members(sid, pgid) and time.monotonic() < end:
            time.sleep(0.05)
        if not members(sid, pgid):
            return []
    return members(sid, pgid)


def run_in_group(
    command: list[str], timeout: float, out: IO[str], env: dict[str, str] | None = None
) -> tuple[Any, list]:
    """Run ``command`` in its own process group, output into the file ``out`` (no pipe, which a grandchild
    would hold open past a kill), for at most ``timeout`` seconds; then kill whatever of the group is left.
    Returns (exit status or "timeout", pids that survived the kill)."""
    out.flush()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, process_group=0)  # fmt: skip
    try:
        rc: Any = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        rc = "timeout"
    left = kill_all(pgid=proc.pid)  # after a normal exit too: what it left behind would run into the next variant
    proc.wait()
    return rc, left


class Interrupted(Exception):
    """SIGTERM to the driver (gpu_check.sh's backstop): kill the running sub-check, keep the summary, stop."""


def _interrupt(signum: int, frame: Any) -> None:
    raise Interrupted(f"signal {signum}")


def start_deepspeed_build(results: Path) -> subprocess.Popen | None:
    """DeepSpeed JIT-compiles its CPU Adam on first use (a minute or more): start that in the background, in
    its own session and niced, once the micro-benchmarks are done (a compiler beside them would skew the
    thread-count rows). ``deepspeed_build.txt`` ends with ``DEEPSPEED_BUILD ok`` or ``... failed rc=N``."""
    log = results / "deepspeed_build.txt"
    if importlib.util.find_spec("deepspeed") is None:
        log.write_text("DEEPSPEED_BUILD failed: deepspeed is not installed\n")
        return None
    script = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    shell = (
        'nice -n 19 "$0" -c "$1"; rc=$?; [ $rc = 0 ] && echo DEEPSPEED_BUILD ok || echo "DEEPSPEED_BUILD failed rc=$rc"'
    )
    with open(log, "w") as out:
        return subprocess.Popen(["bash", "-c", shell, sys.executable, script], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)  # fmt: skip


def write_summary(results: Path, summary: dict[str, Any]) -> None:
    summary["passed"] = all(c.get("ok") for c in summary["checks"].values())
    save_partial(results, "summary", summary)


def run_subcheck(
    name: str,
    command: list[str],
    timeout: float,
    results: Path,
    summary: dict[str, Any],
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One sub-check in its own session (its ranks and helpers with it), output appended to log.txt.

    Its result is its ``RESULT {json}`` line; without one (timeout, crash) whatever it saved to
    ``<results>/<name>.json`` is kept as ``partial``. The whole session is killed afterwards and checked gone;
    summary.json is rewritten before returning."""
    start = time.monotonic()
    with open(results / "log.txt", "ab") as log:
        log.write(f"\n===== {name} (budget {timeout:.0f} s)\n".encode())
        log.flush()
        offset = log.tell()
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)  # fmt: skip
        interrupted = None
        try:
            rc: Any = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            rc = "timeout"
        except Interrupted as err:
            rc, interrupted = "interrupted", err
        left = kill_all(sid=proc.pid)
        proc.wait()
    with open(results / "log.txt", "rb") as log:
        log.seek(offset)
        output = log.read().decode(errors="replace")  # bytes, whatever the child wrote: never half-parsed
    lines = [x for x in output.splitlines() if x.startswith("RESULT ")]
    partial = results / f"{name}.json"
    if lines:
        result = json.loads(lines[-1][7:])
    else:
        why = f"timed out after {timeout:.0f} s" if rc == "timeout" else f"ended without a result (rc={rc})"
        result = {"ok": False, "error": why}
        if partial.exists():
            result["partial"] = json.loads(partial.read_text())
    if name not in OWN_FILES:  # in summary.json now: the device tool brings back 8 files
        partial.unlink(missing_ok=True)
    result |= {"seconds": round(time.monotonic() - start, 1), "timed_out": rc == "timeout", "session": proc.pid}
    result["left_running"] = left
    if left:
        result["ok"] = False
    summary["checks"][name] = result
    write_summary(results, summary)
    if interrupted is not None:
        raise interrupted
    return result


# name: (function, budget in seconds on the GPU, extra environment). Order = priority: (1) environment and
# micro-benchmarks, (2) tests/cuda, (3) correctness, the parameter-offload mode and the device share (the
# evidence issues 38 and 39 wait for), (4) throughput, (5) the rest while time remains. (1)-(4) add up to 455 s,
# 30 more than gpu_check.sh's 465 s deadline leaves after its set-up (about 40 s) had every check used its whole
# budget: throughput, the last of them, then runs what is left of its 120 s (its variants in priority order).
CHECKS: dict[str, tuple[Callable[..., dict[str, Any]], int, dict[str, str]]] = {
    "env": (check_env, 20, {}),
    "micro": (check_micro, 45, {}),
    "cuda_tests": (check_cuda_tests, 60, {}),
    "correctness": (check_correctness, 45, {}),
    "offload_params": (check_offload_params, 70, {}),
    "device_step": (check_device_step, 45, {}),
    "zero2_share": (check_zero2_share, 25, {}),
    "zero2_share_start": (check_zero2_share_start, 25, {}),
    "throughput": (check_throughput, 120, {}),
    "sanitizer": (check_sanitizer, 70, {"TORCH_CUDA_SANITIZER": "1"}),
    "determinism": (check_determinism, 35, {}),
    "compact_state": (check_compact_state, 25, {}),
    "fit_resume": (check_fit_resume, 40, {}),
    "fp16_overflow": (check_fp16_overflow, 20, {}),
    "dpu_reads": (check_dpu_reads, 25, {}),
    "out_of_order": (check_out_of_order, 20, {}),
    "two_ranks": (check_two_ranks, 35, {}),
}
# The sub-checks whose <name>.json stays beside summary.json (docs/benchmarks.md lists the 8 files); any other's
# partial result is folded into summary.json when it ends.
OWN_FILES = ("micro", "offload_params", "throughput")
CPU_BUDGET_FACTOR = 6  # the dry run checks logic only, on 2 shared cores: imports alone take tens of seconds


def run_one(name: str, device: torch.device, tiny: bool, results: Path) -> None:
    try:
        result = CHECKS[name][0](device, tiny, results)
    except Exception as err:  # noqa: BLE001 - reported as the check's result
        import traceback

        traceback.print_exc()
        result = {"ok": False, "error": repr(err)}
    print("RESULT " + json.dumps(result, default=str), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, help="folder for summary.json, log.txt and the measurements")
    parser.add_argument("--device", default="cuda", help="'cpu': dry run of the logic at toy sizes")
    parser.add_argument("--only", help="comma-separated sub-checks (default: all, in priority order)")
    parser.add_argument("--deadline", type=float, help="time.time() by which everything has ended")
    parser.add_argument("--budget", type=float, help="seconds from now, if no --deadline (GPU 450, CPU 3600)")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    tiny = device.type == "cpu"
    if args.run:
        global DEADLINE
        DEADLINE = args.deadline or DEADLINE
        run_one(args.run, device, tiny, results)
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: NO GPU here (torch.cuda.is_available() is False): nothing was checked.", file=sys.stderr)
        return 2
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = set(names) - set(CHECKS)
    if unknown:
        parser.error(f"unknown sub-checks {sorted(unknown)}; known: {list(CHECKS)}")
    deadline = args.deadline or time.time() + (args.budget or (3600.0 if tiny else 450.0))
    summary: dict[str, Any] = {"device": str(device), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "order": names}
    summary |= {"deadline": time.strftime("%H:%M:%S", time.localtime(deadline)), "checks": {}}
    summary["setup_errors"] = [e for e in os.environ.get("GPU_CHECK_SETUP_ERRORS", "").split(";") if e.strip()]
    write_summary(results, summary)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPU_CHECK_DEEPSPEED_BUILD_LOG": str(results / "deepspeed_build.txt")}
    signal.signal(signal.SIGTERM, _interrupt)
    build: subprocess.Popen | None = None
    build_started = device.type != "cuda"  # DeepSpeed's CPU offload needs CUDA: nothing to build elsewhere
    try:
        for name in names:
            if not build_started and name not in ("env", "micro"):
                build, build_started = start_deepspeed_build(results), True
            _, budget, extra_env = CHECKS[name]
            timeout = min(budget * (CPU_BUDGET_FACTOR if tiny else 1), deadline - time.time() - 8)  # 8 s: kill, write
            if timeout < 5:
                summary["checks"][name] = {"ok": False, "error": "not run: the overall time budget is spent"}
                write_summary(results, summary)
                print(f"NOT RUN {name}: the overall time budget is spent", flush=True)
                continue
            command = [sys.executable, __file__, "--run", name, "--device", str(device), "--results", str(results)]
            command += ["--deadline", str(time.time() + timeout)]
            extra_env = extra_env if device.type == "cuda" else {}  # the CUDA sanitizer fails to import without CUDA
            result = run_subcheck(name, command, timeout, results, summary, {**env, **extra_env})
            brief = {k: v for k, v in result.items() if k not in ("ok", "seconds", "partial", "losses", "table")}
            verdict = "PASS" if result["ok"] else "FAIL"
            print(f"{verdict} {name} ({result['seconds']} s): {json.dumps(brief, default=str)[:400]}", flush=True)
    except Interrupted as err:
        summary["interrupted"] = str(err)
    finally:
        if build is not None:
            summary["deepspeed_build_left_running"] = kill_all(sid=build.pid)
            build.wait()
    summary["complete"] = "interrupted" not in summary
    write_summary(results, summary)
    print(f"gpu_check: {'all passed' if summary['passed'] else 'FAILURES'}; results in {results}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
