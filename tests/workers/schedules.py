"""The speculative schedule against sync at two ranks (gloo), driving the engine directly.

Run by tests/engine/schedules/test_schedules.py with ``ranks.run_ranks`` (two processes, a hard timeout). Each rank
trains on its own data; a layer gets a gradient on one rank only on each step; rank 1 alone produces an
inf gradient in the fp16 case. Every rank checks its own shard and the published device weights; a
mismatch fails that rank.
"""

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from schedule_helpers import snapshot  # noqa: E402
from schedule_helpers import train as train_one_rank  # noqa: E402

from lightning_zero_offload.engine import LossScalerConfig  # noqa: E402


def compare(name: str, ours: list[torch.Tensor], ref: list[torch.Tensor], rtol: float = 0.0, atol: float = 0.0) -> None:
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=name)


def speculative_against_sync(rank: int) -> None:
    """One rank of the two (the launcher made the group and set one torch thread)."""
    train = functools.partial(train_one_rank, steps=8, bucket_size_mb=3000 / 2**20)  # three buckets: fewer collectives
    # 1. nothing triggers: bitwise
    sync, sync_net, sync_history = train("sync", rank=rank)
    spec, spec_net, history = train("speculative", rank=rank)
    assert sum(s.speculated_fraction for s in history) > 1 and spec.schedule.rollbacks == 0
    compare("no clip", snapshot(spec, spec_net), snapshot(sync, sync_net))
    # 2. clipping triggers on some steps (decided on the global norm: the same steps on every rank)
    clip = sorted(s.grad_norm for s in sync_history)[len(sync_history) // 2]  # global: the same on every rank
    sync, sync_net, _ = train("sync", rank=rank, clip_norm=clip)
    reference = snapshot(sync, sync_net)
    for rollback, tolerance in (("snapshot", {}), ("undo", {"rtol": 1e-6, "atol": 1e-7})):
        spec, spec_net, _ = train("speculative", rank=rank, clip_norm=clip, speculation_rollback=rollback)
        assert spec.schedule.rollbacks > 0
        compare(f"clip, {rollback}", snapshot(spec, spec_net), reference, **tolerance)
    # 3. fp16, an inf gradient on rank 1 only: skipped on every rank, loss scale backed off on every rank
    scaler = LossScalerConfig(hysteresis=1)
    inf_at = 5 if rank == 1 else None
    sync, sync_net, _ = train("sync", torch.float16, inf_at=inf_at, rank=rank, loss_scaler=scaler)
    spec, spec_net, history = train("speculative", torch.float16, inf_at=inf_at, rank=rank, loss_scaler=scaler)
    assert history[5].skipped and spec.skipped_steps == sync.skipped_steps == 1 and spec.loss_scale == sync.loss_scale
    assert history[5].rolled_back  # the buckets that were finite on every rank had been speculated
    compare("fp16 overflow", snapshot(spec, spec_net), snapshot(sync, sync_net))
    dist.barrier()
