"""Host memory a checkpoint save adds on top of training: peak RSS during ``trainer.save_checkpoint``.

    python benchmarks/checkpoint_memory.py                    # ~100M parameters, both formats
    python benchmarks/checkpoint_memory.py --params 20e6      # quicker
    python benchmarks/checkpoint_memory.py --label before     # names the result file

Each format runs in a fresh process: a Trainer on the CPU (bf16-mixed, ``in_place_on_cpu=False``, so the
engine holds separate fp32 master and moments as it does with a GPU) trains one step, then the main
thread saves while a sampling thread reads the process's RSS from ``/proc/self/statm`` every
millisecond. Reported: the RSS before the save, the peak during it, and the difference per parameter.
With the planner's host bytes per parameter of training (one GPU, bf16-mixed), the script also gives the
largest model whose first checkpoint fits on a host of ``--host-gb`` GB. Writes JSON to
``benchmarks/results/checkpoint_memory[_LABEL].json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import PeakSampler, linear_stack, rss  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def child(fmt: str, params: float, width: int) -> dict:
    import lightning as L
    import torch

    from lightning_zero_offload import ZeroOffloadStrategy

    Net = linear_stack(params, width)

    torch.manual_seed(0)
    model = Net()
    n = sum(p.numel() for p in model.parameters())
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, width)), batch_size=4)

    class SaveDuringFit(L.Callback):
        """Saves after the first step, while the engine holds training's buffers (as ModelCheckpoint would)."""

        def __init__(self, path: str) -> None:
            self.path, self.result = path, {}

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step != 1:
                return
            gc.collect()
            before = rss()
            sampler = PeakSampler()
            sampler.start()
            start = time.perf_counter()
            trainer.save_checkpoint(self.path)
            seconds = time.perf_counter() - start
            self.result = {"rss_before": before, "rss_peak": sampler.stop(), "save_s": seconds}

    with tempfile.TemporaryDirectory(dir=os.environ.get("CHECKPOINT_MEMORY_DIR")) as tmp:
        saver = SaveDuringFit(os.path.join(tmp, "c.ckpt"))
        trainer = L.Trainer(
            strategy=ZeroOffloadStrategy(checkpoint_format=fmt, in_place_on_cpu=False),
            precision="bf16-mixed",
            accelerator="cpu",
            devices=1,
            max_steps=2,
            logger=False,
            callbacks=[saver],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, data)
    result = saver.result
    extra = result["rss_peak"] - result["rss_before"]
    return {"format": fmt, "params": n, **result, "extra_bytes": extra, "extra_bytes_per_param": extra / n}


def training_bytes_per_param(precision: str = "bf16-mixed") -> float:
    """The planner's steady host bytes per parameter of training on one GPU (all buffers, one rank)."""
    from lightning_zero_offload.planner.model import Machine, plan

    machine = Machine(
        host_bandwidth_gbs=100.0, cpu_cores=32, host_memory_gb=1e6, device_tflops=100.0, h2d_gbs=25.0, d2h_gbs=25.0
    )
    n = 10**9
    return plan(n, batch_size=1, seq_len=1, machine=machine, precision=precision).host["sync"].per_node / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--formats", nargs="+", default=["full", "sharded"])
    parser.add_argument("--host-gb", type=float, default=128.0)
    parser.add_argument("--label", default="")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.params, args.width)))
        return
    runs = []
    for fmt in args.formats:
        out = subprocess.run(
            [sys.executable, __file__, "--child", fmt, "--params", str(args.params), "--width", str(args.width)],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            sys.exit(f"the {fmt} run failed:\n{out.stderr[-4000:]}")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    train = training_bytes_per_param()
    for run in runs:
        per_param = train + max(run["extra_bytes_per_param"], 0.0)
        run["largest_params_first_checkpoint_fits"] = args.host_gb * 1e9 / per_param
        print(
            f"{run['format']:>8}: {run['params'] / 1e6:.0f}M params, "
            f"RSS {run['rss_before'] / 1e9:.2f} GB before the save, peak +{run['extra_bytes'] / 1e6:.0f} MB "
            f"({run['extra_bytes_per_param']:.2f} B/param) in {run['save_s']:.1f} s; "
            f"with {train:.2f} B/param of training, the largest model whose first checkpoint fits in "
            f"{args.host_gb:.0f} GB: {run['largest_params_first_checkpoint_fits'] / 1e9:.2f}B params"
        )
    RESULTS.mkdir(exist_ok=True)
    name = f"checkpoint_memory{'_' + args.label if args.label else ''}.json"
    payload = {"host_gb": args.host_gb, "training_bytes_per_param": train, "runs": runs}
    (RESULTS / name).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
