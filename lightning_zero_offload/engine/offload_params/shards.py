"""The CPU state of the parameter-offload mode: for each sharded parameter, its moments and step count.

FSDP2 (``fully_shard`` with ``CPUOffloadPolicy``) keeps each parameter as a DTensor whose local shard lives
on the host; that shard *is* the master weight (fp32, or bf16 with ``cpu_state="bf16"``), written in place
by the CPU step and gathered to the device by FSDP2's next all-gather. FSDP2 also leaves the reduced
gradient shard in ``p.grad``. So the engine's own state is only the two moments (and, while a speculated
step may be taken back, a snapshot): one :class:`ShardSlot` per trainable parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_zero_offload import kernels


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, the tensor itself otherwise (outside
    autograd: the CPU step writes it in place)."""
    with torch.no_grad():
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()


def first_row(param: Tensor) -> int:
    """The global index along dim 0 of this rank's first row of ``param`` (0 when it is not sharded)."""
    if not isinstance(param, DTensor):
        return 0
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return int(offset[0]) if offset else 0


@dataclass(eq=False)
class ShardSlot:
    """One trainable parameter's CPU state: its Adam moments (local, like the shard), its step count, the
    global number of its shard's first element (the bf16 state's rounding counter, so one run rounds the
    same at any world size) and, once it has been speculated, a snapshot of (param, exp_avg, exp_avg_sq)."""

    param: nn.Parameter
    exp_avg: Tensor
    exp_avg_sq: Tensor
    first_element: int
    step: int = 0
    saved: tuple[Tensor, Tensor, Tensor] | None = None

    @classmethod
    def for_param(cls, param: nn.Parameter, state_dtype: torch.dtype, first_of_param: int) -> ShardSlot:
        shard = local_tensor(param)
        row_numel = param[0].numel() if param.dim() > 0 else 1
        first = first_of_param + first_row(param) * row_numel
        return cls(param, torch.zeros_like(shard, dtype=state_dtype), torch.zeros_like(shard, dtype=state_dtype), first)

    @property
    def master(self) -> Tensor:
        return local_tensor(self.param)

    @property
    def grad(self) -> Tensor | None:
        grad = self.param.grad
        return None if grad is None else local_tensor(grad)

    def snapshot(self) -> None:
        """Copy the master and moments aside (a speculated step may have to be taken back)."""
        if self.saved is None:
            self.saved = tuple(torch.empty_like(t) for t in self.tensors())  # type: ignore[assignment]
        for kept, live in zip(self.saved, self.tensors()):  # type: ignore[arg-type]
            kept.copy_(live)

    def restore(self) -> None:
        """Back to the state of the last :meth:`snapshot`, bitwise."""
        assert self.saved is not None, "restore() without a snapshot"
        for kept, live in zip(self.saved, self.tensors()):
            live.copy_(kept)

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.master, self.exp_avg, self.exp_avg_sq

    def state_bytes(self) -> int:
        """Host bytes this slot holds beyond the parameter and its gradient (FSDP2's)."""
        held = [self.exp_avg, self.exp_avg_sq, *(self.saved or ())]
        return sum(t.numel() * t.element_size() for t in held)


def check_shard(param: nn.Parameter, slot: ShardSlot, state_dtype: torch.dtype) -> None:
    shard = slot.master
    if shard.device.type != "cpu":
        raise ValueError(
            f"a trainable parameter of shape {tuple(param.shape)} has its shard on {shard.device}: offload_params "
            "needs FSDP2 to keep the shards on the host (fully_shard(..., offload_policy=CPUOffloadPolicy()))"
        )
    if shard.dtype != state_dtype:
        raise ValueError(
            f"a trainable parameter's shard is {shard.dtype}, and cpu_state asks for {state_dtype} master weights: "
            "the sharded parameter is the master, so build the model in that dtype before fully_shard "
            "(or set cpu_state to match)"
        )
    if not shard.is_contiguous():
        raise ValueError(f"a trainable parameter's shard (shape {tuple(shard.shape)}) is not contiguous")


def exceeds_limit(slot: ShardSlot, limit: float) -> bool:
    """Whether clipping by value changes this shard's gradient."""
    grad = slot.grad
    return grad is not None and grad.numel() > 0 and bool(grad.abs().max() > limit)


def check_clip(name: str, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")


def step_shards(slots: list[ShardSlot], hparams: kernels.AdamArgs, grad_scale: float, seed: int, threads: int) -> None:
    """The Adam step of every shard in ``slots`` (with a gradient), one native call for fp32 state; counted."""
    if not slots:
        return
    if slots[0].exp_avg.dtype == torch.bfloat16:
        for slot in slots:
            step_shard(slot, slot.grad, hparams, grad_scale, seed, threads)  # type: ignore[arg-type]
    else:
        kernels.adam_step_multi(
            [slot.master for slot in slots],
            [slot.grad for slot in slots],  # type: ignore[misc]
            [slot.exp_avg for slot in slots],
            [slot.exp_avg_sq for slot in slots],
            [slot.step + 1 for slot in slots],
            hparams=hparams,
            grad_scale=grad_scale,
            num_threads=threads,
        )
    for slot in slots:
        slot.step += 1


def step_shard(
    slot: ShardSlot, grad: Tensor, hparams: kernels.AdamArgs, grad_scale: float, seed: int, threads: int
) -> None:
    """One shard's Adam step (step count ``slot.step + 1``; the caller counts it). The same native call as
    :func:`step_shards` makes for it, so a speculated step and a synchronous one give the same bits."""
    if slot.exp_avg.dtype == torch.bfloat16:
        kernels.adam_step_bf16_state(
            slot.master,
            grad,
            slot.exp_avg,
            slot.exp_avg_sq,
            hparams=hparams,
            step=slot.step + 1,
            seed=seed,
            offset=slot.first_element,
            grad_scale=grad_scale,
            num_threads=threads,
        )
    else:
        kernels.adam_step_multi(
            [slot.master],
            [grad],
            [slot.exp_avg],
            [slot.exp_avg_sq],
            [slot.step + 1],
            hparams=hparams,
            grad_scale=grad_scale,
            num_threads=threads,
        )
