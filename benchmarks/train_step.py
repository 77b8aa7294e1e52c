"""Trainer-level training step, side by side: zero_offload against what users would pick instead.

Every variant trains the same model (the demo GPT or a Hugging Face ``LlamaForCausalLM`` built from a
config) on the same synthetic tokens with the same global batch and precision (``--precision``, default
bf16-mixed; ``32-true`` is the fast choice on CPUs without native bf16), through ``Trainer.fit``:

- ``zero_offload`` with its default settings, and with each CPU-step schedule the strategy has
  (``zero_offload:sync``, ``zero_offload:speculative``, ``zero_offload:delayed``);
  ``zero_offload@overlap=False,cpu_threads=1`` overrides strategy options;
- ``plain``: ``strategy="auto"`` on one device with torch ``AdamW(fused=True)``;
- ``ddp``: two ranks (a separately launched process pair), the per-rank batch halved;
- on CUDA, when importable: ``deepspeed`` (Lightning's ``deepspeed_stage_2_offload`` with
  ``DeepSpeedCPUAdam``) and ``torchao`` (``CPUOffloadOptimizer`` in a plain loop).

Variants run interleaved, round after round, so machine noise hits them alike. Per step: the time from
one batch start to the next (so a background CPU update is charged where it blocks), split into
forward / backward / optimizer step (and, for zero_offload, the engine's own transfer, CPU-step and
copy-back times); medians are reported with tokens/s, peak device memory (CUDA
``max_memory_allocated``; everywhere the model-state accounting: the engine's ``memory_report`` or the
plain tensors' bytes), host RSS, and every variant's step-time ratio to every other.

    python benchmarks/train_step.py --quick                      # < 1 min smoke run, demo GPT
    python benchmarks/train_step.py --preset llama-compute       # ~5M-param Llama, batch 8x128
    python benchmarks/train_step.py --preset llama-optimizer     # ~50M-param Llama, batch 1x16
    python benchmarks/train_step.py --preset llama-1b --rounds 2 # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import psutil
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero_offload import ZeroOffloadStrategy, kernels
from lightning_zero_offload.testing.ranks import launch

ROOT = Path(__file__).resolve().parents[1]

START_ENV = dict(os.environ)
SCHEDULES = ("sync", "speculative", "delayed")
# name: model family, its config, batch size, sequence length
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"model": "gpt", "config": {"n_layer": 2, "n_embd": 128, "n_head": 4}, "batch": 4, "seq": 64},
    "gpt-19m": {"model": "gpt", "config": {"n_layer": 6, "n_embd": 512, "n_head": 8}, "batch": 4, "seq": 128},
    # held-out models of the kinds measured before (5.2M, batch 8x128 and 49.5M, batch 1x16)
    "llama-compute": {
        "model": "llama",
        "config": {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6},
        "batch": 8,
        "seq": 128,
    },
    "llama-optimizer": {
        "model": "llama",
        "config": {"vocab_size": 4096, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6},
        "batch": 1,
        "seq": 16,
    },
    # GPU sizes (TinyLlama-like 1.1B, a 2.0B and a 3.8B); batch 4 x 512 tokens
    "llama-1b": {
        "model": "llama",
        "config": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22},
        "batch": 4,
        "seq": 512,
    },
    "llama-2b": {
        "model": "llama",
        "config": {"vocab_size": 32000, "hidden_size": 2560, "intermediate_size": 6912, "num_hidden_layers": 24},
        "batch": 4,
        "seq": 512,
    },
    "llama-4b": {
        "model": "llama",
        "config": {"vocab_size": 32000, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32},
        "batch": 4,
        "seq": 512,
    },
}


# -- model and data ----------------------------------------------------------------------------------


def build_net(spec: dict[str, Any]) -> torch.nn.Module:
    """The bare network (no Lightning), with weights fixed by the seed."""
    torch.manual_seed(0)
    if spec["model"] == "gpt":
        from lightning_zero_offload.demo.model import GPT

        return GPT(block_size=spec["seq"], **spec["config"])
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, spec["config"]["hidden_size"] // 64)
    config = LlamaConfig(
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max(spec["seq"], 128),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        **spec["config"],
    )
    return LlamaForCausalLM(config)


def logits_of(net: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = net(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


def lm_loss(net: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = logits_of(net, batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def vocab_of(spec: dict[str, Any]) -> int:
    return spec["config"].get("vocab_size", 256)


def token_data(spec: dict[str, Any], batches: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, vocab_of(spec), (batches * spec["batch"], spec["seq"] + 1), generator=g))


class LM(L.LightningModule):
    def __init__(self, spec: dict[str, Any], optimizer: str, device: torch.device | None = None) -> None:
        super().__init__()
        # built on the GPU when there is one: initialising 1B+ parameters on the CPU takes longer than training
        with torch.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext():
            self.net = build_net(spec)
        self.optimizer_kind = optimizer

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return lm_loss(self.net, batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.parameters()
        if self.optimizer_kind == "fused":
            return torch.optim.AdamW(params, lr=1e-4, fused=True)
        if self.optimizer_kind == "deepspeed":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(params, lr=1e-4)
        return torch.optim.AdamW(params, lr=1e-4)


# -- timing ----------------------------------------------------------------------------------------


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Recorder:
    """Per-step timestamps and the memory readings of one run (shared by the Trainer and plain loops)."""

    def __init__(self, warmup: int, device: torch.device) -> None:
        self.warmup = warmup
        self.device = device
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []  # process CPU time: what a step costs even when the machine is shared
        self.marks: list[dict[str, float]] = []
        self.engine_stats: list[dict[str, float]] = []
        self.grad_bytes = 0
        self.extra: dict[str, Any] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self.sync()
        if len(self.starts) == self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.starts.append(time.perf_counter())
        self.cpu_starts.append(time.process_time())
        self.marks.append({})

    def mark(self, name: str) -> None:
        self.sync()
        self.marks[-1][name] = time.perf_counter()

    def summary(self, global_batch: int, seq: int) -> dict[str, Any]:
        """Medians over the measured steps (those after warm-up that have a following step start)."""
        steps = range(self.warmup, len(self.starts) - 1)
        if not steps:
            raise RuntimeError("no measured step: raise --steps")
        step_s = [self.starts[i + 1] - self.starts[i] for i in steps]

        def phase(a: str, b: str) -> float:
            return statistics.median(self.marks[i][b] - self.marks[i][a] for i in steps)

        out: dict[str, Any] = {
            "steps": len(step_s),
            "step_ms": 1e3 * statistics.median(step_s),
            "tokens_per_s": global_batch * seq / statistics.median(step_s),
            "cpu_ms": 1e3 * statistics.median(self.cpu_starts[i + 1] - self.cpu_starts[i] for i in steps),
            "forward_ms": 1e3 * statistics.median(self.marks[i]["fwd"] - self.starts[i] for i in steps),
            "backward_ms": 1e3 * phase("fwd", "bwd"),
            "optimizer_ms": 1e3 * phase("bwd", "end"),
        }
        out["other_ms"] = out["step_ms"] - out["forward_ms"] - out["backward_ms"] - out["optimizer_ms"]
        stats = [self.engine_stats[i] for i in steps if i < len(self.engine_stats)]
        if stats:
            out["engine_ms"] = {k: 1e3 * statistics.median(s[k] for s in stats) for k in stats[0]}
        if self.device.type == "cuda":
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        out["host_rss_bytes"] = rss_bytes()
        return {**out, **self.extra}


class TimingCallback(L.Callback):
    reads_weights_before_step = False  # its hooks before the step read timings and gradients only

    def __init__(self, recorder: Recorder) -> None:
        self.r = recorder

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.r.start()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self.r.mark("fwd")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.r.mark("bwd")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.r.grad_bytes = tensor_bytes(p.grad for p in pl_module.parameters())

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.r.mark("end")
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            s = engine.last
            self.r.engine_stats.append({k[:-2]: v for k, v in vars(s).items() if k.endswith("_s")})
        if len(self.r.starts) == trainer.max_steps:  # the last step: memory accounting
            self.r.extra["device_model_states_bytes"] = model_state_bytes(trainer, pl_module, self.r.grad_bytes)
            if engine is not None:
                self.r.extra["memory_report"] = engine.memory_report()


def engine_device_bytes(report: dict[str, int]) -> int:
    """The engine's device bytes: its own total where it reports one, else parameters + peak gradient buckets."""
    if "device_total_bytes" in report:
        return report["device_total_bytes"]
    return report["device_param_bytes"] + report["device_grad_buffers_peak"] * report["device_grad_buffer_bytes"]


def model_state_bytes(trainer: L.Trainer, module: L.LightningModule, grad_bytes: int) -> int | None:
    """Device bytes of parameters + gradients + optimizer state, from the tensors (or the engine's report)."""
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None and engine.in_place:  # the device is the host: master + moments + autograd's gradients
        report = engine.memory_report()
        return report["host_state_bytes"] + 4 * report["params"]
    if engine is not None:
        return engine_device_bytes(engine.memory_report())
    if "deepspeed" in type(trainer.strategy).__name__.lower():
        return None  # its partitions are not plain tensors: only max_memory_allocated counts there
    device = trainer.strategy.root_device
    state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    on_device = [t for t in state if t.device.type == device.type]
    return tensor_bytes(module.parameters()) + grad_bytes + tensor_bytes(on_device)


# -- variants --------------------------------------------------------------------------------------


def parse_variant(name: str) -> tuple[str, str | None, dict[str, Any]]:
    """``kind[:schedule][@k=v,...]`` -> (kind, schedule, options)."""
    base, _, opts = name.partition("@")
    kind, _, schedule = base.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        with contextlib.suppress(ValueError, SyntaxError, NameError):  # a word stays a string
            value = eval(value, {"__builtins__": {}}, {"True": True, "False": False, "None": None})  # noqa: S307
        options[key] = value
    return kind, schedule or None, options


def zero_offload_kwargs(schedule: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """Strategy arguments for a schedule (None: the strategy's default)."""
    kwargs = dict(options)
    if schedule is not None:
        kwargs["cpu_step"] = schedule
    if kwargs.get("cpu_step") == "delayed":  # the benchmark's warm-up steps cover DPU's (elsewhere it warns)
        kwargs.setdefault("dpu_warmup_steps", 1)
    ZeroOffloadStrategy(**kwargs)  # refuse unknown schedules/options now, not mid-run
    return kwargs


def engine_probe(kwargs: dict[str, Any], device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
    """Build (and close) an engine with these settings on a one-layer model: raises if the schedule cannot run."""
    from lightning_zero_offload.core import OPTION_NAMES, make_offload_options
    from lightning_zero_offload.engine import OffloadEngine

    layer = torch.nn.Linear(4, 4).to(device)
    options = make_offload_options(**{k: v for k, v in kwargs.items() if k in OPTION_NAMES})
    OffloadEngine(torch.optim.AdamW(layer.parameters()), device, dtype, options).close()


def available(variant: str, device: torch.device, batch: int = 2, precision: str = "bf16-mixed") -> str | None:
    """None if the variant can run here with this global batch, else why not."""
    kind, schedule, options = parse_variant(variant)
    if kind == "ddp" and batch % 2:
        return f"ddp splits the global batch over 2 ranks, and {batch} does not split: pass an even --batch"
    if kind == "zero_offload":
        try:
            dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision, torch.float32)
            engine_probe(zero_offload_kwargs(schedule, options), device, dtype)
        except (ValueError, TypeError) as err:
            return str(err)
        return None
    if kind in ("plain", "ddp"):
        return None
    if kind in ("deepspeed", "torchao"):
        if device.type != "cuda":
            return f"{kind} offload needs CUDA"
        try:
            __import__("deepspeed.ops.adam" if kind == "deepspeed" else "torchao.optim")
        except Exception as err:  # noqa: BLE001 - any import failure means: not available here
            return f"{kind} is not importable: {err!r}"
        return None
    return f"unknown variant kind {kind!r}"


def run_trainer(
    variant: str, spec: dict[str, Any], device: torch.device, warmup: int, steps: int, precision: str
) -> dict[str, Any]:
    kind, schedule, options = parse_variant(variant)
    optimizer = {"plain": "fused", "ddp": "fused", "deepspeed": "deepspeed"}.get(kind, "adamw")
    devices: int | list[int] = [device.index or 0] if device.type == "cuda" else 1
    if kind == "zero_offload":
        strategy: Any = ZeroOffloadStrategy(metrics=False, **zero_offload_kwargs(schedule, options))
    elif kind == "ddp":
        strategy, devices = "ddp", 2
    elif kind == "deepspeed":
        strategy = "deepspeed_stage_2_offload"
    else:
        strategy = "auto"
    per_rank = dict(spec, batch=spec["batch"] // (2 if kind == "ddp" else 1))
    recorder = Recorder(warmup, device)
    data = DataLoader(token_data(spec, warmup + steps + 1), batch_size=per_rank["batch"])
    module = LM(spec, optimizer, device)
    trainer = L.Trainer(
        accelerator=device.type,
        devices=devices,
        strategy=strategy,
        precision=precision,
        max_steps=warmup + steps + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TimingCallback(recorder)],
    )
    trainer.fit(module, data)
    result = recorder.summary(spec["batch"], spec["seq"]) if trainer.global_rank == 0 else {}
    del trainer, module
    gc.collect()
    return result


def run_torchao(spec: dict[str, Any], device: torch.device, warmup: int, steps: int, precision: str) -> dict[str, Any]:
    """torchao's CPUOffloadOptimizer in a plain loop: fp32 params on the device, bf16 autocast in bf16-mixed."""
    from torchao.optim import CPUOffloadOptimizer

    with torch.device(device):
        net = build_net(spec)
    optimizer = CPUOffloadOptimizer(net.parameters(), torch.optim.AdamW, lr=1e-4, fused=True)
    recorder = Recorder(warmup, device)
    for (batch,) in DataLoader(token_data(spec, warmup + steps + 1), batch_size=spec["batch"]):
        recorder.start()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss = lm_loss(net, batch.to(device))
        recorder.mark("fwd")
        loss.backward()
        recorder.mark("bwd")
        optimizer.step()
        optimizer.zero_grad()
        recorder.mark("end")
    result = recorder.summary(spec["batch"], spec["seq"])
    del net, optimizer
    gc.collect()
    return result


def clean_env() -> dict[str, str]:
    """The environment this script started with: an in-process Trainer sets LOCAL_RANK, MASTER_PORT and
    OMP_NUM_THREADS, and with LOCAL_RANK set Lightning takes the pair for externally launched and waits for
    a second rank that never comes."""
    return {**START_ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), START_ENV.get("PYTHONPATH", "")])}


def run_ddp_pair(spec: dict[str, Any], warmup: int, steps: int, precision: str, timeout: float) -> dict[str, Any]:
    """Two ranks in their own processes (Lightning relaunches this script for rank 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        out = str(Path(tmp) / "r.json")
        job.write_text(json.dumps({"spec": spec, "warmup": warmup, "steps": steps, "precision": precision, "out": out}))
        launch([sys.executable, __file__, "--ddp-worker", str(job)], timeout, env=clean_env())
        return json.loads((Path(tmp) / "r.json").read_text())


def ddp_worker(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    result = run_trainer("ddp", job["spec"], torch.device("cpu"), job["warmup"], job["steps"], job["precision"])
    if result:  # rank 0
        Path(job["out"]).write_text(json.dumps(result))


def run_variant(variant: str, spec: dict[str, Any], device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    kind = parse_variant(variant)[0]
    if kind == "ddp" and device.type == "cpu":
        return run_ddp_pair(spec, args.warmup, args.steps, args.precision, args.ddp_timeout)
    if kind == "torchao":
        return run_torchao(spec, device, args.warmup, args.steps, args.precision)
    return run_trainer(variant, spec, device, args.warmup, args.steps, args.precision)


# -- report --------------------------------------------------------------------------------------


def merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per variant: medians over rounds of the per-round medians; memory: the max."""
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key, value in rounds[0].items():
        if isinstance(value, dict) and key == "engine_ms":
            out[key] = {k: statistics.median(r[key][k] for r in rounds) for k in value}
        elif key.endswith("_bytes") and value is not None:
            out[key] = max(r[key] for r in rounds)
        elif isinstance(value, float):
            out[key] = statistics.median(r[key] for r in rounds)
        else:
            out[key] = value
    out["step_ms_per_round"] = [r["step_ms"] for r in rounds]
    return out


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    names = list(rows)
    print(f"\n{'variant':<34} {'step ms':>8} {'tok/s':>9} {'fwd':>6} {'bwd':>7} {'opt':>7} {'states MiB':>10}", end="")
    print(f" {'peak MiB':>8} {'RSS MiB':>8} {'CPU ms':>8}  ratios (step time / other's)")
    for name in names:
        r = rows[name]
        ratios = ", ".join(
            f"{r['step_ms'] / rows[o]['step_ms']:.2f}x (CPU time {r['cpu_ms'] / rows[o]['cpu_ms']:.2f}x) {o}"
            for o in names
            if o != name
        )
        print(
            f"{name:<34} {r['step_ms']:8.1f} {r['tokens_per_s']:9.1f} {r['forward_ms']:6.1f} {r['backward_ms']:7.1f}"
            f" {r['optimizer_ms']:7.1f} {mib(r.get('device_model_states_bytes')):>10}"
            f" {mib(r.get('peak_device_bytes')):>8} {mib(r['host_rss_bytes']):>8} {r['cpu_ms']:8.1f}  {ratios}"
        )
        if "engine_ms" in r:
            e = r["engine_ms"]
            print(
                f"{'':<34} engine: backward {e['backward']:.1f}, transfer {e['transfer']:.1f} (wait"
                f" {e['transfer_wait']:.1f}), cpu_step {e['cpu_step']:.1f} (wait {e['update_wait']:.1f}),"
                f" copy-back {e['copy_back']:.1f} ms"
            )


def plot(rows: dict[str, dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.5))
    left = [0.0] * len(names)
    for part, color in (("forward", "#4c72b0"), ("backward", "#55a868"), ("optimizer", "#c44e52"), ("other", "#999")):
        widths = [max(0.0, rows[n][f"{part}_ms"]) for n in names]
        ax.barh(names, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths)]
    for i, n in enumerate(names):
        ax.text(left[i], i, f" {rows[n]['tokens_per_s']:,.0f} tok/s", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median step time, ms (batch start to next batch start)")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(left) * 1.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_variants(device: torch.device) -> list[str]:
    variants = ["zero_offload", *(f"zero_offload:{s}" for s in SCHEDULES), "plain", "ddp"]
    if device.type == "cuda":
        variants = [v for v in variants if v != "ddp"] + ["deepspeed", "torchao"]
    return variants


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny GPT, 1 round, few steps (< 1 min)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpt-19m")
    parser.add_argument("--batch", type=int, help="global batch (overrides the preset)")
    parser.add_argument("--variants", nargs="+", help="default: every zero_offload schedule, plain, ddp (CPU)")
    parser.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="bf16-mixed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per round and variant")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ddp-timeout", type=float, default=600.0)
    parser.add_argument("--out", help="JSON path (default benchmarks/results/train_step_<preset>[_32-true].json)")
    parser.add_argument("--figure", help="PNG path (default docs/figures/train_step_<preset>[_32-true].png); 'none'")
    parser.add_argument("--ddp-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ddp_worker:
        return ddp_worker(args.ddp_worker)
    if args.quick:
        args.preset, args.rounds, args.warmup, args.steps = "quick", 1, 2, 4
    spec = dict(PRESETS[args.preset])
    if args.batch:
        spec["batch"] = args.batch
    device = torch.device(args.device)
    variants = []
    for v in args.variants or default_variants(device):
        reason = available(v, device, spec["batch"], args.precision)
        if reason:
            print(f"skipping {v}: {reason}")
        else:
            variants.append(v)

    params = sum(p.numel() for p in build_net(spec).parameters())
    title = (
        f"{spec['model']} {params / 1e6:.1f}M params, batch {spec['batch']}x{spec['seq']}, {args.precision} "
        f"on {device.type}"
    )
    print(f"{title}; {torch.get_num_threads()} torch threads; variants {variants}")
    name = ("quick" if args.quick else args.preset) + ("" if args.precision == "bf16-mixed" else f"_{args.precision}")
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"train_step_{name}.json")
    samples: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for round_index in range(args.rounds):
        for v in variants:
            samples[v].append(run_variant(v, spec, device, args))
            print(f"round {round_index + 1}/{args.rounds} {v}: {samples[v][-1]['step_ms']:.1f} ms/step", flush=True)
            # after every run, not only at the end: a run stopped by a time limit keeps what it measured
            write_record(out, rows_of(samples), args, spec, params, device, complete=False)
    rows = rows_of(samples)
    print_table(rows)
    write_record(out, rows, args, spec, params, device, complete=True)
    print(f"wrote {out}")
    if args.figure != "none":
        figure = Path(args.figure or ROOT / "docs" / "figures" / f"train_step_{name}.png")
        plot(rows, title, figure)
        print(f"wrote {figure}")


def rows_of(samples: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One row per variant measured so far, with its ratios to the other rows."""
    rows = {v: merge(s) for v, s in samples.items() if s}
    for v, r in rows.items():
        r["step_time_ratio_to"] = {o: r["step_ms"] / rows[o]["step_ms"] for o in rows if o != v}
        r["cpu_time_ratio_to"] = {o: r["cpu_ms"] / rows[o]["cpu_ms"] for o in rows if o != v}
    return rows


def write_record(
    out: Path,
    rows: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    spec: dict[str, Any],
    params: int,
    device: torch.device,
    complete: bool,
) -> None:
    """The JSON record; ``complete`` is False while rounds are still to run."""
    record = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "kernels": kernels.backend(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": {**spec, "params": params},
        "precision": args.precision,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "complete": complete,
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".part")
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(out)  # atomic: a reader (or a kill) never sees half a file


if __name__ == "__main__":
    main()
