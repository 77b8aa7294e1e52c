"""ZeRO-2 with ``cpu_state="bf16"`` across processes, launched by Lightning's own launcher (devices=N on the CPU).

Run by tests/trainer/test_compact_state_ranks.py in a subprocess: several runs one after another in the same
ranks. A run is a dict: ``max_epochs``, ``seed`` (``seed_everything``'s, after the model is built: the
rounding seed is torch's initial seed, rank 0's), ``resume``, ``ckpt_dir`` (a sharded checkpoint at the
end of each epoch, saved during fit), ``out``. Every run trains the same global batches at any world size
(tests/workers/train.py's ShardedData), in 32-true (fp32 device parameters holding the bf16 master's
values: this CPU has no native bf16 matmul) with clipping. Rank 0 writes the weights and its memory
report to ``out``, every other rank its memory report to ``out`` + ``.rank<r>``.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import QUIET  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from workers.train import ShardedData  # noqa: E402

import lightning_zero_offload  # noqa: E402,F401
from lightning_zero_offload import ZeroOffloadStrategy  # noqa: E402

CLIP = 0.22  # by norm; tests/trainer/test_distributed.py's (the norms run 0.18-0.29 on this data)


def fit(run: dict, devices: int) -> None:
    model = ShardedData(width=31)  # odd sizes: buckets need padding at world sizes 2 and 3
    L.seed_everything(run.get("seed", 7), verbose=False)
    callbacks = []
    if run.get("ckpt_dir"):
        callbacks.append(ModelCheckpoint(dirpath=run["ckpt_dir"], filename="{epoch}", save_top_k=-1))
    strategy = ZeroOffloadStrategy(cpu_state="bf16", checkpoint_format="sharded", bucket_size_mb=0.002)
    trainer = L.Trainer(
        strategy=strategy,
        precision="32-true",
        max_epochs=run.get("max_epochs", 3),
        gradient_clip_val=CLIP,
        use_distributed_sampler=False,
        callbacks=callbacks,
        **{**QUIET, "devices": devices, "max_steps": -1, "enable_checkpointing": bool(callbacks)},
    )
    trainer.fit(model, ckpt_path=run.get("resume"))
    memory = trainer.strategy.memory_report()
    if trainer.is_global_zero:
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        seed = trainer.strategy.session.engine_state_dict()["cpu_state"]["seed"]  # of the bf16 state's rounding
        torch.save({"params": params, "memory": memory, "seed": seed}, run["out"])
    else:
        torch.save({"memory": memory}, f"{run['out']}.rank{trainer.global_rank}")
    trainer.strategy.barrier()  # every rank is done with the group before any of them exits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--runs", required=True, help="a JSON list of runs, trained one after another")
    args = parser.parse_args()
    for run in json.loads(Path(args.runs).read_text()):  # the same ranks and process group for every run
        fit(run, args.devices)


if __name__ == "__main__":
    main()
