"""engine.adam: which optimizers the engine runs, and their hyperparameters read as the kernels' record."""

from __future__ import annotations

import pytest
import torch

from lightning_zero_offload.engine.adam import check_optimizer, read_hyperparams
from lightning_zero_offload.kernels import AdamHyperparams
from lightning_zero_offload.optim import CPUAdam


@pytest.mark.parametrize(
    "make,adamw_mode",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1), True),
        (lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1), False),
        (
            lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, decoupled_weight_decay=True),
            True,
        ),
        (lambda ps: CPUAdam(ps, lr=0.01, betas=(0.8, 0.9), weight_decay=0.1, adamw_mode=False), False),
    ],
    ids=["AdamW", "Adam", "Adam-decoupled", "CPUAdam-L2"],
)
def test_reads_the_kernels_record_with_the_optimizers_decay_mode(make, adamw_mode: bool) -> None:
    optimizer = make([torch.nn.Parameter(torch.zeros(2))])
    expected = AdamHyperparams(lr=0.01, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, adamw_mode=adamw_mode)
    assert read_hyperparams(optimizer, optimizer.param_groups[0]) == expected


def test_bad_group_is_named_and_rejected_like_the_kernel_would() -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.01)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "lr": float("nan")})
    with pytest.raises(ValueError, match=r"param_groups\[1\]: lr must be finite, got nan"):
        check_optimizer(optimizer)
    with pytest.raises(TypeError, match="cannot run SGD"):
        check_optimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
