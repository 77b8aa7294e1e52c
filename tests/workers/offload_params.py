"""The parameter-offload engine at several ranks (gloo) against FSDP2 + torch AdamW on the same shards.

Run by tests/engine/offload_params/test_ranks.py with ``ranks.run_ranks``. Every rank trains on its rows of
the same global batches; the reference is the issue's anchor, what Lightning's ModelParallelStrategy runs:
FSDP2 with torch's AdamW stepping the sharded parameters and ``clip_grad_norm_`` over them.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from offload_params_helpers import Blocks, batches, full_state, loss_of, sharded_copy, two_groups  # noqa: E402

from lightning_zero_offload.engine import OffloadOptions  # noqa: E402
from lightning_zero_offload.engine.offload_params import ParamOffloadEngine  # noqa: E402

ROWS = 12  # divisible by 1, 2 and 3 ranks


def rows_of(tensor: torch.Tensor) -> torch.Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    return tensor.chunk(world)[rank]


def engine_against_fsdp2_adamw(rank: int, cpu_step: str, clip_norm: float | None) -> dict:
    torch.manual_seed(0)
    model = Blocks()
    data = batches(steps=4, micro=2, rows=ROWS)
    ours, reference = sharded_copy(model), sharded_copy(model)
    engine = ParamOffloadEngine(
        torch.optim.AdamW(two_groups(ours)),
        torch.device("cpu"),
        torch.float32,
        OffloadOptions(offload_params=True, cpu_step=cpu_step),
        world_size=dist.get_world_size(),
    )
    adamw = torch.optim.AdamW(two_groups(reference))
    for window in data:
        for index, (x, y) in enumerate(window):
            if index == len(window) - 1:
                engine.expect_step(publish_early=True)
            engine.begin_backward()
            loss_of(ours, rows_of(x), rows_of(y), len(window)).backward()
            engine.finish_backward()
            loss_of(reference, rows_of(x), rows_of(y), len(window)).backward()
        stats = engine.step(clip_norm=clip_norm)
        engine.zero_grad()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_norm)
        adamw.step()
        adamw.zero_grad()
    engine.close()
    return {"ours": full_state(ours), "reference": full_state(reference), "last_norm": stats.grad_norm}
