"""Multi-process training scenarios, launched by Lightning's own launcher (devices=N on the CPU).

Run by tests/trainer/test_distributed.py in a subprocess: several runs one after another in the same ranks (a
launch costs more than a run). A run is a dict: ``strategy`` ("zero_offload", "zero_offload_params" with
``cpu_step``, or "ddp"), ``precision``, ``max_steps``, ``max_epochs``, ``accumulate``, ``clip``
(gradient_clip_val, by norm), ``format`` (checkpoint_format), ``dpu`` (DPU with weight prediction after 3
steps), ``resume``, ``save``, ``out``, ``model`` ("blocks": residual blocks in a ModuleList;
"blocks_in_configure_model": the same built in configure_model, each rank from its own seed), ``first_block_at``
(with "blocks": the first block's ``requires_grad`` set before the fit's batches it names, counted across epochs,
``{"5": false}``). Also run by tests/trainer/test_offload_params_distributed.py.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import QUIET, Classifier, GradNorms, loader  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

import lightning_zero_offload  # noqa: E402,F401
from lightning_zero_offload import ZeroOffloadStrategy  # noqa: E402


class ShardedData(Classifier):
    """Samples each rank's part of the same shuffled global batch, whatever the world size (also 1)."""

    def train_dataloader(self) -> DataLoader:
        dataset = loader(n=192).dataset
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=7)
        return DataLoader(dataset, batch_size=48 // world, sampler=sampler)


class ResidualStack(nn.Module):
    """Residual blocks in an nn.ModuleList (offload_params needs repeated blocks to bring one at a time)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(2))
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


class ShardedBlocks(ShardedData):
    def __init__(self, width: int) -> None:
        super().__init__(width=width)
        torch.manual_seed(0)
        self.net = ResidualStack(width)


class ShardedBlocksInConfigureModel(ShardedData):
    """ShardedBlocks built in configure_model (on the meta device, filled block by block by the engine), each rank
    from its own seed: rank 0's values must reach every rank."""

    def __init__(self, width: int) -> None:
        super().__init__(width=width)
        self.width = width

    def configure_model(self) -> None:
        torch.manual_seed(self.global_rank)
        self.net = ResidualStack(self.width)


class SetFirstBlockTrainable(L.Callback):
    """``net.blocks[0].requires_grad_(flag)`` before each of the fit's batches (counted from 0 across epochs) that
    ``at`` names: mid-window under accumulation where the count is odd."""

    def __init__(self, at: dict[str, bool]) -> None:
        self.at = {int(batch): flag for batch, flag in at.items()}
        self.batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.batches in self.at:
            pl_module.net.blocks[0].requires_grad_(self.at[self.batches])
        self.batches += 1


def fit(run: dict, devices: int) -> None:
    """One training run; rank 0 writes what the test compares to ``run["out"]``."""
    if run.get("strategy", "zero_offload") == "zero_offload":
        dpu = {"cpu_step": "delayed", "dpu_warmup_steps": 3, "dpu_weight_prediction": True} if run.get("dpu") else {}
        strategy = ZeroOffloadStrategy(checkpoint_format=run.get("format", "full"), bucket_size_mb=0.002, **dpu)
    elif run["strategy"] == "zero_offload_params":
        strategy = ZeroOffloadStrategy(
            offload_params=True, cpu_step=run.get("cpu_step", "sync"), checkpoint_format=run.get("format", "full")
        )
    else:
        strategy = run["strategy"]
    # odd sizes: buckets (and FSDP2's shards) need padding at world sizes 2 and 3
    models = {"blocks": ShardedBlocks, "blocks_in_configure_model": ShardedBlocksInConfigureModel}
    model = models.get(run.get("model"), ShardedData)(width=31)
    norms = GradNorms()
    trainer = L.Trainer(
        strategy=strategy,
        precision=run.get("precision", "32-true"),
        max_steps=run.get("max_steps", -1),
        max_epochs=run.get("max_epochs"),
        gradient_clip_val=run.get("clip", 1.0),  # by norm
        accumulate_grad_batches=run.get("accumulate", 2),
        use_distributed_sampler=False,
        callbacks=[norms, SetFirstBlockTrainable(run.get("first_block_at", {}))],
        **{**QUIET, "devices": devices},
    )
    # 192 samples, global batch 48: the same global batches at world sizes 1, 2 and 3.
    trainer.fit(model, ckpt_path=run.get("resume"))
    if run.get("save"):
        trainer.save_checkpoint(run["save"])
    result = {  # full_tensor: sharded parameters (offload_params) gathered whole, a collective
        "params": {k: getattr(v, "full_tensor", v.detach)().detach().clone() for k, v in model.named_parameters()},
        "losses": model.losses,
        "grad_norms": norms.norms,  # before clipping: the engine's, or DDP's averaged .grad
    }
    if isinstance(trainer.strategy, ZeroOffloadStrategy):
        result["memory"] = trainer.strategy.memory_report()
        result["threads"] = trainer.strategy.session.resolved.cpu_threads
    if trainer.is_global_zero:
        torch.save(result, run["out"])
    trainer.strategy.barrier()  # every rank is done with the group before any of them exits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--runs", required=True, help="a JSON list of runs, trained one after another")
    args = parser.parse_args()
    # Every run after the first reuses the ranks and the process group of the first (Lightning's launcher
    # starts the other ranks once; they run this same list).
    for run in json.loads(Path(args.runs).read_text()):
        fit(run, args.devices)


if __name__ == "__main__":
    main()
