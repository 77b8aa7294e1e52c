"""The parameter-offload mode's placement, materialization and loading at two gloo ranks (top-level
functions: ``ranks.run_ranks`` starts them; each rank asserts its own results and returns what the test
compares across ranks)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from offload_params_helpers import Net, assert_same_state, tokens  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: E402

from lightning_zero_offload.engine.offload_params.placement import shard_model  # noqa: E402


def materialized_like_rank0(rank: int) -> None:
    """Each rank builds on the meta device from its own seed; every rank ends with rank 0's values, which
    are those of the eager build from rank 0's seed, bitwise (tied or not, units chosen or the user's)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for tied in (False, True):
        for users_units in (False, True):
            torch.manual_seed(0)
            eager = Net(tied)
            torch.manual_seed(rank)
            with torch.device("meta"):
                net = Net(tied)
            if users_units:
                for block in net.blocks:
                    fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
            shard_model(net, mesh, param_dtype=torch.float32)
            assert net.blocks[0].up.weight.to_local().shape[0] == (14, 13)[rank]  # 27 rows: uneven shards
            assert_same_state(net, eager)
            assert torch.equal(net(tokens()), eager(tokens()))


def frozen_gradients(rank: int) -> float:
    """Frozen parts (a block, part of one, the embedding) at two ranks, each rank half the batch: the
    largest gradient difference to the whole batch on one unsharded model (rounding of the reduce)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = []
    for build in ("eager", "meta"):
        torch.manual_seed(0)
        with torch.device("meta" if build == "meta" else "cpu"):
            net = Net()
        for frozen in (net.embed, net.blocks[0], net.blocks[1].up):
            frozen.requires_grad_(False)
        models.append(net)
    eager, net = models
    shard_model(net, mesh, param_dtype=torch.float32)
    eager(tokens()).square().mean().backward()
    net(tokens().chunk(2)[rank]).square().mean().backward()
    worst = 0.0
    for (name, p), q in zip(net.named_parameters(), eager.parameters(), strict=True):
        assert (p.grad is None) == (not q.requires_grad), name
        if p.grad is not None:
            worst = max(worst, (p.grad.full_tensor() - q.grad).abs().max().item() / q.grad.abs().max().item())
    return worst
