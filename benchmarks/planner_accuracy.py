"""The planner's predictions against measured training steps, for three model sizes, side by side.

The demo GPT on the CPU "device", driven through the engine (sync CPU step, no overlap); each
round measures the machine's rates (probes) and then runs the steps, rounds interleaved over the sizes,
so load changes on a shared machine hit prediction and measurement alike. Prints predicted/measured for
forward+backward (with the gradient transfers), CPU step and whole step; the acceptance bound is 25%
(ratios 0.75-1.25). Sizes start above the L3 cache (16 B/param of state), where the planner's DRAM
bandwidth model applies. fp32 by default: CPUs without AVX-512 BF16 run bf16 matmuls some 30x slower,
which would make a run take minutes; the CPU step moves 28 B/param either way (--precision bf16-mixed).

Then the host-memory side: the planner's setup peak (the module as built next to the engine's first
buffers), steady training RSS and what a checkpoint save adds, against the RSS of a 40M-parameter fit
on the CPU sampled every millisecond (bf16-mixed on the offload path, as with a GPU, in both checkpoint
formats; 32-true in place), each in a fresh process (~1 min).

    python benchmarks/planner_accuracy.py                # three sizes, 1 and 2 threads, then memory (~3 min)
    python benchmarks/planner_accuracy.py --quick        # smaller sizes, fewer rounds, no memory, no file
    python benchmarks/planner_accuracy.py --memory-only  # the memory rows only (updates the JSON's)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import PeakSampler, linear_stack, rss  # noqa: E402

from lightning_zero_offload import kernels
from lightning_zero_offload.demo.model import GPT
from lightning_zero_offload.planner.validate import compare

SIZES = {"small": (2, 384), "medium": (3, 512), "large": (6, 512)}  # name: (n_layer, n_embd)
QUICK_SIZES = {"small": (2, 384), "medium": (2, 448), "large": (2, 512)}

# Host-memory peaks: what the planner predicts for the setup (the module as built next to the engine's
# first buffers), steady training and a checkpoint save, against the RSS of a real fit. Each
# configuration runs in a fresh process, so one's freed memory does not hide the next one's peak.
MEMORY_CONFIGS = {  # name: (precision, in_place_on_cpu, checkpoint_format)
    "bf16-mixed offload, full save": ("bf16-mixed", False, "full"),
    "bf16-mixed offload, sharded save": ("bf16-mixed", False, "sharded"),
    "32-true in place, full save": ("32-true", None, "full"),
}


def memory_child(name: str, params: float, width: int) -> dict:
    """One fit of a stack of linear layers on the CPU; RSS at setup, in steady training and during a save."""
    import lightning as L
    import torch

    from lightning_zero_offload import ZeroOffloadStrategy
    from lightning_zero_offload.planner import Machine, plan

    precision, in_place, fmt = MEMORY_CONFIGS[name]
    Net = linear_stack(params, width)

    class Probe(L.Callback):
        def __init__(self, sampler: PeakSampler, path: str) -> None:
            self.sampler, self.path, self.out = sampler, path, {}

        def on_train_start(self, trainer, pl_module) -> None:
            gc.collect()
            self.out["setup_peak"] = self.sampler.reset()  # module built, engine set up, no step yet

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step != 2:
                return
            gc.collect()
            self.out["steady"] = before = rss()  # after two steps: every training buffer exists
            self.sampler.reset()
            trainer.save_checkpoint(self.path)
            self.out["save_peak"] = self.sampler.reset()
            self.out["save_before"] = before

    gc.collect()
    base = rss()  # torch and Lightning imported, nothing of the model allocated
    sampler = PeakSampler()
    sampler.start()
    torch.manual_seed(0)
    model = Net()
    n = sum(p.numel() for p in model.parameters())
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, width)), batch_size=4)
    with tempfile.TemporaryDirectory() as tmp:
        probe = Probe(sampler, os.path.join(tmp, "c.ckpt"))
        trainer = L.Trainer(
            strategy=ZeroOffloadStrategy(checkpoint_format=fmt, in_place_on_cpu=in_place),
            precision=precision,
            accelerator="cpu",
            devices=1,
            max_steps=3,
            logger=False,
            callbacks=[probe],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, data)
    sampler.stop()
    m = probe.out
    # The CPU as the device, as in this run; only the memory side of the plan is read, so the rates are
    # placeholders and the host is given as large (no verdict is read either).
    machine = Machine(100.0, 2, 1e6, 1.0, 10.0, 10.0, device_type="cpu")
    with torch.device("meta"):
        meta = Net()
    host = plan(meta, batch_size=4, seq_len=1, precision=precision, machine=machine, checkpoint_format=fmt)
    host = host.host["sync"]
    measured = {
        "setup": m["setup_peak"] - base,
        "steady": m["steady"] - base,
        "save_extra": m["save_peak"] - m["save_before"],
    }
    predicted = {
        "setup": host.setup_per_rank,
        "steady": host.per_node,
        "save_extra": host.checkpoint_save_per_rank[fmt],
    }
    return {"config": name, "params": n, "predicted_bytes": predicted, "measured_bytes": measured}


def memory_rows(params: float, width: int) -> list[dict]:
    rows = []
    for name in MEMORY_CONFIGS:
        cmd = [sys.executable, __file__, "--memory-child", name, "--memory-params", str(params), "--width", str(width)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"the {name!r} run failed:\n{out.stderr[-4000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def print_memory(rows: list[dict]) -> None:
    print("\nhost RSS above the process before the model was built, predicted / measured MB (ratio)")
    print(f"{'configuration':<34} {'params':>7} {'setup peak':>24} {'steady':>24} {'save adds':>24}")
    for r in rows:
        cells = []
        for key in ("setup", "steady", "save_extra"):
            p, m = r["predicted_bytes"][key] / 1e6, r["measured_bytes"][key] / 1e6
            ratio = f"({p / m:.2f})" if m > 1 else "(-)"  # under a MB measured: no meaningful ratio
            cells.append(f"{p:7.0f} / {m:7.0f} {ratio:>7}")
        print(f"{r['config']:<34} {r['params'] / 1e6:6.1f}M " + " ".join(f"{c:>24}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "planner_accuracy.json"))
    parser.add_argument("--memory-only", action="store_true", help="only the host-memory peaks")
    parser.add_argument("--memory-params", type=float, default=40e6, help="parameters of the memory runs")
    parser.add_argument("--width", type=int, default=2048, help="width of the memory runs' linear layers")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.memory_params, args.width)))
        return
    if args.memory_only:
        rows = memory_rows(args.memory_params, args.width)
        print_memory(rows)
        out = json.loads(Path(args.out).read_text()) if Path(args.out).is_file() else {}
        out.update(host_memory=rows, host_memory_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")
        return
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
        memory = memory_rows(args.memory_params, args.width)
        print_memory(memory)
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
            "host_memory": memory,
            "host_memory_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
