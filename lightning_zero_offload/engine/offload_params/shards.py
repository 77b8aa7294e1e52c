"""The CPU state of the parameter-offload mode: for each sharded parameter, its moments and step count.

FSDP2 (``fully_shard`` with ``CPUOffloadPolicy``) keeps each parameter as a DTensor whose local shard lives
on the host (on the device for a unit of the ``device_share``, sharded without the policy); that shard *is*
the master weight (fp32, or bf16 with ``cpu_state="bf16"``), written in place
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
from lightning_zero_offload.kernels import device as device_kernels


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
    rounding number of its shard's first element (the bf16 state's counter, ``rounding_numbers``: the same at any
    world size and trainable set) and, once it has been speculated, a snapshot of (param, exp_avg, exp_avg_sq).
    ``on_device``: its unit is in the device share, so shard, moments and step stay on the device."""

    param: nn.Parameter
    exp_avg: Tensor
    exp_avg_sq: Tensor
    first_element: int
    on_device: bool = False
    step: int = 0
    saved: tuple[Tensor, Tensor, Tensor] | None = None

    @classmethod
    def for_param(
        cls, param: nn.Parameter, state_dtype: torch.dtype, first_of_param: int, on_device: bool = False
    ) -> ShardSlot:
        shard = local_tensor(param)
        row_numel = param[0].numel() if param.dim() > 0 else 1
        first = first_of_param + first_row(param) * row_numel
        moments = (torch.zeros_like(shard, dtype=state_dtype) for _ in range(2))  # where the shard lies
        return cls(param, *moments, first, on_device)

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

    def reset(self) -> None:
        """torch's fresh state for the parameter: step 0, zero moments."""
        self.step = 0
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()

    def load_rows(self, local: Tensor, whole: Tensor) -> None:
        """This rank's rows of ``whole`` (the parameter's full shape; a broadcastable value too) into ``local``, a
        tensor shaped like the shard (a moment)."""
        whole = torch.as_tensor(whole).expand(self.param.shape)
        start = first_row(self.param)
        local.copy_((whole[start : start + local.shape[0]] if local.dim() else whole).reshape(local.shape))

    def state_bytes(self) -> int:
        """Bytes this slot holds beyond the parameter and its gradient (FSDP2's), on its side."""
        held = [self.exp_avg, self.exp_avg_sq, *(self.saved or ())]
        return sum(t.numel() * t.element_size() for t in held)


def check_shard(param: nn.Parameter, slot: ShardSlot, state_dtype: torch.dtype, device: torch.device) -> None:
    shard = slot.master
    if slot.on_device and shard.device.type != device.type:
        raise ValueError(
            f"a trainable parameter of shape {tuple(param.shape)} is in the device share and has its shard on "
            f"{shard.device}, not on the {device.type} device: its unit must be sharded without CPUOffloadPolicy"
        )
    if not slot.on_device and shard.device.type != "cpu":
        raise ValueError(
            f"a trainable parameter of shape {tuple(param.shape)} has its shard on {shard.device}: offload_params "
            "needs FSDP2 to keep the shards on the host (fully_shard(..., offload_policy=CPUOffloadPolicy()))"
        )
    if shard.dtype != state_dtype:
        raise ValueError(
            f"a trainable parameter's shard is {shard.dtype}, and cpu_state asks for {state_dtype} master weights: "
            f"the sharded parameter is the master, so convert the model to {state_dtype} (model.to(...)) before fit "
            "and before any fully_shard call of yours, or set cpu_state to match (a parameter frozen when the model "
            "was sharded keeps the dtype it was built in, so one unfrozen later, by BackboneFinetuning say, meets "
            "this: build the model in float32)"
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
    """The Adam step of every shard in ``slots`` (with a gradient), one call per side for fp32 state; counted."""
    for on_device in (False, True):
        side = [slot for slot in slots if slot.on_device == on_device]
        if not side:
            continue
        if side[0].exp_avg.dtype == torch.bfloat16:
            for slot in side:
                step_shard(slot, slot.grad, hparams, grad_scale, seed, threads)  # type: ignore[arg-type]
        else:
            grads: list[Tensor] = [slot.grad for slot in side]  # type: ignore[misc]
            _adam_fp32(side, grads, hparams, grad_scale, threads)
    for slot in slots:
        slot.step += 1


def step_shard(
    slot: ShardSlot, grad: Tensor, hparams: kernels.AdamArgs, grad_scale: float, seed: int, threads: int
) -> None:
    """One shard's Adam step (step count ``slot.step + 1``; the caller counts it). The same call as
    :func:`step_shards` makes for it, so a speculated step and a synchronous one give the same bits."""
    if slot.exp_avg.dtype == torch.bfloat16:
        args = (slot.master, grad, slot.exp_avg, slot.exp_avg_sq)
        common = {"hparams": hparams, "step": slot.step + 1, "seed": seed, "offset": slot.first_element}
        if slot.on_device:
            device_kernels.adam_step_bf16_state(*args, **common, grad_scale=grad_scale)
        else:
            kernels.adam_step_bf16_state(*args, **common, grad_scale=grad_scale, num_threads=threads)
    else:
        _adam_fp32([slot], [grad], hparams, grad_scale, threads)


def sum_of_squares(slot: ShardSlot, grad: Tensor, threads: int) -> tuple[float, bool]:
    """The sum of squares of a shard's gradient and whether it holds an inf or nan, on the side it lies."""
    if slot.on_device:
        return device_kernels.sum_of_squares(grad)
    return kernels.sum_of_squares(grad, num_threads=threads)


def _adam_fp32(
    slots: list[ShardSlot], grads: list[Tensor], hparams: kernels.AdamArgs, grad_scale: float, threads: int
) -> None:
    """One fused fp32 step of ``slots`` (all on one side): the native kernel on the host, torch's on the device."""
    tensors = ([s.master for s in slots], grads, [s.exp_avg for s in slots], [s.exp_avg_sq for s in slots])
    steps = [slot.step + 1 for slot in slots]
    if slots[0].on_device:
        device_kernels.adam_step_multi(*tensors, steps, hparams=hparams, grad_scale=grad_scale)
    else:
        kernels.adam_step_multi(*tensors, steps, hparams=hparams, grad_scale=grad_scale, num_threads=threads)


def memory_report(slots: list[ShardSlot]) -> dict[str, int]:
    """Bytes this rank holds, by kind and side (``host_*``, and ``device_*`` for the device share): the parameter
    shards (FSDP2's, the master weights), their gradients, the optimizer state (moments, snapshots); ``params``,
    the trainable count (all ranks), and ``device_share_params``, the device share's."""
    report = {"params": sum(slot.param.numel() for slot in slots)}
    for side, on_device in (("host", False), ("device", True)):
        kept = [slot for slot in slots if slot.on_device == on_device]
        report[f"{side}_shard_bytes"] = sum(slot.master.numel() * slot.master.element_size() for slot in kept)
        report[f"{side}_grad_bytes"] = sum(g.numel() * g.element_size() for s in kept if (g := s.grad) is not None)
        report[f"{side}_state_bytes"] = sum(slot.state_bytes() for slot in kept)
    report["device_share_params"] = sum(slot.param.numel() for slot in slots if slot.on_device)
    return report
