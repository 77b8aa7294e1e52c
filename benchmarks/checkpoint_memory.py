"""Host memory a checkpoint save and a resume's load add on top of training, per rank, at 1 and N ranks.

    python benchmarks/checkpoint_memory.py                      # ~100M parameters, both formats, 1 and 2 ranks
    python benchmarks/checkpoint_memory.py --params 20e6        # quicker
    python benchmarks/checkpoint_memory.py --repeats 2 --label after   # names the result file

Each (format, world size) runs in a fresh process, started by the rank launcher
(``lightning_zero_offload/testing/ranks.py``;
Lightning's own launcher starts the other ranks): a Trainer on the CPU (bf16-mixed,
``in_place_on_cpu=False``, so the engine holds separate fp32 master and moments as it does with a GPU)
trains one step, then every rank saves while a sampling thread reads its RSS from ``/proc/self/statm``
every millisecond, then loads the checkpoint back as a resume does (the strategy's ``load_checkpoint``,
``load_model_state_dict`` and ``load_optimizer_state_dict``) while sampling again. Reported per rank:
the RSS before, the peak during each, and the difference per parameter, for the whole RSS and for its
anonymous part (RSS less file-backed pages: a memory-mapped checkpoint's pages are reclaimable page
cache). With the planner's host bytes per parameter of training (one GPU per rank, bf16-mixed), the
largest model whose first checkpoint fits on a host of ``--host-gb`` GB. Writes JSON to
``benchmarks/results/checkpoint_memory[_LABEL].json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_probe import PeakSampler, anonymous_rss, linear_stack, rss  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class Peaks:
    """Peak RSS and anonymous RSS over the ``with`` block, relative to their values at its start."""

    def __enter__(self) -> Peaks:
        gc.collect()
        self.before = {"rss": rss(), "anon": anonymous_rss()}
        self.samplers = {"rss": PeakSampler(rss), "anon": PeakSampler(anonymous_rss)}
        for sampler in self.samplers.values():
            sampler.start()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
        self.extra = {k: sampler.stop() - self.before[k] for k, sampler in self.samplers.items()}


def child(fmt: str, params: float, width: int, world: int, out: str) -> None:
    import lightning as L
    import torch

    from lightning_zero_offload import ZeroOffloadStrategy

    Net = linear_stack(params, width)

    torch.manual_seed(0)
    model = Net()
    n = sum(p.numel() for p in model.parameters())
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8 * world, width)), batch_size=4)

    class SaveAndLoadDuringFit(L.Callback):
        """Saves after the first step, while the engine holds training's buffers (as ModelCheckpoint would),
        then loads it back as a resume does."""

        def __init__(self, path: str) -> None:
            self.path, self.result = path, {}

        def on_train_batch_end(self, trainer, *args) -> None:
            if trainer.global_step != 1:
                return
            strategy = trainer.strategy
            with Peaks() as save:
                trainer.save_checkpoint(self.path)
            with Peaks() as load:
                checkpoint = strategy.load_checkpoint(self.path)
                strategy.load_model_state_dict(checkpoint)
                strategy.load_optimizer_state_dict(checkpoint)
                del checkpoint
                gc.collect()
            for name, peaks in (("save", save), ("load", load)):
                self.result[name] = {
                    "rss_before": peaks.before["rss"],
                    "extra_bytes": peaks.extra["rss"],
                    "extra_anon_bytes": peaks.extra["anon"],
                    "seconds": peaks.seconds,
                }
            strategy.barrier()

    with tempfile.TemporaryDirectory(dir=os.environ.get("CHECKPOINT_MEMORY_DIR")) as tmp:
        path = os.path.join(tmp, "c.ckpt")
        if world > 1:  # every rank must save to the same path: rank 0 names the directory
            path = os.path.join(out, "c.ckpt")
        saver = SaveAndLoadDuringFit(path)
        trainer = L.Trainer(
            strategy=ZeroOffloadStrategy(checkpoint_format=fmt, in_place_on_cpu=False),
            precision="bf16-mixed",
            accelerator="cpu",
            devices=world,
            max_steps=2,
            logger=False,
            callbacks=[saver],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, data)
        result = {"format": fmt, "world": world, "rank": trainer.global_rank, "params": n, **saver.result}
        Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def training_bytes_per_param(world: int, precision: str = "bf16-mixed") -> float:
    """The planner's steady host bytes per parameter of training with ``world`` GPUs on one host (all ranks)."""
    from lightning_zero_offload.planner import Machine, plan

    machine = Machine(
        host_bandwidth_gbs=100.0, cpu_cores=32, host_memory_gb=1e6, device_tflops=100.0, h2d_gbs=25.0, d2h_gbs=25.0
    )
    n = 10**9
    return (
        plan(n, batch_size=1, seq_len=1, machine=machine, precision=precision, devices=world).host["sync"].per_node / n
    )


def run_once(fmt: str, world: int, args: argparse.Namespace) -> list[dict]:
    from lightning_zero_offload.testing.ranks import launch

    with tempfile.TemporaryDirectory(dir=os.environ.get("CHECKPOINT_MEMORY_DIR")) as out:
        command = [sys.executable, __file__, "--child", fmt, "--world", str(world), "--out", out]
        launch(command + ["--params", str(args.params), "--width", str(args.width)], timeout=1800)
        return [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--formats", nargs="+", default=["full", "sharded"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant, interleaved; medians reported")
    parser.add_argument("--host-gb", type=float, default=128.0)
    parser.add_argument("--label", default="")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.params, args.width, args.world, args.out)
        return
    variants = [(fmt, world) for world in args.worlds for fmt in args.formats]
    raw: dict[tuple[str, int], list[list[dict]]] = {v: [] for v in variants}
    for _ in range(args.repeats):  # interleaved: a drift of the shared machine spreads over all variants
        for fmt, world in variants:
            raw[(fmt, world)].append(run_once(fmt, world, args))
    rows, fits = [], []
    for (fmt, world), runs in raw.items():
        for rank in range(world):
            row = {"format": fmt, "world": world, "rank": rank, "params": runs[0][rank]["params"]}
            for phase in ("save", "load"):
                for key in ("extra_bytes", "extra_anon_bytes"):
                    values = [run[rank][phase][key] for run in runs]
                    row[f"{phase}_{key}"] = statistics.median(values)
                    row[f"{phase}_{key}_all"] = values
                row[f"{phase}_seconds"] = statistics.median(run[rank][phase]["seconds"] for run in runs)
            row["rss_before_save"] = statistics.median(run[rank]["save"]["rss_before"] for run in runs)
            rows.append(row)
            n = row["params"]
            print(
                f"{fmt:>8} world {world} rank {rank}: {n / 1e6:.0f}M params, "
                f"RSS {row['rss_before_save'] / 1e9:.2f} GB before; "
                f"save +{row['save_extra_bytes'] / 1e6:.0f} MB RSS, +{row['save_extra_anon_bytes'] / 1e6:.0f} MB "
                f"anonymous ({row['save_extra_anon_bytes'] / n:.2f} B/param) in {row['save_seconds']:.1f} s; "
                f"load +{row['load_extra_bytes'] / 1e6:.0f} MB RSS, +{row['load_extra_anon_bytes'] / 1e6:.0f} MB "
                f"anonymous ({row['load_extra_anon_bytes'] / n:.2f} B/param)"
            )
        # The first checkpoint on one host running all ``world`` ranks: training's bytes plus what every
        # rank's save adds (anonymous memory: the page cache the file passes through is reclaimable).
        train = training_bytes_per_param(world)
        saves = sum(max(r["save_extra_anon_bytes"], 0.0) / r["params"] for r in rows[-world:])
        fit = {"format": fmt, "world": world, "training_bytes_per_param": train, "save_bytes_per_param": saves}
        fit["largest_params_first_checkpoint_fits"] = args.host_gb * 1e9 / (train + saves)
        fits.append(fit)
        print(
            f"{fmt:>8} world {world}: {train:.2f} B/param of training + {saves:.2f} B/param at the save: the "
            f"largest model whose first checkpoint fits in {args.host_gb:.0f} GB: "
            f"{fit['largest_params_first_checkpoint_fits'] / 1e9:.2f}B params"
        )
    RESULTS.mkdir(exist_ok=True)
    name = f"checkpoint_memory{'_' + args.label if args.label else ''}.json"
    payload = {"host_gb": args.host_gb, "repeats": args.repeats, "rows": rows, "first_checkpoint": fits}
    (RESULTS / name).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
