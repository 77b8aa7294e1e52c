"""The three collectives the engine uses, over whichever torch.distributed backend is running.

NCCL only takes device tensors and gloo only CPU ones for some ops, so host data is moved to the
backend's device and back here, not at every call site.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

Number = TypeVar("Number", int, float)

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum ``input`` over ranks; this rank receives chunk ``rank`` of the result in ``output``."""
    _reduce_scatter_single(output, input, group=group)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Concatenate every rank's ``input`` (chunk ``rank``) into ``output``."""
    _all_gather_single(output, input, group=group)


def comm_device(group: dist.ProcessGroup | None, fallback: torch.device) -> torch.device:
    """Where tensors must live for collectives on ``group``: the accelerator for NCCL, else the CPU."""
    return fallback if dist.get_backend(group) == "nccl" else torch.device("cpu")


def all_reduce_sum(values: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """Sum a small host tensor over ranks and return it on the host."""
    target = comm_device(group, device)
    moved = values.to(target)
    dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=group)
    return moved.cpu()


def gather_host(shard: torch.Tensor, group: dist.ProcessGroup | None, device: torch.device) -> torch.Tensor:
    """All-gather equal host shards into one host tensor (checkpoint-time only, bucket by bucket)."""
    target = comm_device(group, device)
    world = dist.get_world_size(group)
    output = torch.empty(shard.numel() * world, dtype=shard.dtype, device=target)
    all_gather(output, shard.to(target), group)
    return output.cpu()


def gather_host_to_first(
    chunk: torch.Tensor, output: torch.Tensor | None, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    """Concatenate every rank's equal host ``chunk`` into ``output`` on the group's rank 0 only (the others
    pass ``None``): a streamed checkpoint write, where only the writer needs the bucket.

    Point to point, each chunk received straight into its place: gloo's ``gather`` would receive into a
    bucket-sized buffer of its own first.
    """
    target = comm_device(group, device)
    world = dist.get_world_size(group)

    def rank_of(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    if output is None:
        dist.send(chunk.to(target), dst=rank_of(0), group=group)
        return
    received = output if target.type == "cpu" else torch.empty_like(output, device=target)
    parts = received.chunk(world)
    pending = [dist.irecv(parts[r], src=rank_of(r), group=group) for r in range(1, world)]
    parts[0].copy_(chunk)
    for request in pending:
        request.wait()
    if received is not output:
        output.copy_(received)


def broadcast_tensors_(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Overwrite ``tensors`` on every rank with rank 0's values (start from identical weights)."""
    target = comm_device(group, device)
    source = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in tensors:
        moved = tensor.detach().to(target)
        dist.broadcast(moved, src=source, group=group)
        if moved is not tensor:
            tensor.detach().copy_(moved)


def abandon_process_group() -> None:
    """Tear the default process group down after a failure, without a collective and without waiting.

    Peers blocked in a collective with this rank then fail at once instead of at the timeout: with gloo
    their pending operation raises "Connection closed by peer" as soon as this rank's connections
    close. NCCL communicators are aborted (destroying them would wait for work that never completes).
    Any later collective on this rank raises instead of hanging.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # experimental in torch
    if dist.get_backend() == "nccl" and abort is not None:
        try:
            abort()
            return
        except Exception:  # noqa: BLE001 - destroying the group is the fallback
            pass
    dist.destroy_process_group()


def least_over_ranks(values: list[Number], world_size: int, device: torch.device) -> list[Number]:
    """Each of ``values`` (ints or floats, each keeps its type), the least any rank has (one all-reduce of a
    rank-by-value table; none at one rank)."""
    if world_size == 1:
        return values
    table = torch.zeros(world_size, len(values), dtype=torch.float64)
    table[dist.get_rank()] = torch.tensor(values, dtype=torch.float64)
    least = all_reduce_sum(table, None, device).min(dim=0).values.tolist()
    return [type(mine)(v) for mine, v in zip(values, least)]
