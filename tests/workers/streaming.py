"""Models registered in another order than forward uses them, and what one rank of a run records about
its device gradient buffers (top-level functions, so ``ranks.run_ranks`` can start them)."""

import torch
from engine_helpers import CPU, fp16_headroom, layers_training, options
from torch import nn

from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.step import streamer as grads

ORDERS = ("forward", "reversed", "shuffled")
WIDTH = 8
BLOCK_NUMEL = WIDTH * WIDTH + WIDTH  # one Linear(WIDTH, WIDTH): weight and bias
# One bucket per block, and buckets that straddle two blocks (gradients arriving far apart in a shuffle).
BUCKET_NUMELS = (BLOCK_NUMEL, 100)
STEPS = 2


class Blocks(nn.Module):
    """``n`` equal blocks, registered 0..n-1 and used in forward in ``order``: as registered, reversed (the
    layout then gets gradients in its own order), or shuffled."""

    def __init__(self, order: str, n: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n))
        use = list(range(n))
        if order == "reversed":
            use.reverse()
        elif order == "shuffled":
            use = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
        self.use = use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index in self.use:
            x = torch.tanh(self.blocks[index](x))
        return x


def train_blocks(order: str, bucket_numel: int, rank: int, world: int) -> dict:
    """fp32 AdamW on ``Blocks(order)``, this rank's share of each batch: held-buffer peak per backward,
    buffers existing after training, the most that existed at once, and the final master weights."""
    net = Blocks(order)
    opts = options(bucket_size_mb=bucket_numel * 4 / 2**20)
    engine = OffloadEngine(torch.optim.AdamW(net.parameters(), lr=1e-2), CPU, torch.float32, opts)
    g = torch.Generator().manual_seed(1)
    peaks = []
    for _ in range(STEPS):
        x = torch.randn(6, WIDTH, generator=g)
        share = len(x) // world
        engine.begin_backward()
        net(x[rank * share : (rank + 1) * share]).square().mean().backward()
        engine.finish_backward()
        engine.step()
        peaks.append(engine.grads.take_device_buffer_peak())
    return {
        "buckets": len(engine.layout.buckets),
        "peaks": peaks,
        "kept": engine.grads.device_buffers.allocated,
        "most": engine.grads.device_buffers_allocated_peak,
        "master": engine.master_params(),
    }


# Where the cap makes buckets leave early (by agreement, or partially): also run without it, to compare.
UNCAPPED = (("reversed", BLOCK_NUMEL), ("shuffled", 100))


def every_order(rank: int, world: int) -> dict:
    """``train_blocks`` for every order and bucket size with the cap, and for ``UNCAPPED`` without one (as
    many buffers as buckets: nothing has to leave early), keyed ``"order/bucket_numel/capped"``."""
    results = {}
    for order in ORDERS:
        for numel in BUCKET_NUMELS:
            results[f"{order}/{numel}/True"] = train_blocks(order, numel, rank, world)
    cap = grads.DEVICE_BUFFER_CAP
    grads.DEVICE_BUFFER_CAP = 10**6
    try:
        for order, numel in UNCAPPED:
            results[f"{order}/{numel}/False"] = train_blocks(order, numel, rank, world)
    finally:
        grads.DEVICE_BUFFER_CAP = cap
    return results


def every_order_two_ranks(rank: int) -> dict:
    return every_order(rank, 2)


def every_order_three_ranks(rank: int) -> dict:
    return every_order(rank, 3)


def two_rank_checks(rank: int) -> tuple:
    return fp16_headroom(), *layers_training(rank, 2)


def two_gpu_checks(rank: int) -> tuple:
    """``two_rank_checks`` over NCCL, one GPU per rank."""
    device = torch.device("cuda", rank)
    return fp16_headroom(device), *layers_training(rank, 2, device=device)
