"""Small models, data and option presets for driving the offload engine directly in tests."""

import torch
from torch import nn

from lightning_zero_offload.engine import OffloadOptions

CPU = torch.device("cpu")


def make_net(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 4))


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def loss_fn(net: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(net(x).float(), y)


def two_groups(net: nn.Module, cls=torch.optim.AdamW, **kwargs):
    return cls(
        [
            {"params": net[0].parameters(), "lr": 2e-2, "weight_decay": 0.1, "betas": (0.8, 0.99)},
            {"params": list(net[2].parameters()) + list(net[4].parameters()), "eps": 1e-6},
        ],
        lr=1e-2,
        weight_decay=0.01,
        **kwargs,
    )


def options(**kwargs) -> OffloadOptions:
    kwargs.setdefault("bucket_size_mb", 2000 / 2**20)  # ~500 fp32 elements: several buckets
    kwargs.setdefault("cpu_threads", 2)
    kwargs.setdefault("overlap", True)  # the accelerator's path (the CPU device's default is off)
    return OffloadOptions(**kwargs)
