"""A 2-rank run where one rank fails. Each rank is started by tests/trainer/test_reliability.py as its own process
(as torchrun or SLURM would), so the test sees every rank's exit code and output, under a hard timeout:
whatever goes wrong, every rank must exit non-zero within seconds and the failing rank's error be printed.

Failures:
- ``raise``: rank ``--rank`` raises in ``training_step`` at step 2.
- ``shard-io``: rank ``--rank`` cannot write its shard of a sharded checkpoint saved at step 2 (its
  file size limit is set below the shard size, so the write fails with a real ``OSError``).
- ``extra-layer``: rank ``--rank``'s model has one more layer.
- ``width``: rank ``--rank``'s model has wider hidden layers.
- ``stall``: rank ``--rank`` stops answering for ``--stall`` seconds at step 2 (alive, not failing):
  the others' collectives must give up after the strategy's ``--timeout``. With ``--left``, every rank marks
  that folder when it leaves fit, and the stalled rank wakes as soon as another has left (not waiting out the
  rest of its stall).
"""

import argparse
import os
import resource
import signal
import sys
import time
from pathlib import Path

import lightning as L
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import QUIET, Classifier, loader  # noqa: E402

import lightning_zero_offload  # noqa: E402,F401
from lightning_zero_offload import ZeroOffloadStrategy  # noqa: E402

FAILURE_TEXT = "deliberate failure in training_step"


class Failing(Classifier):
    def __init__(self, failure: str, failing: bool, **kwargs) -> None:
        super().__init__(width=40 if failure == "width" and failing else 32, **kwargs)
        if failure == "extra-layer" and failing:
            self.net.append(nn.Linear(4, 4))
        self.failure = failure
        self.failing = failing

    def training_step(self, batch, batch_idx):
        if self.failure == "raise" and self.failing and self.global_step == 2:
            print(f"rank {self.global_rank} fails at {time.time():.2f}", flush=True)
            raise RuntimeError(f"{FAILURE_TEXT} on rank {self.global_rank}")
        if self.failure == "stall" and self.failing and self.global_step == 2:
            print(f"rank {self.global_rank} stalls at {time.time():.2f}", flush=True)
            deadline = time.monotonic() + self.stall_s
            while time.monotonic() < deadline and not (self.left and any(Path(self.left).iterdir())):
                time.sleep(0.1)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.failure == "shard-io" and self.global_step == 2:
            if self.failing:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (512, resource.RLIM_INFINITY))
            try:
                self.trainer.save_checkpoint(self.save_path)
            finally:  # the limit also applies to this rank's log file: lift it for the traceback
                resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--failure", choices=["raise", "shard-io", "extra-layer", "width", "stall"], required=True)
    parser.add_argument("--rank", type=int, default=1, help="the rank that fails")
    parser.add_argument("--strategy", default="zero_offload")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--save", default=None, help="checkpoint path for shard-io")
    parser.add_argument("--timeout", type=float, default=None, help="the strategy's collective timeout (s)")
    parser.add_argument("--stall", type=float, default=40.0, help="how long the stalling rank sleeps at most (s)")
    parser.add_argument("--left", default=None, help="a folder where each rank marks that it left fit")
    args = parser.parse_args()

    if args.strategy == "zero_offload":
        timeout = {} if args.timeout is None else {"timeout": args.timeout}
        strategy = ZeroOffloadStrategy(checkpoint_format="sharded", bucket_size_mb=0.002, **timeout)
    else:
        strategy = args.strategy
    rank = int(os.environ.get("LOCAL_RANK", 0))
    model = Failing(args.failure, failing=rank == args.rank, scheduler=False)
    model.save_path, model.stall_s, model.left = args.save, args.stall, args.left
    trainer = L.Trainer(strategy=strategy, precision=args.precision, max_steps=6, **{**QUIET, "devices": 2})
    try:
        trainer.fit(model, loader(n=64))
    finally:
        print(f"rank {rank} left fit at {time.time():.2f}", flush=True)
        if args.left:
            Path(args.left, f"rank{rank}").touch()


if __name__ == "__main__":
    main()
