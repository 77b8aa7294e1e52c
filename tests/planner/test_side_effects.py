"""The planner and the pre-flight check read a model without running any of it: no forward, no
parametrization (spectral_norm's power iteration updates its buffers each time its weight is read in
training mode), no buffer written, no random number drawn."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import QUIET, assert_same_weights, loader
from torch import nn
from torch.nn.utils import parametrizations

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.engine.options import OffloadOptions
from lightning_zero_offload.planner import check_host_memory, plan
from lightning_zero_offload.planner.machine import presets, probes
from lightning_zero_offload.planner.shape import ModelShape

BOX = presets.machine("workstation (1 socket, 2ch DDR5)", "RTX 4090 (PCIe 4)")
PARAMETRIZATIONS = {
    "spectral_norm": parametrizations.spectral_norm,  # buffers _u, _v, updated on every read in training mode
    "weight_norm": parametrizations.weight_norm,  # two originals: g (out x 1) and v (out x in)
    "orthogonal": parametrizations.orthogonal,
}


def parametrized_mlp(parametrize) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(parametrize(nn.Linear(12, 12)), nn.Tanh(), nn.Linear(12, 4))
    return model.train()


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (spectral_norm's _u and _v among them), and torch's random state."""
    return {
        **{k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "rng": torch.get_rng_state(),
    }


def assert_bitwise_same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"changed by the planner: {changed}"


@pytest.mark.parametrize("name", list(PARAMETRIZATIONS))
def test_plan_and_preflight_leave_a_parametrized_model_in_training_mode_untouched(name):
    model = parametrized_mlp(PARAMETRIZATIONS[name])
    before = state(model)
    result = plan(model, batch_size=2, seq_len=8, machine=BOX)
    check_host_memory(model, OffloadOptions(), torch.float32, 1, 1, torch.device("cpu"))
    assert_bitwise_same(before, state(model))
    # The counts are the trainable tensors the engine takes: the originals (weight_norm's two), not the
    # weight the parametrization computes; the matmul is the layer's in x out either way.
    originals = sum(p.numel() for p in model.parameters())
    assert result.params == originals == {"weight_norm": 12 + 144 + 12 + 52}.get(name, 144 + 12 + 52)
    assert ModelShape.of(model).matmul_params == 12 * 12 + 12 * 4


def test_measuring_the_matmul_rate_draws_no_random_number():
    before = torch.get_rng_state()
    probes.matmul_rate(torch.device("cpu"), torch.float32, tokens=64, in_features=32, out_features=32, repeats=1)
    assert torch.equal(before, torch.get_rng_state())


class SpectralMLP(L.LightningModule):
    """An MLP whose middle layer is under spectral_norm (a GAN discriminator's habit)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), parametrizations.spectral_norm(nn.Linear(32, 32)), nn.GELU(), nn.Linear(32, 4)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-2)


def fit(strategy) -> SpectralMLP:
    model = SpectralMLP()
    L.Trainer(strategy=strategy, precision="32-true", max_steps=4, **QUIET).fit(model, loader())
    return model


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")  # Lightning's own use of torch's pytree
def test_a_spectral_norm_model_trains_as_under_auto():
    reference = fit("auto")
    with pytest.warns(UserWarning, match="zero_offload is training in '32-true'"):
        ours = fit(ZeroOffloadStrategy(in_place_on_cpu=False))
    # The engine's fp32 step is torch's AdamW to within rounding (observed 1.5e-7 here, buffers 6e-8); a
    # pre-flight that ran the power iteration before training left them 3.5e-4 apart (buffers 8e-4).
    assert_same_weights(ours, reference, atol=1e-6)
    for (name, ours_buffer), reference_buffer in zip(ours.named_buffers(), reference.buffers()):
        torch.testing.assert_close(ours_buffer, reference_buffer, rtol=0, atol=1e-6, msg=name)
