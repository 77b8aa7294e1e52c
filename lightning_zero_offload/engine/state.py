"""The engine's optimizer state in and out: flat CPU shards <-> full per-parameter tensors in torch's format."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from lightning_zero_offload.engine.collectives import gather_host

if TYPE_CHECKING:
    from lightning_zero_offload.engine.engine import OffloadEngine


def load_shard(engine: OffloadEngine, shard: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy this rank's part of full per-parameter tensors into a flat shard buffer."""
    for bucket in engine.layout.buckets:
        for seg in bucket.segments:
            flat = tensors[seg.param_index].reshape(-1)
            shard[seg.shard_start : seg.shard_end].copy_(flat[seg.param_start : seg.param_start + seg.numel])


@contextmanager
def buffers_shared_for_save(engine: OffloadEngine, share: bool = True) -> Iterator[None]:
    """Inside: :func:`full_tensors` returns views instead of copies, for a save that writes them at once.

    A full-format save would otherwise hold a second copy of the fp32 weights and both moments (12
    bytes per parameter) while it writes. With one rank the views are of the engine's flat buffers
    (``torch.save`` writes each buffer's storage once, and the file still loads with
    ``weights_only=True``); with several they are of the gathered buckets, which are then not copied
    again. Only for a writer that finishes before the next step changes the buffers: an asynchronous
    ``CheckpointIO`` must get copies (``share=False``).
    """
    previous = getattr(engine, "_share_buffers", False)
    engine._share_buffers = share or previous
    try:
        yield
    finally:
        engine._share_buffers = previous


def full_tensors(engine: OffloadEngine, shard: torch.Tensor) -> list[torch.Tensor]:
    """Assemble full per-parameter tensors from every rank's shard (a collective if sharded).

    Copies, unless inside :func:`buffers_shared_for_save` (then views that change with the next step).
    """
    engine.refuse_after_failure("full weights and optimizer state")
    layout = engine.layout
    copy = not getattr(engine, "_share_buffers", False)
    full: list[torch.Tensor | None] = [None] * len(engine.params)
    for bucket in layout.buckets:
        chunk = shard[bucket.shard_range]
        whole = gather_host(chunk, engine.process_group, engine.device) if layout.world_size > 1 else chunk
        for index in bucket.param_indices:
            slot = layout.slots[index]
            view = whole[slot.bucket_offset : slot.bucket_offset + slot.numel].view(slot.shape)
            full[index] = view.clone() if copy else view
    return full  # type: ignore[return-value]


def param_groups_state(engine: OffloadEngine) -> list[dict[str, Any]]:
    """The optimizer's hyperparameters, numbered as in ``torch.optim.Optimizer.state_dict``."""
    groups = []
    counter = 0
    for group in engine.optimizer.param_groups:
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = list(range(counter, counter + len(group["params"])))
        counter += len(group["params"])
        groups.append(saved)
    return groups


def optimizer_state_dict(engine: OffloadEngine) -> dict[str, Any]:
    """The optimizer state in ``torch.optim.AdamW``'s format (full tensors, collective when sharded)."""
    exp_avg = full_tensors(engine, engine.exp_avg)
    exp_avg_sq = full_tensors(engine, engine.exp_avg_sq)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, torch_index in enumerate(engine.torch_index):
        if engine.steps[index] > 0:
            state[torch_index] = {
                "step": torch.tensor(float(engine.steps[index]), dtype=torch.float32),
                "exp_avg": exp_avg[index],
                "exp_avg_sq": exp_avg_sq[index],
            }
    return {"state": state, "param_groups": param_groups_state(engine)}


def load_optimizer_state_dict(engine: OffloadEngine, state_dict: dict[str, Any]) -> None:
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
    exp_avg, exp_avg_sq = [], []
    for index, torch_index in enumerate(engine.torch_index):
        entry = state.get(torch_index)
        shape = engine.params[index].shape
        if entry is None:
            engine.steps[index] = 0
            exp_avg.append(torch.zeros(shape))
            exp_avg_sq.append(torch.zeros(shape))
            continue
        if entry["exp_avg"].shape != shape:
            raise ValueError(
                f"optimizer state for parameter {torch_index} has shape {tuple(entry['exp_avg'].shape)}, "
                f"the parameter has {tuple(shape)}"
            )
        engine.steps[index] = int(float(entry["step"]))
        exp_avg.append(entry["exp_avg"].float())
        exp_avg_sq.append(entry["exp_avg_sq"].float())
    load_shard(engine, engine.exp_avg, exp_avg)
    load_shard(engine, engine.exp_avg_sq, exp_avg_sq)
    for group, saved in zip(optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
