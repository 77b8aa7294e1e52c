"""The engine's optimizer state in and out: flat CPU shards <-> full per-parameter tensors in torch's format.

At several ranks a full-format save gathers nothing up front: inside :func:`buffers_shared_for_save`,
:func:`full_tensors` returns views of placeholders (tensors on the meta device) for the gathered buckets,
whose bytes rank 0's writer fetches as it writes them (checkpoints/streamed.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_zero_offload.engine.infra.collectives import gather_host
from lightning_zero_offload.engine.optimizer_support import optimizer_params
from lightning_zero_offload.engine.step.cpu_state import MOMENTS, CpuState
from lightning_zero_offload.engine.step.shard_buffer import ShardBuffer
from lightning_zero_offload.warning import ZeroOffloadWarning

if TYPE_CHECKING:
    from lightning_zero_offload.engine.step.layout import Layout
    from lightning_zero_offload.engine.step.parts import ShardedState


def load_shard(layout: Layout, shard: ShardBuffer | torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy this rank's part of full per-parameter tensors into a flat shard buffer (converted to its dtype)."""
    for index, tensor in enumerate(tensors):
        load_param_shard(layout, shard, index, tensor)


def load_param_shard(layout: Layout, shard: ShardBuffer | torch.Tensor, index: int, tensor: torch.Tensor) -> None:
    """Copy this rank's part of parameter ``index``'s full tensor into a flat shard buffer (converted)."""
    flat = tensor.reshape(-1)
    for seg in layout.segments_of(index):
        shard[seg.shard_start : seg.shard_end].copy_(flat[seg.param_start : seg.param_start + seg.numel])


@contextmanager
def buffers_shared_for_save(engine: ShardedState, share: bool = True, streamed: bool = False) -> Iterator[None]:
    """Inside: :func:`full_tensors` returns views instead of copies, for a save that writes them at once.

    A full-format save would otherwise hold a second copy of the weights and both moments (12 bytes
    per parameter of fp32 state, 6 of bf16) while it writes. With one rank the views are of the engine's flat buffers
    (``torch.save`` writes each buffer's storage once, and the file still loads with
    ``weights_only=True``); a device share's buckets are copied to the host, or with ``streamed`` (this package's
    writer, which takes placeholders) are placeholders copied one run at a time as the writer reaches them. With
    several ranks they are views of placeholders on the meta device, one per gathered bucket, whose bytes rank 0's
    writer gathers as it writes them (checkpoints/streamed.py): every rank must then take part in that save. Only
    for a writer that finishes before the next step changes the buffers: an asynchronous ``CheckpointIO`` must get
    copies (``share=False``).
    """
    sharing = engine.save_sharing
    previous = sharing.share, sharing.streamed
    sharing.share, sharing.streamed = share or previous[0], (share and streamed) or previous[1]
    try:
        yield
    finally:
        sharing.share, sharing.streamed = previous


def full_tensors(engine: ShardedState, shard: ShardBuffer | torch.Tensor) -> list[torch.Tensor]:
    """Assemble full per-parameter tensors from every rank's shard (a collective if sharded).

    Copies, unless inside :func:`buffers_shared_for_save` (then views that change with the next step, or views of
    placeholders: at several ranks, and at one for a device share's buckets in a streamed save).
    """
    engine.refuse_after_failure("full weights and optimizer state")
    share = engine.save_sharing.share
    full: list[torch.Tensor | None] = [None] * len(engine.params)
    for index, view in _full_runs(engine, shard, engine.layout):
        full[index] = view if share else view.clone()
    return full  # type: ignore[return-value]


def _full_runs(
    engine: ShardedState, shard: ShardBuffer | torch.Tensor, layout: Layout
) -> Iterator[tuple[int, torch.Tensor]]:
    """Each parameter of ``layout`` with its full tensor from every rank's ``shard``, one bucket run at a time (a
    collective per run if sharded): views of the run gathered to the host, valid until the next run is read."""
    share = engine.save_sharing.share
    for run in layout.bucket_runs():  # buckets joined by a split parameter, gathered together
        buckets = [layout.buckets[b] for b in run]
        ranges = [bucket.shard_range for bucket in buckets]
        on_device = isinstance(shard, ShardBuffer) and ranges[-1].stop > shard.split
        if layout.world_size == 1 and not (share and engine.save_sharing.streamed and on_device):
            whole = _whole_run(shard, ranges)
        elif share:  # copied to the host (several ranks: gathered to rank 0) only when the writer reaches it
            whole = engine.save_sharing.placeholders.add(shard, ranges, layout.world_size)
        else:
            gathered = [gather_host(shard[r], engine.process_group, engine.device) for r in ranges]
            whole = gathered[0] if len(gathered) == 1 else torch.cat(gathered)
        start = buckets[0].flat_start
        for index in dict.fromkeys(i for bucket in buckets for i in bucket.param_indices):
            slot = layout.slots[index]
            yield index, whole[slot.flat_start - start : slot.flat_start - start + slot.numel].view(slot.shape)


@dataclass(frozen=True)
class Replaced:
    """What a re-plan lays out again: the old layout, its state and trainable parameters (their dtypes as
    built), and whether the window in progress has gradients to carry (its source's ``has_grad``)."""

    layout: Layout
    state: CpuState
    params: list[torch.nn.Parameter]
    dtypes: list[torch.dtype]
    has_grad: list[bool]

    @property
    def with_gradient(self) -> set[int]:
        """Ids of the parameters with a gradient in the window in progress: the new layout keeps them, frozen or
        not, so that the step uses it as torch's AdamW steps a ``.grad`` (a later re-plan lets the frozen ones go)."""
        return {id(p) for p, has in zip(self.params, self.has_grad) if has}


def fill_state(engine: ShardedState, replaced: Replaced | None) -> list[torch.dtype]:
    """Fill ``engine.state``, new: from the parameters' values (the master; fresh moments), or carried over from the
    state a re-plan ``replaced`` (made without buffers: :func:`carry_state`). Returns each parameter's dtype as
    built (what it goes back to when the engine lets it go)."""
    if replaced is None:
        load_shard(engine.layout, engine.state.master, [p.detach() for p in engine.params])
        return [p.dtype for p in engine.params]
    carry_state(engine, replaced)
    built = {id(p): dtype for p, dtype in zip(replaced.params, replaced.dtypes)}
    return [built.get(id(p), p.dtype) for p in engine.params]


def carry_state(engine: ShardedState, old: Replaced) -> None:
    """Fill ``engine.state`` (laid out for ``engine.params``, made without buffers) from ``old``'s, one buffer at a
    time, each old one dropped when its successor is full (the gradient buffer first where the window has none),
    read one bucket run at a time: never a copy of the whole state, which a host sized for training could not hold.
    A parameter that stays keeps its master, moments, step count and this window's gradient bitwise (its device
    value stays in the old flat buffer until the new one is built); one that leaves gets its master as a device
    tensor of its own and its moments and step count parked; one that comes (back) starts from its current value
    with its parked moments and step count, or fresh ones, as torch's AdamW does."""
    state, parked = engine.state, engine.parked
    index_of = {id(p): j for j, p in enumerate(engine.params)}
    moved = [index_of.get(id(p)) for p in old.params]  # each old parameter's new index (None: it leaves)
    stayed = set(moved)
    came = [j for j in range(len(engine.params)) if j not in stayed]
    carries_grad = state.keeps_grad and any(old.has_grad)
    if not carries_grad:
        old.state.grad = None
    for name in ["master", *MOMENTS] + (["grad"] if state.keeps_grad else []):
        setattr(state, name, _carried_buffer(engine, old, name, moved, came, name != "grad" or carries_grad))
        setattr(old.state, name, None)  # freed, unless a part not rebuilt yet holds it (in place: the views)
    steps = [0] * len(engine.params)
    for i, (j, step) in enumerate(zip(moved, old.state.steps)):
        if j is None:
            parked.park(old.params[i], "step", step)
        else:
            steps[j] = step
    for j in came:
        steps[j] = int(parked.take(engine.params[j], "step") or 0)
    state.load_steps(steps)


def _carried_buffer(
    engine: ShardedState,
    old: Replaced,
    name: str,
    moved: list[int | None],
    came: list[int],
    read_old: bool,
) -> ShardBuffer:
    """The new layout's buffer ``name``, filled (:func:`carry_state`); nothing of the old one referenced after."""
    buffer, layout, parked = engine.state.new_buffer(), engine.layout, engine.parked
    for i, full in _full_runs(engine, getattr(old.state, name), old.layout) if read_old else ():
        j, p = moved[i], old.params[i]
        if name == "master" and j is None:  # its weights, out of the flat buffer, into a device tensor of their own
            p.data = full.to(device=engine.device, dtype=old.dtypes[i], copy=True)
        if j is not None and (name != "grad" or old.has_grad[i]):  # a bucket with none may hold an older window's
            load_param_shard(layout, buffer, j, full)
        elif name in MOMENTS:
            parked.park(p, name, full.clone())
    for j in came:
        p = engine.params[j]
        value = p.detach() if name == "master" else parked.take(p, name) if name in MOMENTS else None
        if value is not None:
            load_param_shard(layout, buffer, j, value)
    return buffer


def _whole_run(shard: ShardBuffer | torch.Tensor, ranges: list[slice]) -> torch.Tensor:
    """One rank: a run of buckets from the shard, on the host (a device-share bucket is copied there). A view
    unless the device share starts inside the run (at one rank the run is contiguous: no padding inside it)."""
    start, stop = ranges[0].start, ranges[-1].stop
    split = shard.split if isinstance(shard, ShardBuffer) else stop
    if stop <= split or start >= split:
        return shard[start:stop].cpu()
    return torch.cat([shard[r].cpu() for r in ranges])


def param_groups_state(engine: ShardedState) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters, numbered as in ``torch.optim.Optimizer.state_dict``."""
    groups = []
    counter = 0
    for group in engine.optimizer.param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = list(range(counter, counter + len(group["params"])))
        counter += len(group["params"])
        groups.append(saved)
    return groups


def optimizer_state_dict(engine: ShardedState) -> dict[str, Any]:
    """The optimizer state in ``torch.optim.AdamW``'s format (full tensors, collective when sharded)."""
    exp_avg = full_tensors(engine, engine.state.exp_avg)
    exp_avg_sq = full_tensors(engine, engine.state.exp_avg_sq)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, torch_index in enumerate(engine.torch_index):
        if engine.state.steps[index] > 0:
            state[torch_index] = _entry(engine.state.steps[index], exp_avg[index], exp_avg_sq[index])
    state.update(parked_state(engine))
    return {"state": dict(sorted(state.items())), "param_groups": param_groups_state(engine)}


def _entry(step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(float(step), dtype=torch.float32), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def parked_state(engine: ShardedState) -> dict[int, dict[str, torch.Tensor]]:
    """The state of the optimizer's parameters that are not trainable now but stepped before (frozen since, or
    frozen when a checkpoint was loaded), in torch's format: torch's AdamW keeps it, in memory and in its state
    dict, and uses it again when the parameter is unfrozen. The same full tensors on every rank."""
    state = {}
    for torch_index, param in enumerate(optimizer_params(engine.optimizer)):
        parked = engine.parked.entry(param)
        step = int(parked.get("step", 0))
        if step > 0:
            state[torch_index] = _entry(step, parked["exp_avg"], parked["exp_avg_sq"])  # type: ignore[arg-type]
    return state


def note_state_conversion(kept: torch.dtype, saved: list[torch.dtype], stacklevel: int = 4) -> None:
    """One line when the moments come in another dtype than the state's (a cpu_state change between runs)."""
    other = next((dtype for dtype in saved if dtype != kept), None)
    if other is None:
        return
    how = "rounded to nearest (this resume is not bitwise)" if kept == torch.bfloat16 else "widened exactly"
    warnings.warn(
        f"zero_offload: the checkpoint's optimizer state is {other}, this run's cpu_state keeps {kept}: "
        f"converted, {how}.",
        ZeroOffloadWarning,
        stacklevel=stacklevel,
    )


def load_optimizer_state_dict(engine: ShardedState, state_dict: dict[str, Any]) -> None:
    """Load a state in torch Adam/AdamW format (from this engine, torch, or CPUAdam)."""
    optimizer = engine.optimizer
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups) or any(
        len(saved["params"]) != len(group["params"]) for saved, group in zip(groups, optimizer.param_groups)
    ):
        raise ValueError(
            "The checkpoint's optimizer has a different number of param groups or parameters per group than "
            "the one returned by configure_optimizers; build the optimizer the same way as when it was saved"
        )
    state = {int(k): v for k, v in state_dict["state"].items()}
    note_state_conversion(engine.state.dtype, [entry["exp_avg"].dtype for entry in state.values()])
    exp_avg, exp_avg_sq, steps = [], [], []
    for index, torch_index in enumerate(engine.torch_index):
        entry = state.get(torch_index)
        shape = engine.params[index].shape
        if entry is None:
            steps.append(0)
            exp_avg.append(torch.zeros(shape, dtype=engine.state.dtype))
            exp_avg_sq.append(torch.zeros(shape, dtype=engine.state.dtype))
            continue
        _check_shape(entry, torch_index, shape)
        steps.append(int(float(entry["step"])))
        exp_avg.append(entry["exp_avg"])
        exp_avg_sq.append(entry["exp_avg_sq"])
    engine.state.load_steps(steps)
    load_shard(engine.layout, engine.state.exp_avg, exp_avg)
    load_shard(engine.layout, engine.state.exp_avg_sq, exp_avg_sq)
    _park_loaded(engine, state)
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _check_shape(entry: dict[str, torch.Tensor], torch_index: int, shape: torch.Size) -> None:
    if entry["exp_avg"].shape != shape:
        raise ValueError(
            f"optimizer state for parameter {torch_index} has shape {tuple(entry['exp_avg'].shape)}, "
            f"the parameter has {tuple(shape)}"
        )


def _park_loaded(engine: ShardedState, state: dict[int, dict[str, torch.Tensor]]) -> None:
    """The loaded state of the optimizer's frozen parameters, parked (what was parked before is replaced, as
    torch's ``load_state_dict`` replaces its whole state): an unfreeze takes it up, as under torch's AdamW."""
    engine.parked.clear()
    trainable = set(engine.torch_index)
    for torch_index, param in enumerate(optimizer_params(engine.optimizer)):
        entry = state.get(torch_index)
        if torch_index in trainable or entry is None:
            continue
        _check_shape(entry, torch_index, param.shape)
        for name in MOMENTS:  # on the host with the rest of the state, whatever device the state dict is on
            engine.parked.park(param, name, entry[name].to("cpu", engine.state.dtype, copy=True))
        engine.parked.park(param, "step", int(float(entry["step"])))
