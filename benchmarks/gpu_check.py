"""The first-GPU check, in sub-checks with time budgets; run by ``benchmarks/gpu_check.sh`` (read that first).

Each sub-check runs in its own process with a hard timeout (a hang costs its budget, not the lease) and
ends with one ``RESULT {json}`` line; the driver collects them into ``<results>/summary.json`` and the
whole output into ``<results>/log.txt``. On a machine without CUDA it says so and exits 2, unless
``--device cpu`` is given: then every engine-level check runs at toy sizes on the CPU (a dry run of the
logic, to catch typos before GPU minutes are spent; timing and memory targets are not judged there).

    python benchmarks/gpu_check.py --results /tmp/gpu              # on a CUDA machine
    python benchmarks/gpu_check.py --device cpu --results /tmp/dry  # CPU dry run of the sub-checks
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU time at ~2 GHz, per delayed copy


# -- shared engine-level helpers ---------------------------------------------------------------------


def gpt(device: torch.device, tiny: bool, **size: int) -> nn.Module:
    from lightning_zero_offload.demo.model import GPT

    torch.manual_seed(0)
    dims = {"n_layer": 2, "n_embd": 64, "n_head": 2} if tiny else {"n_layer": 4, "n_embd": 512, "n_head": 8}
    return GPT(block_size=256, **{**dims, **size}).to(device)


def engine_for(model: nn.Module, device: torch.device, dtype: torch.dtype, **options: Any) -> Any:
    from lightning_zero_offload.engine import OffloadEngine, OffloadOptions

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return OffloadEngine(optimizer, device, dtype, OffloadOptions(**options))


def batches(device: torch.device, tiny: bool, n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 33) if tiny else (8, 257)
    return [torch.randint(0, 256, shape, generator=g).to(device) for _ in range(n)]


def step(model: nn.Module, engine: Any, tokens: torch.Tensor) -> Any:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
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
    from lightning_zero_offload import kernels

    found = {}
    for name in ("deepspeed", "torchao", "cffi", "transformers", "lightning"):
        try:
            found[name] = getattr(__import__(name), "__version__", "?")
        except Exception as err:  # noqa: BLE001
            found[name] = f"missing: {err!r}"
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "kernels": kernels.backend(), **found}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
        info["gpus"] = torch.cuda.device_count()
    info["cpu_cores"] = os.cpu_count()
    return {"ok": kernels.backend() != "torch" or device.type == "cpu", **info}


def check_cuda_tests(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """The suite's CUDA paths: tests/cuda (if present) and every test with cuda/gpu in its name."""
    paths = [str(p) for p in (ROOT / "tests" / "cuda",) if p.exists()]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *paths]
        + ([] if paths else ["tests", "-k", "cuda or gpu or pinned or stream"]),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    (results / "pytest.txt").write_text(done.stdout + done.stderr)
    return {"ok": done.returncode in (0, 5), "returncode": done.returncode, "tail": done.stdout.strip()[-300:]}


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


def check_sanitizer(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """Run under TORCH_CUDA_SANITIZER=1 (set by the driver) with delayed side-stream copies: same results."""
    reference = train(device, tiny, bucket_size_mb=0.05)
    delayed = train(device, tiny, bucket_size_mb=0.05, sleep=SLEEP_CYCLES)
    dpu = train(device, tiny, bucket_size_mb=0.05, cpu_step="delayed", dpu_warmup_steps=1)
    dpu_delayed = train(device, tiny, bucket_size_mb=0.05, cpu_step="delayed", dpu_warmup_steps=1, sleep=SLEEP_CYCLES)
    sanitizer = os.environ.get("TORCH_CUDA_SANITIZER") == "1"
    return {"ok": same(reference, delayed) and same(dpu, dpu_delayed), "sanitizer_on": sanitizer}


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


def _rank(rank: int, store: str, device_name: str, tiny: bool, out: str) -> None:
    import torch.distributed as dist

    # Import Lightning (through the package) before the group exists: imported after it, lightning_fabric
    # keeps 10 references to the default group (measured with sys.getrefcount), so destroy_process_group
    # cannot free it and the gloo group is destroyed during interpreter finalization, which aborted
    # ("terminate called without an active exception", SIGABRT) or hung about one exit in ten.
    import lightning_zero_offload.demo.model  # noqa: F401
    import lightning_zero_offload.engine  # noqa: F401

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    device = torch.device(device_name)
    model = gpt(device, tiny)
    engine = engine_for(model, device, torch.bfloat16, bucket_size_mb=0.05)
    for tokens in batches(device, tiny, 4):
        half = tokens.shape[0] // 2
        step(model, engine, tokens[rank * half : (rank + 1) * half])
    final = master(engine)
    engine.close()
    if rank == 0:
        torch.save(final, out)
    dist.destroy_process_group()


def check_two_ranks(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """Two gloo ranks sharing one GPU against world size 1 on the full batch (same global batch)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rank0.pt"
        torch.multiprocessing.spawn(_rank, args=(f"{tmp}/store", str(device), tiny, out), nprocs=2, join=True)
        two = torch.load(out, weights_only=True)
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


def check_backward_vs_plain(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """~1B Llama: zero_offload backward (gradients streamed out) against plain bf16 backward, time and peak."""
    from train_step import PRESETS, build_net, logits_of

    spec = dict(PRESETS["quick" if tiny else "llama-1b"], batch=2)

    def timed_backward(net: nn.Module, engine: Any | None) -> tuple[float, int]:
        tokens = torch.randint(0, 256, (spec["batch"], spec["seq"] + 1), device=device)
        times = []
        for _ in range(4):
            loss = F.cross_entropy(logits_of(net, tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            if engine is not None:
                engine.begin_backward()
            loss.backward()
            if engine is not None:
                engine.finish_backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if engine is None:
                net.zero_grad(set_to_none=True)
            else:
                engine.step()
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
        return sorted(times[1:])[1], peak

    with torch.device(device):
        net = build_net(spec).to(torch.bfloat16)
    plain_s, plain_peak = timed_backward(net, None)
    del net
    with torch.device(device):
        net = build_net(spec)
    engine = engine_for(net, device, torch.bfloat16)
    offload_s, offload_peak = timed_backward(net, engine)
    report = engine.memory_report()
    engine.close()
    ratio = offload_s / plain_s
    return {
        "ok": ratio <= 1.25 and report["device_grad_buffers_peak"] <= 4 if device.type == "cuda" else True,
        "backward_ms_plain": 1e3 * plain_s,
        "backward_ms_zero_offload": 1e3 * offload_s,
        "ratio": ratio,
        "device_grad_buffers_peak": report["device_grad_buffers_peak"],
        "peak_bytes_during_backward_plain": plain_peak,
        "peak_bytes_during_backward_zero_offload": offload_peak,
        "hidden_transfer_fraction": engine.last.hidden_transfer_fraction,
    }


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
        trainer = L.Trainer(
            accelerator=device.type,
            devices=1,
            strategy=ZeroOffloadStrategy(metrics=False),
            precision="bf16-mixed",
            max_epochs=epochs,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[report, ModelCheckpoint(dirpath=tmp, filename="{epoch}", save_top_k=-1)],
        )
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


def check_benchmark(device: torch.device, tiny: bool, results: Path) -> dict[str, Any]:
    """train_step.py at ~1B against deepspeed_stage_2_offload, torchao and plain (one round)."""
    preset = "quick" if tiny else "llama-1b"
    out = results / f"train_step_{preset}.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--preset", preset, "--device", str(device)]
    command += ["--rounds", "1", "--warmup", "2", "--steps", "3", "--out", str(out)]
    command += ["--figure", str(results / f"train_step_{preset}.png")]
    if device.type == "cpu":
        command += ["--variants", "zero_offload", "plain"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print(done.stdout[-6000:], done.stderr[-3000:])
    if done.returncode != 0:
        return {"ok": False, "returncode": done.returncode}
    rows = json.loads(out.read_text())["rows"]
    ratios = {k: v.get("step_time_ratio_to") for k, v in rows.items() if k.startswith("zero_offload")}
    return {"ok": True, "tokens_per_s": {k: v["tokens_per_s"] for k, v in rows.items()}, "ratios": ratios}


def _probe(method: str, layers: int, device_name: str, tiny: bool) -> None:
    """One training step of a 4096-wide Llama with ``layers`` layers (its own process: OOM kills only it)."""
    import lightning as L
    from torch.utils.data import DataLoader
    from train_step import LM, token_data

    from lightning_zero_offload import ZeroOffloadStrategy

    width = 64 if tiny else 4096
    spec = {
        "model": "llama",
        "config": {
            "vocab_size": 32000,
            "hidden_size": width,
            "intermediate_size": 11008 if not tiny else 128,
            "num_hidden_layers": layers,
        },
        "batch": 1,
        "seq": 128,
    }
    device = torch.device(device_name)
    with torch.device(device):
        module = LM(spec, "deepspeed" if method == "deepspeed" else "fused" if method == "plain" else "adamw")
    strategy = {"plain": "auto", "deepspeed": "deepspeed_stage_2_offload"}.get(method) or ZeroOffloadStrategy(
        metrics=False
    )
    trainer = L.Trainer(
        accelerator=device.type,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(token_data(spec, 1), batch_size=1))
    params = sum(p.numel() for p in module.parameters())
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    print("PROBE " + json.dumps({"params": params, "peak_device_bytes": peak}))


def check_max_size(device: torch.device, tiny: bool, results: Path, budget_s: float = 80.0) -> dict[str, Any]:
    """Grow a 4096-wide Llama (~0.2B params per layer) until a step fails, per method, within the budget."""
    import psutil

    methods = ["plain", "zero_offload"] + (["deepspeed"] if device.type == "cuda" else [])
    # plain needs 16 B/param on the device (141 GB: ~8B params); the offload methods 16 B/param on the host
    ladders = {"plain": [32, 40, 48]} if not tiny else {}
    host = psutil.virtual_memory().total
    end = time.monotonic() + budget_s
    found: dict[str, Any] = {}
    for index, method in enumerate(methods):
        deadline = time.monotonic() + (end - time.monotonic()) / (len(methods) - index)  # a fair share each
        best, stop = None, "ladder exhausted"
        for layers in ladders.get(method, [1, 2] if tiny else [16, 32]):
            params = 0.26e9 + 0.202e9 * layers
            if method != "plain" and not tiny and 16 * params > 0.9 * host:
                stop = f"{layers} layers would need {16 * params / 2**30:.0f} GiB of host memory (> 90% of host)"
                break
            left = deadline - time.monotonic()
            if left < 10:
                stop = "budget"
                break
            code = f"import gpu_check; gpu_check._probe({method!r}, {layers}, {str(device)!r}, {tiny})"
            try:
                done = subprocess.run(
                    [sys.executable, "-c", code], cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=left
                )
            except subprocess.TimeoutExpired:
                stop = f"budget (at {layers} layers)"
                break
            line = [x for x in done.stdout.splitlines() if x.startswith("PROBE ")]
            if done.returncode != 0 or not line:
                oom = "out of memory" in (done.stdout + done.stderr).lower()
                stop = f"{layers} layers: {'device OOM' if oom else f'failed rc={done.returncode}'}"
                break
            best = {"layers": layers, **json.loads(line[0][6:])}
        found[method] = {"largest_ok": best, "stopped": stop}
    plain = (found["plain"]["largest_ok"] or {}).get("params")
    zero = (found["zero_offload"]["largest_ok"] or {}).get("params")
    return {
        "ok": zero is not None,
        "methods": found,
        "zero_offload_over_plain": zero / plain if zero and plain else None,
    }


# -- driver -----------------------------------------------------------------------------------------------

# name: (function, budget in seconds on the GPU, extra environment). Order = priority.
CHECKS: dict[str, tuple[Callable[..., dict[str, Any]], int, dict[str, str]]] = {
    "env": (check_env, 20, {}),
    "determinism": (check_determinism, 35, {}),
    "sanitizer": (check_sanitizer, 35, {"TORCH_CUDA_SANITIZER": "1"}),
    "dpu_reads": (check_dpu_reads, 25, {}),
    "fp16_overflow": (check_fp16_overflow, 20, {}),
    "out_of_order": (check_out_of_order, 20, {}),
    "two_ranks": (check_two_ranks, 35, {}),
    "cuda_tests": (check_cuda_tests, 60, {}),
    "backward_vs_plain": (check_backward_vs_plain, 45, {}),
    "fit_resume": (check_fit_resume, 40, {}),
    "benchmark": (check_benchmark, 100, {}),
    "max_size": (check_max_size, 90, {}),
}


def run_one(name: str, device: torch.device, tiny: bool, results: Path) -> None:
    try:
        result = CHECKS[name][0](device, tiny, results)
    except Exception as err:  # noqa: BLE001 - reported as the check's result
        import traceback

        traceback.print_exc()
        result = {"ok": False, "error": repr(err)}
    print("RESULT " + json.dumps(result, default=str))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, help="folder for summary.json, log.txt and the benchmark files")
    parser.add_argument("--device", default="cuda", help="'cpu': dry run of the logic at toy sizes")
    parser.add_argument("--only", help="comma-separated sub-checks (default: all, in priority order)")
    parser.add_argument("--budget", type=float, default=430.0, help="seconds for all sub-checks together")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    tiny = device.type == "cpu"
    if args.run:
        run_one(args.run, device, tiny, results)
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: NO GPU here (torch.cuda.is_available() is False): nothing was checked.", file=sys.stderr)
        return 2
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = set(names) - set(CHECKS)
    if unknown:
        parser.error(f"unknown sub-checks {sorted(unknown)}; known: {list(CHECKS)}")
    deadline = time.monotonic() + args.budget
    summary: dict[str, Any] = {"device": str(device), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "checks": {}}
    with open(results / "log.txt", "a") as log:
        for name in names:
            _, budget, extra_env = CHECKS[name]
            timeout = min(budget * (10 if tiny else 1), deadline - time.monotonic())  # CPU dry runs: logic only
            if timeout < 5:
                summary["checks"][name] = {"ok": False, "error": "skipped: the overall budget is spent"}
                continue
            start = time.monotonic()
            log.write(f"\n===== {name} (budget {timeout:.0f} s)\n")
            log.flush()
            command = [sys.executable, __file__, "--run", name, "--device", str(device), "--results", str(results)]
            try:
                done = subprocess.run(
                    command, env={**os.environ, **extra_env}, capture_output=True, text=True, timeout=timeout
                )
                output, rc = done.stdout + done.stderr, done.returncode
            except subprocess.TimeoutExpired as err:
                output, rc = f"{err.stdout or ''}{err.stderr or ''}", "timeout"
            log.write(output if isinstance(output, str) else output.decode(errors="replace"))
            lines = [x for x in str(output).splitlines() if x.startswith("RESULT ")]
            result = json.loads(lines[-1][7:]) if lines else {"ok": False, "error": f"no result (rc={rc})"}
            result["seconds"] = round(time.monotonic() - start, 1)
            summary["checks"][name] = result
            print(
                f"{'PASS' if result['ok'] else 'FAIL'} {name} ({result['seconds']} s): "
                f"{json.dumps({k: v for k, v in result.items() if k not in ('ok', 'seconds')}, default=str)[:300]}",
                flush=True,
            )
    summary["passed"] = all(c["ok"] for c in summary["checks"].values())
    (results / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"gpu_check: {'all passed' if summary['passed'] else 'FAILURES'}; results in {results}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
