"""Shared cases of the parameter-offload tests: a small model of repeated blocks, put on FSDP2 with its
shards on the host, a one-rank process group, and the plain torch run they are compared with."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Blocks(nn.Module):
    """An input layer, four residual blocks in a ModuleList, a head: the shape of a transformer."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def two_groups(model: nn.Module) -> list[dict]:
    """Weights (lr 2e-2, weight decay 0.1) and the rest (lr 5e-3, no decay)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")], "lr": 2e-2, "weight_decay": 0.1},
        {"params": [p for n, p in named if not n.endswith("weight")], "lr": 5e-3, "weight_decay": 0.0},
    ]


def sharded_copy(model: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A copy of ``model`` with each block, then the root, fully_shard-ed, the shards on the host."""
    copied = copy.deepcopy(model).to(dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    for block in copied.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(copied, mesh=mesh, offload_policy=policy)
    return copied


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective at several ranks)."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


@contextmanager
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of this process alone (FSDP2 needs one, also at one rank)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def batches(steps: int, micro: int, rows: int = 8, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(rows, 8, generator=generator), torch.randn(rows, 1, generator=generator)) for _ in range(micro)]
        for _ in range(steps)
    ]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, micro: int) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean() / micro


def torch_adamw_run(
    model: nn.Module, data: list, clip_norm: float | None = None, clip_value: float | None = None
) -> dict[str, torch.Tensor]:
    """The reference: plain torch AdamW with torch's clipping, same groups and batches."""
    optimizer = torch.optim.AdamW(two_groups(model))
    for window in data:
        for x, y in window:
            loss_of(model, x, y, len(window)).backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest normwise relative difference over the tensors: ||got - want|| / ||want||."""
    return max(float((got[k].float() - w.float()).norm() / w.float().norm()) for k, w in want.items())
