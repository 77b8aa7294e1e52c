"""What both sessions answer alike (core/session_base.py), through Fabric's ``clip_gradients``: a non-finite
gradient norm, against plain Fabric's."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from offload_params_helpers import Blocks, batches, loss_of

import lightning_zero_offload  # noqa: F401  (registers the strategies for Fabric)
from lightning_zero_offload.core import release_process_group
from lightning_zero_offload.warning import ZeroOffloadRuntimeWarning


@pytest.fixture(autouse=True)
def own_process_group():
    """The one-process group zero_offload_params starts for FSDP2 ends with each test."""
    yield
    release_process_group()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def clip_a_nan_gradient(strategy: str, error_if_nonfinite: bool) -> tuple[str | float, bool]:
    """One backward whose gradients are NaN, clipped through Fabric, then ``optimizer.step()``: the error's message
    (and no step), or the norm returned and whether the step left the weights as they were."""
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
    fabric.launch()
    torch.manual_seed(0)
    model = Blocks()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    before = weights(model)
    x, y = batches(steps=1, micro=1)[0][0]
    fabric.backward(loss_of(model, x, y, 1) * float("nan"))
    try:
        got: str | float = float(
            fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=error_if_nonfinite)
        )
    except RuntimeError as error:
        release_process_group()
        return str(error), False
    optimizer.step()
    kept = all(torch.equal(w, before[name]) for name, w in weights(model).items())
    release_process_group()
    return got, kept


@pytest.mark.parametrize("strategy", ["zero_offload", "zero_offload_params"])
def test_a_non_finite_norm_is_refused_as_plain_fabric_refuses_it_and_skipped_when_allowed(strategy):
    """Fabric's default (``error_if_nonfinite=True``) raises as plain Fabric's torch clipping does, naming the way
    out; allowed, the norm is inf and the step is skipped, where plain torch would write NaN into every weight."""
    plain, _ = clip_a_nan_gradient("auto", error_if_nonfinite=True)
    refused, _ = clip_a_nan_gradient(strategy, error_if_nonfinite=True)
    assert "non-finite" in plain and "non-finite" in refused and "error_if_nonfinite=False" in refused
    with pytest.warns(ZeroOffloadRuntimeWarning, match="step was skipped and the parameters are unchanged"):
        norm, kept = clip_a_nan_gradient(strategy, error_if_nonfinite=False)
    assert norm == math.inf and kept
