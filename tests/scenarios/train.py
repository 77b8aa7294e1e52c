"""One multi-process training scenario, launched by Lightning's own launcher (devices=N on the CPU).

Run by tests/test_distributed.py in a subprocess; rank 0 writes what the test compares to --out.
"""

import argparse
import os
import sys

import lightning as L
import torch

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="zero_offload")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clip_val (by norm)")
    parser.add_argument("--format", default="full")
    parser.add_argument("--dpu", action="store_true", help="DPU with weight prediction after 3 steps")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--save", default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    if args.strategy == "zero_offload":
        dpu = {"cpu_step": "delayed", "dpu_warmup_steps": 3, "dpu_weight_prediction": True} if args.dpu else {}
        strategy = ZeroOffloadStrategy(checkpoint_format=args.format, bucket_size_mb=0.002, **dpu)
    else:
        strategy = args.strategy
    model = ShardedData(width=31)  # odd sizes: buckets need padding at world sizes 2 and 3
    norms = GradNorms()
    trainer = L.Trainer(
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        gradient_clip_val=args.clip,
        accumulate_grad_batches=args.accumulate,
        use_distributed_sampler=False,
        callbacks=[norms],
        **{**QUIET, "devices": args.devices},
    )
    # 192 samples, global batch 48: the same global batches at world sizes 1, 2 and 3.
    trainer.fit(model, ckpt_path=args.resume)
    if args.save:
        trainer.save_checkpoint(args.save)
    result = {
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "losses": model.losses,
        "grad_norms": norms.norms,  # before clipping: the engine's, or DDP's averaged .grad
    }
    if isinstance(trainer.strategy, ZeroOffloadStrategy):
        result["memory"] = trainer.strategy.engine.memory_report()
        result["threads"] = trainer.strategy.engine.num_threads
    if trainer.is_global_zero:
        torch.save(result, args.out)
    trainer.strategy.barrier()  # every rank is done with the group before any of them exits


if __name__ == "__main__":
    main()
