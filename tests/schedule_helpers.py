"""The schedules' test network and run, driven as the strategy drives the engine: shared by
tests/engine/schedules/ at one rank and tests/workers/schedules.py at two."""

from __future__ import annotations

import torch
from engine_helpers import CPU, batches, options
from torch import nn

from lightning_zero_offload.engine import OffloadEngine, StepStats


class Net(nn.Module):
    """Two param groups, a tied weight, a frozen layer and a layer that gets no gradient on odd steps."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 32)
        self.frozen = nn.Linear(32, 32).requires_grad_(False)
        self.hidden = nn.Linear(32, 32)
        self.tied = nn.Linear(32, 32, bias=False)
        self.out = nn.Linear(32, 4)
        self.unused_on_odd = nn.Linear(32, 4)
        self.poison = False  # inf gradient for the first layer only: later layers' buckets stay finite

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.inp(x)
        if self.poison and h.requires_grad:
            h.register_hook(lambda g: g * float("inf"))
        h = torch.nn.functional.gelu(h)
        h = torch.nn.functional.gelu(self.hidden(self.frozen(h)))
        h = self.tied(torch.tanh(self.tied(h)))  # one parameter used twice
        return self.out(h) + (self.unused_on_odd(h) if step % 2 == 0 else 0)

    def optimizer(self) -> torch.optim.Optimizer:
        first = [*self.inp.parameters(), *self.hidden.parameters(), *self.frozen.parameters()]
        second = [*self.tied.parameters(), *self.out.parameters(), *self.unused_on_odd.parameters()]
        return torch.optim.AdamW(
            [{"params": first, "weight_decay": 0.1, "betas": (0.8, 0.99)}, {"params": second, "lr": 3e-2}],
            lr=1e-2,
            weight_decay=0.01,
        )


def warmup(cpu_step: str) -> dict:
    """Two warm-up steps for the delayed update (the option has no effect on the other schedules)."""
    return {"dpu_warmup_steps": 2} if cpu_step == "delayed" else {}


def train(
    cpu_step: str,
    dtype: torch.dtype = torch.bfloat16,
    steps: int = 12,
    accumulate: int = 2,
    clip_norm: float | None = None,
    clip_value: float | None = None,
    inf_at: int | None = None,
    spike: tuple[int, float] | None = None,
    announce_every_backward: bool = False,
    rank: int = 0,
    **kwargs,
) -> tuple[OffloadEngine, Net, list[StepStats]]:
    net = Net()
    engine = OffloadEngine(net.optimizer(), CPU, dtype, options(cpu_step=cpu_step, **warmup(cpu_step), **kwargs))
    data = batches(steps * accumulate, seed=3 + rank)
    history = []
    for step in range(steps):
        for micro in range(accumulate):
            x, y = data[step * accumulate + micro]
            if micro == accumulate - 1 or announce_every_backward:
                engine.expect_step(publish_early=True)
            engine.begin_backward()
            net.poison = step == inf_at and micro == accumulate - 1
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                # with two ranks the odd-step layer gets a gradient on one of them only
                loss = nn.functional.cross_entropy(net(x, step + rank).float(), y) / accumulate
            if spike is not None and step == spike[0]:
                loss = loss * spike[1]  # one step's gradient this many times its usual size
            engine.scale_loss(loss).backward()
            engine.finish_backward()
        history.append(engine.step(clip_norm=clip_norm, clip_value=clip_value))
        for group in engine.optimizer.param_groups:
            group["lr"] *= 0.9  # an LR scheduler: hyperparameters change every step
    return engine, net, history


def snapshot(engine: OffloadEngine, net: Net) -> list[torch.Tensor]:
    engine.sync()
    state = engine.optimizer_state_dict()["state"]
    moments = [t for entry in state.values() for t in (entry["exp_avg"], entry["exp_avg_sq"])]
    return [*engine.master_params(), *moments, *(p.detach().clone() for p in net.parameters())]
