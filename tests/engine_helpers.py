"""Small models, data and option presets for driving the offload engine directly in tests."""

import copy
from dataclasses import replace

import torch
from torch import nn

from lightning_zero_offload.core import make_offload_options
from lightning_zero_offload.engine import OffloadEngine, OffloadOptions

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
    """Engine options by the strategy's names (``dpu_warmup_steps=``, ...), or ``loss_scaler=`` as a whole."""
    kwargs.setdefault("bucket_size_mb", 2000 / 2**20)  # ~500 fp32 elements: several buckets
    kwargs.setdefault("cpu_threads", 2)
    if kwargs.get("in_place_on_cpu") is not True:  # in place nothing overlaps (setting it warns)
        kwargs.setdefault("overlap", True)  # the accelerator's path (the CPU device's default is off)
    kwargs.setdefault("in_place_on_cpu", False)  # the offload data path, even where fp32 on the CPU skips it
    scaler = kwargs.pop("loss_scaler", None)
    built = make_offload_options(**kwargs)
    return built if scaler is None else replace(built, loss_scaler=scaler)


class Layers(nn.Module):
    """A stack of layers, a head registered first, and a small layer that forward never calls (it shares
    the layout's first bucket with the last layer). ``backwards``: the layers run in the reverse of
    their registration order, so gradients arrive in the reverse of the layout's order."""

    def __init__(self, backwards: bool, n: int = 6, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backwards = backwards
        self.head = nn.Linear(width, 4)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers) if self.backwards else self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def layers_training(
    rank: int, world: int, steps: int = 4, device: torch.device = CPU
) -> tuple[list[int], list[torch.Tensor]]:
    """fp32 AdamW on ``Layers(backwards=False)``, this rank's share of each batch; (held-bucket peak per
    step, final master weights)."""
    net = Layers(backwards=False)
    engine = OffloadEngine(torch.optim.AdamW(net.parameters(), lr=1e-2), device, torch.float32, options())
    peaks = []
    for x, y in batches(steps):
        share = len(x) // world
        mine = slice(rank * share, (rank + 1) * share)
        loss_fn(net, (x[mine].to(device), y[mine].to(device))).backward()
        engine.step()
        peaks.append(engine.grads.take_device_buffer_peak())
    return peaks, engine.master_params()


def fp16_headroom(device: torch.device = CPU) -> tuple[float, bool]:
    """Each rank's fp16 gradient is 40000, their sum overflows fp16: (averaged gradient, overflow seen)."""
    p = nn.Parameter(torch.zeros(64))
    engine = OffloadEngine(torch.optim.AdamW([p]), device, torch.float16, options())
    (p.float() * 40000).sum().backward()
    engine.finish_backward()
    return float(engine.grad.host.max()), engine.grads.local_summary()[1]


def unfreezing(micro: int) -> dict:
    """Events of :func:`replan_training` (the first layer's requires_grad before the micro-batches named (step,
    micro-batch); "start": before any): frozen, then unfrozen before the last micro-batch of step 3 of 6 (mid-window
    when there are several)."""
    return {"start": False, (3, micro - 1): True}


# Frozen in the middle of the second window and unfrozen in the middle of the third (two micro-batches, four steps).
MID_WINDOW = {(1, 1): False, (2, 1): True}


def replan_training(
    rank: int, world: int, events: dict, steps: int, micro: int, clip: float | None = None, **engine_options
) -> dict:
    """AdamW on this rank's share of each batch in ``micro`` micro-batches, the first layer frozen or unfrozen as
    ``events`` say (each change re-planned at once), clipping at ``clip``; the full master weights and the optimizer
    state at the end."""
    net = make_net()
    net[0].requires_grad_(events.get("start", True))
    engine = OffloadEngine(two_groups(net), CPU, torch.float32, options(**engine_options))
    for index, (x, y) in enumerate(batches(steps)):
        share = len(x) // world
        mine = slice(rank * share, (rank + 1) * share)
        for part in range(micro):
            if (index, part) in events:
                net[0].requires_grad_(events[index, part])
                assert engine.replan_if_changed()
            engine.begin_backward()
            (loss_fn(net, (x[mine][part::micro], y[mine][part::micro])) / micro).backward()
            engine.finish_backward()
        engine.step(clip_norm=clip)
        engine.zero_grad()
    return {"weights": engine.master_params(), "state": engine.optimizer_state_dict()["state"]}


def replan_reference(events: dict, steps: int, micro: int, world: int = 1, clip: float | None = None) -> dict:
    """The same with torch's AdamW on whole batches (micro-batch k: every rank's k-th part); ``clip`` must fire."""
    net = make_net()
    net[0].requires_grad_(events.get("start", True))
    optimizer = two_groups(net)
    for index, (x, y) in enumerate(batches(steps)):
        share = len(x) // world
        ranks = [slice(rank * share, (rank + 1) * share) for rank in range(world)]
        for part in range(micro):
            if (index, part) in events:
                net[0].requires_grad_(events[index, part])
            batch = (torch.cat([x[r][part::micro] for r in ranks]), torch.cat([y[r][part::micro] for r in ranks]))
            (loss_fn(net, batch) / micro).backward()
        if clip is not None:
            assert (
                float(torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.grad is not None], clip)) > clip
            )
        optimizer.step()
        optimizer.zero_grad()
    return {"weights": [p.detach().clone() for p in net.parameters()], "state": optimizer.state_dict()["state"]}


# Layer index -> requires_grad, set before the step named ("start": before any). frozen_resume_training takes the
# optimizer's state dict before step FROZEN_RESUME_AT and loads it into a new net and optimizer.
FROZEN_STATE_SCENARIOS = {
    # trained, saved, resumed frozen (a schedule that freezes it for a while), unfrozen after the resume
    "frozen-when-loaded": {2: {0: False}, 6: {0: True}},
    # trained, frozen, then parked by a re-plan (another layer unfrozen) before the save; unfrozen after the resume
    "parked-when-saved": {"start": {2: False}, 2: {0: False}, 3: {2: True}, 6: {0: True}},
}
FROZEN_RESUME_AT = 5


def frozen_resume_training(
    rank: int, world: int, scenario: str, engine_options: dict | None, steps: int = 9, resume: bool = True
) -> dict:
    """``make_net`` with two param groups through a :data:`FROZEN_STATE_SCENARIOS` scenario, resumed from the weights
    and the optimizer's state dict (and the engine's counters) before step :data:`FROZEN_RESUME_AT` (``resume``): by
    torch's AdamW on whole batches (``engine_options`` None) or by the engine on this rank's share of each. That
    state dict, and the weights and the state dict at the end."""
    events = FROZEN_STATE_SCENARIOS[scenario]
    trainable = dict(events.get("start", {}))

    def build(weights: list[torch.Tensor] | None = None):
        net = make_net(seed=3)  # other weights than the run's: they come from the "checkpoint"
        if weights is None:
            net = make_net()
        else:
            with torch.no_grad():
                for p, w in zip(net.parameters(), weights):
                    p.copy_(w)
        for layer, flag in trainable.items():
            net[layer].requires_grad_(flag)
        optimizer = two_groups(net)
        if engine_options is None:
            return net, optimizer
        return net, OffloadEngine(optimizer, CPU, torch.float32, options(**engine_options))

    def weights_and_state(net, optimizer) -> tuple[list[torch.Tensor], dict, dict | None]:
        if engine_options is None:  # torch's state dict is not a copy
            return [p.detach().clone() for p in net.parameters()], copy.deepcopy(optimizer.state_dict()), None
        state, counters = optimizer.optimizer_state_dict(), optimizer.state_dict()
        optimizer.close()  # the parameters hold the master weights
        return [p.detach().clone() for p in net.parameters()], state, counters

    net, optimizer = build()
    saved = {"state": None}
    for index, (x, y) in enumerate(batches(steps)):
        if index == FROZEN_RESUME_AT and resume:
            weights, saved, counters = weights_and_state(net, optimizer)
            net, optimizer = build(weights)
            load = optimizer.load_optimizer_state_dict if engine_options is not None else optimizer.load_state_dict
            load(copy.deepcopy(saved))  # torch's load keeps the tensors it is given, and steps them in place
            if counters is not None:  # the bf16 state's rounding seed among them
                optimizer.load_state_dict(counters)
        for layer, flag in events.get(index, {}).items():
            trainable[layer] = flag
            net[layer].requires_grad_(flag)
        mine = slice(None)
        if engine_options is not None:
            optimizer.replan_if_changed()
            share = len(x) // world
            mine = slice(rank * share, (rank + 1) * share)
        loss_fn(net, (x[mine], y[mine])).backward()
        optimizer.step()
        optimizer.zero_grad()
    weights, state, _ = weights_and_state(net, optimizer)
    return {"saved": saved["state"], "weights": weights, "state": state["state"]}


class DelayedReference:
    """``cpu_step="delayed"`` with writes between steps, as docs/usage.md states it, in plain torch.

    ``optimizer`` steps the fp32 master copies (its parameters, in the order of ``device``, the parameters
    the forward uses, in the device dtype). The update of step t runs before step t+1's forward, with
    step t's learning rates; then every element written since step t (its device value differs from what
    the device was given) takes the written value. The result is given to the device at step t+1 (with
    prediction ``w_t + (w_t - w_{t-1})``, written elements as written). Without an update pending, a
    write is merged at the step, as in sync. With CPUAdam (the engine's kernel) it is bitwise the engine.
    """

    def __init__(self, device: list[torch.Tensor], optimizer: torch.optim.Optimizer, warmup: int, prediction: bool):
        self.device = device
        self.opt = optimizer
        self.master = [p for group in optimizer.param_groups for p in group["params"]]
        self.warmup, self.prediction = warmup, prediction
        self.published = [p.detach().clone() for p in device]
        self.pending: tuple[list[torch.Tensor], list[float]] | None = None  # gradients and learning rates
        self.next: list[torch.Tensor] | None = None
        self.steps = 0

    def before_forward(self) -> None:
        if self.pending is None:
            return
        grads, lrs = self.pending
        self.pending = None
        written = [d.detach() != p for d, p in zip(self.device, self.published)]
        before = [m.detach().clone() for m in self.master]
        self._update(grads, lrs)
        extrapolate = 1.0 if self.prediction else 0.0
        self.next = [(m + extrapolate * (m - b)).to(d.dtype) for m, b, d in zip(self.master, before, self.device)]
        for m, n, d, w in zip(self.master, self.next, self.device, written):
            m.data[w] = d.detach()[w].float()
            n[w] = d.detach()[w]

    def step(self, lrs: list[float] | None = None) -> None:
        """After backward; ``lrs``: each param group's learning rate for this step (default: the optimizer's)."""
        lrs = lrs or [group["lr"] for group in self.opt.param_groups]
        grads = [p.grad.float() for p in self.device]
        for p in self.device:
            p.grad = None
        self.before_forward()  # a no-op where the forward started it
        if self.next is None:  # no update pending: a write since the last step is merged here, as in sync
            for m, d, p in zip(self.master, self.device, self.published):
                written = d.detach() != p
                m.data[written] = d.detach()[written].float()
            self.published = [d.detach().clone() for d in self.device]
        else:
            self._give(self.next)
            self.next = None
        if self.steps < self.warmup:
            self._update(grads, lrs)
            self._give([m.detach() for m in self.master])
        else:
            self.pending = grads, lrs
        self.steps += 1

    def finish(self) -> list[torch.Tensor]:
        """The end of fit: the pending update lands, the last write kept; returns the master weights."""
        self.before_forward()
        return [m.detach() for m in self.master]

    def _update(self, grads: list[torch.Tensor], lrs: list[float]) -> None:
        for m, g in zip(self.master, grads):
            m.grad = g
        for group, lr in zip(self.opt.param_groups, lrs):
            group["lr"] = lr
        self.opt.step()
        self.opt.zero_grad()

    def _give(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for d, v in zip(self.device, values):
                d.copy_(v)
        self.published = [d.detach().clone() for d in self.device]


CLIP = 0.05  # below the gradients' norm of make_net on batches(): clipping fires at every step


def train_clipped(
    cpu_state="fp32", dtype=torch.float32, steps=4, accumulate=2, clip=CLIP, rank=0, world=1, share_floor=None, **kw
) -> tuple[nn.Module, OffloadEngine]:
    """The MLP with two param groups, ``steps`` clipped steps of ``accumulate`` micro-batches, this rank's part of
    each batch (``world`` ranks), engine ``options(**kw)``; seeded so the bf16 state's rounding is the same."""
    torch.manual_seed(7)  # the bf16 state's rounding seed
    net = make_net().to(dtype)
    engine = OffloadEngine(two_groups(net), CPU, dtype, options(cpu_state=cpu_state, **kw), share_floor=share_floor)
    data = batches(steps * accumulate)
    for step in range(steps):
        for micro in range(accumulate):
            x, y = data[step * accumulate + micro]
            mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
            engine.expect_step(micro == accumulate - 1, publish_early=True)
            engine.begin_backward()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
                loss_fn(net, (x[mine].to(dtype), y[mine])).backward()
            engine.finish_backward()
        engine.step(clip_norm=clip)
    engine.sync()
    return net, engine


def moments(engine: OffloadEngine) -> list[torch.Tensor]:
    """Every parameter's exp_avg and exp_avg_sq, in the optimizer's order."""
    state = engine.optimizer_state_dict()["state"]
    return [t for entry in state.values() for t in (entry["exp_avg"], entry["exp_avg_sq"])]
