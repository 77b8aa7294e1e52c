"""Prediction at 2 ranks under offload_params where the ranks get different numbers of batches: Lightning's
predict sampler pads nothing, so 17 samples in batches of 8 give rank 0 two batches and rank 1 one. Started by
tests/trainer/test_offload_params_distributed.py, each rank as its own process; prints how many batches each
rank predicted, or raises"""

import argparse
import os
import sys

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import QUIET, BlockRegression  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_zero_offload import ZeroOffloadStrategy  # noqa: E402


class Predicts(BlockRegression):
    def predict_step(self, batch, batch_idx):
        (x,) = batch
        return self.model(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--limit", type=int, default=None, help="limit_predict_batches")
    args = parser.parse_args()
    limit = {} if args.limit is None else {"limit_predict_batches": args.limit}
    strategy = ZeroOffloadStrategy(offload_params=True)
    trainer = L.Trainer(strategy=strategy, **{**QUIET, "devices": 2}, **limit)
    inputs = torch.randn(args.samples, 8, generator=torch.Generator().manual_seed(1))
    predicted = trainer.predict(Predicts(), DataLoader(TensorDataset(inputs), batch_size=8))
    print(f"rank {trainer.global_rank} predicted {len(predicted)} batches", flush=True)


if __name__ == "__main__":
    main()
