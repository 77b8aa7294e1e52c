"""Users' code during fit at two gloo ranks: each case under zero_offload and under its reference.

Run by tests/trainer/test_user_code_ranks.py: one launch of two processes (the tests' rank launcher) runs every
case in sequence, and every rank returns every case's results. The models and callbacks are
tests/trainer/test_user_code.py's and tests/trainer/test_user_optimizers.py's.

The reference is Lightning's DDP at two ranks with the same per-rank batch and the same data split
(rank r takes samples r, r + 2, ... of every global batch, under both strategies). Where DDP itself
cannot be the reference, the reference is ``strategy="auto"`` in one process on the same global batch:
parameters unfrozen after DDP wrapped the module are not in its reducer, so each DDP rank trains them
on its own gradients and the ranks drift apart, while one process on the global batch is what two
synchronised ranks compute.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers import QUIET, Classifier, loader  # noqa: E402
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging, WeightAveraging  # noqa: E402
from torch import nn  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402
from user_code_helpers import (  # noqa: E402
    AdamWWithDefaults,
    Backbone,
    ClampThroughParameter,
    ClampWeights,
    HookedTiny,
    LoadStateMidFit,
    ReassignData,
    Tiny,
    UnfreezeAt,
    UnusedAndTwoLosses,
    data,
    frozen_backbone,
)

from lightning_zero_offload import ZeroOffloadStrategy  # noqa: E402

# The offload path at two ranks, per schedule; buckets of ~500 fp32 elements, so a write to one layer
# changes some buckets and not others.
SCHEDULES = {"sync": {"cpu_step": "sync"}, "speculative": {"cpu_step": "speculative"}}
BUCKET_MB = 0.002
Result = dict[str, Any]


def zero(**options: Any) -> ZeroOffloadStrategy:
    # One CPU thread per process, what each of two ranks gets on two cores; the one-process reference of
    # the delayed cases runs with the same.
    return ZeroOffloadStrategy(in_place_on_cpu=False, bucket_size_mb=BUCKET_MB, cpu_threads=1, **options)


def split(data: DataLoader, devices: int) -> DataLoader:
    """This rank's part of each batch of ``data`` (samples rank, rank + devices, ...): ``devices`` ranks
    together see the batches of ``data`` with ``devices`` times its batch size, in order. Lightning's own
    split would shuffle, and one process could not see the same global batches."""
    if devices == 1:
        return data
    sampler = DistributedSampler(data.dataset, num_replicas=devices, rank=dist.get_rank(), shuffle=False)
    return DataLoader(data.dataset, batch_size=data.batch_size, sampler=sampler)


def train(
    strategy: Any,
    model: L.LightningModule | None = None,
    callbacks: tuple[L.Callback, ...] = (),
    *,
    devices: int = 2,
    batch_size: int = 8,
    train_data: Callable[[int], DataLoader] = lambda batch_size: loader(batch_size=batch_size),
    val: bool = False,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> tuple[L.LightningModule, L.Trainer]:
    """test_user_code.fit at ``devices`` ranks, ``batch_size`` samples per rank and step (``train_data``
    makes the loader for a batch size)."""
    model = model or Classifier(scheduler=False, lr=3e-2)
    kwargs = {**QUIET, "devices": devices, "precision": "32-true", "max_steps": 12, **trainer_kwargs}
    trainer = L.Trainer(strategy=strategy, callbacks=list(callbacks), use_distributed_sampler=False, **kwargs)
    val_data = loader(n=16, batch_size=batch_size) if val else None
    trainer.fit(model, split(train_data(batch_size), devices), val_data, ckpt_path=ckpt_path)
    return model, trainer


def tiny_data(batch_size: int) -> DataLoader:
    """test_user_optimizers' data for ``Tiny`` at a batch size."""
    return DataLoader(data().dataset, batch_size=batch_size)


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in model.parameters()]


def on_offload_path(trainer: L.Trainer) -> None:
    session = trainer.strategy.session
    assert not session.resolved.in_place and session.world_size == 2 and len(session.engine.layout.buckets) > 1


# -- writes into the parameters ----------------------------------------------------------------------


class Seen(L.Callback):
    """Listed before the user's callback, it sees what that callback is given: the largest weight after
    each step (before a clamp), and the weights when training ends (before an average is copied in)."""

    def __init__(self) -> None:
        self.largest: list[float] = []
        self.last: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.largest.append(max(float(p.detach().abs().max()) for p in pl_module.parameters()))

    def on_train_end(self, trainer, pl_module):
        self.last = weights(pl_module)


def with_callback(
    make: Callable[[], L.Callback], epochs: int = 1, precision: str = "32-true", schedules: tuple[str, ...] = ()
) -> Callable[[], Result]:
    """A callback that writes the parameters, under DDP and each schedule (default: all), ``epochs`` of
    10 steps; what the callback was given under DDP (``Seen``) too."""

    def case() -> Result:
        length = {"max_steps": -1, "max_epochs": epochs, "precision": precision}
        seen = Seen()
        runs: Result = {"ddp": weights(train("ddp", callbacks=(seen, make()), **length)[0])}
        runs |= {"ddp-largest-before": seen.largest, "ddp-last-before": seen.last}
        for name in schedules or SCHEDULES:
            model, trainer = train(zero(**SCHEDULES[name]), callbacks=(make(),), **length)
            on_offload_path(trainer)
            runs[name] = weights(model)
        return runs

    return case


def ema() -> WeightAveraging:
    return WeightAveraging(avg_fn=torch.optim.swa_utils.get_ema_avg_fn(0.8))


def swa() -> StochasticWeightAveraging:
    return StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)


# cpu_step="delayed" after a warm-up of 3 steps: each update lands one step late, so DDP is no reference;
# the test compares two ranks with one process on the global batch (``delayed_one_process``).
DELAYED = {"cpu_step": "delayed", "dpu_warmup_steps": 3}


def delayed(make: Callable[[], L.Callback], devices: int = 2) -> Result:
    """A writing callback under the delayed update, 12 steps, the global batch split over ``devices``."""
    model, trainer = train(zero(**DELAYED), callbacks=(make(),), devices=devices, batch_size=16 // devices)
    assert trainer.strategy.session.resolved.cpu_step == "delayed"
    return {"delayed": weights(model)}


DELAYED_CASES = {
    "clamp-data": ClampWeights,
    "reassign-data": ReassignData,
    "load-state-dict": LoadStateMidFit,
    "weight-averaging": ema,
}


def delayed_one_process() -> dict[str, Result]:
    """The delayed reference: each of ``DELAYED_CASES`` in this process, alone (no process group)."""
    return {name: delayed(make, devices=1) for name, make in DELAYED_CASES.items()}


class SaveAtEpochEnd(L.Callback):
    """Saves a checkpoint at the end of the first epoch, after ClampWeights' write of its last batch
    (callbacks run in list order) and before any engine step could absorb it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


def resume_after_a_write(tmp: Path) -> Callable[[], Result]:
    """ClampWeights under sync: saved after the first epoch, resumed for a second one (the uninterrupted
    2 epochs are the "clamp-data" case's sync run)."""

    def case() -> Result:
        path = tmp / "clamped.ckpt"
        train(zero(**SCHEDULES["sync"]), callbacks=(ClampWeights(), SaveAtEpochEnd(path)), max_steps=-1, max_epochs=1)
        length = {"max_steps": -1, "max_epochs": 2, "ckpt_path": str(path)}
        resumed, trainer = train(zero(**SCHEDULES["sync"]), callbacks=(ClampWeights(),), **length)
        return {"resumed": weights(resumed), "steps": trainer.global_step}

    return case


# -- the trainable set ------------------------------------------------------------------------------


def unfreezing(add_group: bool) -> Callable[[], Result]:
    """test_user_code's frozen backbone unfrozen at step 4 of 8 (``requires_grad_``, with ``add_group``
    also a param group of its own); the reference is auto in one process on the global batch (see the top)."""

    def run(strategy: Any, **kwargs: Any) -> nn.Module:
        model = frozen_backbone()
        model.configure_optimizers = lambda: torch.optim.AdamW(
            model.head.parameters() if add_group else model.parameters(), lr=1e-2
        )
        return train(strategy, model, (UnfreezeAt(4, add_group),), max_steps=8, **kwargs)[0]

    def case() -> Result:
        runs = {"auto-global-batch": weights(run("auto", devices=1, batch_size=16))}
        runs |= {name: weights(run(zero(**options))) for name, options in SCHEDULES.items()}
        return runs

    return case


def backbone_finetuning() -> Result:
    """Lightning's BackboneFinetuning (unfreezes and adds a param group at epoch 1), 2 epochs of 10 steps."""

    def run(strategy: Any, **kwargs: Any) -> nn.Module:
        model = Backbone()
        model.configure_optimizers = lambda: torch.optim.AdamW(
            filter(lambda p: p.requires_grad, model.parameters()), lr=1e-2
        )
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)
        return train(strategy, model, (finetuning,), max_steps=-1, max_epochs=2, **kwargs)[0]

    runs = {"auto-global-batch": weights(run("auto", devices=1, batch_size=16))}
    runs |= {name: weights(run(zero(**options))) for name, options in SCHEDULES.items()}
    runs["start"] = weights(Backbone())
    return runs


# -- the optimizer -----------------------------------------------------------------------------------


def hooked(strategy: Any) -> Result:
    """HookedTiny's per-optimizer hooks (the pre-hook sets the LR) and global hooks, 5 steps of 2 micro-batches."""
    global_calls: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: global_calls.append("global pre")),
        register_optimizer_step_post_hook(lambda opt, args, kwargs: global_calls.append("global post")),
    ]
    try:
        model = HookedTiny()
        _, trainer = train(
            strategy, model, train_data=tiny_data, accumulate_grad_batches=2, limit_train_batches=10, max_steps=5
        )
    finally:
        for handle in handles:
            handle.remove()
    return {
        "weights": weights(model),
        "calls": model.calls,
        "global_calls": global_calls,
        "steps": trainer.global_step,
        "users_optimizer": all(opt is model.optimizer_made for opt in model.hook_optimizers),
    }


def step_hooks() -> Result:
    return {"ddp": hooked("ddp")} | {name: hooked(zero(**options)) for name, options in SCHEDULES.items()}


def subclass() -> Result:
    """An AdamW subclass that overrides only ``__init__``: AdamW's update, as under DDP."""
    runs = {"ddp": weights(train("ddp", Tiny(AdamWWithDefaults), train_data=tiny_data, max_steps=5)[0])}
    for name, options in SCHEDULES.items():
        runs[name] = weights(train(zero(**options), Tiny(AdamWWithDefaults), train_data=tiny_data, max_steps=5)[0])
    return runs


# -- backward calls, validation, unused parameters ----------------------------------------------------


class ValidationPositions(L.Callback):
    """The number of the batch (within its accumulation window of 3) after which each validation ran."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self._batches = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._batches += 1

    def on_validation_start(self, trainer, pl_module):
        if self._batches:  # not the sanity check before training
            self.positions.append(self._batches % 3)


def unused_and_backward_calls(manual: bool) -> Callable[[], Result]:
    """UnusedAndTwoLosses (a layer forward never calls): ``manual``, two backward calls per step; else
    validation every 4 batches inside accumulation windows of 3. DDP needs find_unused_parameters."""

    def case() -> Result:
        kwargs = {"max_steps": 8}
        if not manual:
            kwargs |= {"accumulate_grad_batches": 3, "val_check_interval": 4, "limit_val_batches": 2, "val": True}
        runs: Result = {"start_unused": UnusedAndTwoLosses(manual).unused.weight.detach().clone()}
        ddp = [("ddp", "ddp_find_unused_parameters_true")]
        for name, strategy in ddp + [(name, zero(**options)) for name, options in SCHEDULES.items()]:
            positions = ValidationPositions()
            model = train(strategy, UnusedAndTwoLosses(manual), (positions,), **kwargs)[0]
            unused = model.unused.weight.detach().clone()
            runs[name] = {"weights": weights(model), "unused": unused, "validation_positions": positions.positions}
        return runs

    return case


def cases(tmp: Path) -> dict[str, Callable[[], Result]]:
    """Every case, in the order they run."""
    return {
        "clamp-data": with_callback(ClampWeights, epochs=2),
        "clamp-through-parameter": with_callback(ClampThroughParameter),
        "reassign-data": with_callback(ReassignData),
        "load-state-dict": with_callback(LoadStateMidFit),
        "resume-after-a-write": resume_after_a_write(tmp),
        "weight-averaging": with_callback(ema),
        "stochastic-weight-averaging": with_callback(swa, epochs=3),
        "bf16-clamp": with_callback(ClampWeights, precision="bf16-mixed", schedules=("sync",)),
        "bf16-weight-averaging": with_callback(ema, precision="bf16-mixed", schedules=("sync",)),
        **{f"delayed-{name}": functools.partial(delayed, make) for name, make in DELAYED_CASES.items()},
        "unfreeze-requires-grad": unfreezing(add_group=False),
        "unfreeze-add-param-group": unfreezing(add_group=True),
        "backbone-finetuning": backbone_finetuning,
        "step-hooks": step_hooks,
        "subclass": subclass,
        "two-backward-calls": unused_and_backward_calls(manual=True),
        "validation-mid-window": unused_and_backward_calls(manual=False),
    }


def run_cases(tmp: str, rank: int) -> dict[str, Result]:
    """Every case on this rank (inside the launcher's process group), by name.

    A case that raises gets ``{"error": traceback}`` and ends the run: zero_offload releases the process
    group after a failure, so the cases after it could not run.
    """
    # What Lightning reads to know its processes were started outside it (it then launches none and
    # joins the existing process group).
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(dist.get_world_size()))
    results: dict[str, Result] = {}
    for name, case in cases(Path(tmp)).items():
        try:
            results[name] = case()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            break
    return results
