"""The autograd functions of the rule: gradients of a parameter's uses summed in fp32, and ``embedding``
returning fp32 rows of a low-precision table."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_zero_offload.mixed_precision.rules import LOW_PRECISION


def upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
        return value.float()
    return value


class FloatGradientSum(torch.autograd.Function):
    """An fp32 stand-in for a parameter that holds no data (a broadcast scalar). The uses routed through it
    (:class:`LowPrecisionUse`) send their gradients to it, where autograd sums them in fp32; its backward
    rounds the sum to the parameter's dtype once."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor) -> torch.Tensor:
        ctx.param_dtype = param.dtype
        return param.new_zeros((), dtype=torch.float32).expand(param.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(ctx.param_dtype)


class LowPrecisionUse(torch.autograd.Function):
    """The parameter itself (an alias, no copy), whose gradient goes to the fp32 ``grad_sum`` instead."""

    @staticmethod
    def forward(ctx: Any, grad_sum: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.float(), None


class EmbeddingSummedInFloat(torch.autograd.Function):
    """``F.embedding`` of a low-precision table returning fp32 rows, whose backward sums the gradients of repeated
    indices in fp32 (torch's CPU kernel sums them in the table's dtype)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, indices: torch.Tensor, options: dict[str, Any]) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.num_weights, ctx.weight_dtype = weight.shape[0], weight.dtype
        padding_idx = options["padding_idx"]
        ctx.padding_idx = -1 if padding_idx is None else padding_idx % weight.shape[0]
        ctx.scale_grad_by_freq = options["scale_grad_by_freq"]
        return F.embedding(indices, weight, **options).float()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (indices,) = ctx.saved_tensors
        grad_weight = torch.ops.aten.embedding_dense_backward(
            grad.float(), indices, ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq
        )
        return grad_weight.to(ctx.weight_dtype), None, None
