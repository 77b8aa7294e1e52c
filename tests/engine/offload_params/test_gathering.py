"""What the root and its submodels keep gathered after a call, and when it is freed."""

from __future__ import annotations

import copy

import torch
from offload_params_helpers import Net, tokens
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_zero_offload.engine.offload_params.placement import shard_model


class Generates(Net):
    def generate(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)))


class AroundNet(nn.Module):
    """A LightningModule's shape: the net a holder, and a step that calls it, then its layers directly."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Generates()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens) + self.model.head(self.model.norm(self.model.embed(tokens)))


def only_shards(module: nn.Module) -> bool:
    return all(isinstance(p, DTensor) for p in module.parameters())


def test_a_call_no_backward_can_follow_leaves_only_the_shards_and_one_it_can_keeps_the_copies(mesh):
    """FSDP2 keeps the root's and the holders' gathered copies from forward to backward; after a forward under
    no_grad (evaluation, a callback's sample) or a generate those copies stood in for the shards (so BaseFinetuning,
    mapping the module's parameters to the optimizer's, failed) and held device memory. The outermost call reshards
    them now; a holder called inside the root's forward stays gathered for the layers the root calls next."""
    torch.manual_seed(0)
    eager = AroundNet()
    model = copy.deepcopy(eager)
    shard_model(model, mesh, param_dtype=torch.float32)
    assert isinstance(model.model, FSDPModule)
    with torch.no_grad():
        assert torch.equal(model(tokens()), eager(tokens()))
        assert only_shards(model)
        assert torch.equal(model.model(tokens()), eager.model(tokens()))
        assert only_shards(model)
        assert torch.equal(model.model.generate(tokens()), eager.model.generate(tokens()))
        assert only_shards(model)
    for call in (model.model.generate, model):  # an output a backward may follow: gathered once for both
        output = call(tokens())
        assert not only_shards(model)
        output.sum().backward()
        assert only_shards(model)


class Casting(nn.Module):
    """A linear layer that computes in its weight's dtype, as autocast would: what dtype it was gathered in shows."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.seen: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.linear.weight.dtype
        return nn.functional.linear(x.to(self.seen), self.linear.weight, self.linear.bias).float()


def test_frozen_parameters_are_gathered_in_their_own_dtype_and_trainable_ones_in_the_compute_dtype(mesh):
    """FSDP2's MixedPrecisionPolicy casts a unit's parameters alike, so a frozen fp32 weight reached forward rounded to
    bf16 (or, under fp16, inf beyond its range), where AMP and the ZeRO-2 mode use it as it is. Read at every forward:
    unfrozen, it computes in bf16 and its gradient is reduced with the others'; frozen again, in fp32."""
    model = nn.Sequential(Casting(), Casting(), Casting())
    shard_model(model, mesh, param_dtype=torch.bfloat16)
    x = torch.randn(4, 8)
    model[1].requires_grad_(False)
    for frozen in (True, False, True):
        model[1].requires_grad_(not frozen)
        model(x).sum().backward()
        assert [block.seen for block in model] == [
            torch.bfloat16,
            torch.float32 if frozen else torch.bfloat16,
            torch.bfloat16,
        ]
        assert (model[1].linear.weight.grad is None) == frozen
        for p in model.parameters():
            p.grad = None
