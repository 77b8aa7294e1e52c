"""A model built on the meta device taken by the ZeRO-2 engine in two steps: placeholders, then the values
unit by unit, those of an eager build with the same seed."""

from __future__ import annotations

import pytest
import torch
from offload_params_helpers import VOCAB, WIDTH, Net, Rotary, full_state
from torch import nn

from lightning_zero_offload.engine.meta_init import blockwise as blockwise_module
from lightning_zero_offload.engine.meta_init.blockwise import BlockwiseInit
from lightning_zero_offload.engine.offload_params.placement import init_units


class Mask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("causal", torch.ones(3, 3).tril(), persistent=False)


@pytest.mark.parametrize("tied", [False, True])
def test_blockwise_placeholders_then_values_equal_the_eager_build_one_block_at_a_time(tied):
    torch.manual_seed(0)
    eager = nn.Sequential(Rotary(), Net(tied))
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(Rotary(), Net(tied))
    meta_params = list(model.parameters())
    optimizer = torch.optim.AdamW(meta_params)  # built over the meta parameters, as Fabric users do
    blockwise = BlockwiseInit(model, "cpu", init_units(model[1]), [optimizer])
    params = list(model.parameters())
    assert not any(p.is_meta for p in params) and all(p.untyped_storage().nbytes() <= 4 for p in params)
    assert optimizer.param_groups[0]["params"] == params  # the placeholders, in the same order
    assert (model[1].head.weight is model[1].embed.weight) == tied
    kept: dict[str, torch.Tensor] = {}
    names = {id(p): name for name, p in model.named_parameters()}

    def keep(param: nn.Parameter, value: torch.Tensor) -> bool:
        if names[id(param)].endswith("bias"):
            return False  # not the engine's: the parameter gets its own memory
        kept[names[id(param)]] = value.clone()
        return True

    blockwise.fill(keep)
    assert torch.equal(torch.get_rng_state(), after_eager)
    want = full_state(eager)
    for name, value in kept.items():
        assert torch.equal(value, want[name]), name
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size() and torch.equal(p, want[name])
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, dict(eager.named_buffers())[name]), name


def test_blockwise_holds_one_unit_whole_at_a_time(monkeypatch):
    with torch.device("meta"):
        net = Net()
    blockwise = BlockwiseInit(net, "cpu", init_units(net))
    held: list[int] = []  # scratch elements of each unit, handed over together
    initialized = blockwise_module.initialized

    def spy(*args, **kwargs):
        for scratch in initialized(*args, **kwargs):
            held.append(sum(whole.numel() for _, whole in scratch))
            yield scratch

    monkeypatch.setattr(blockwise_module, "initialized", spy)
    blockwise.fill(lambda param, value: True)
    # The embedding, each block, the root's own (the final norm), the head: never two at once.
    block = sum(p.numel() for p in net.blocks[0].parameters())
    assert held == [VOCAB * WIDTH, block, block, block, 2 * WIDTH, VOCAB * WIDTH]


def test_blockwise_refuses_what_nothing_initializes_before_any_placeholder():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Mask())
    with pytest.raises(ValueError, match="cannot initialize the .* of Mask"):
        BlockwiseInit(model, "cpu")
    assert model[0].weight.is_meta


def test_no_unit_is_alive_while_the_next_one_is_initialized():
    import weakref

    with torch.device("meta"):
        net = Net()
    earlier: list[weakref.ref] = []
    alive_at_each_unit: list[int] = []
    current: list[weakref.ref] = []
    blockwise = BlockwiseInit(net, "cpu", init_units(net))
    unit_of = {id(p): i for i, m in enumerate([net.embed, *net.blocks, net.norm, net.head]) for p in m.parameters()}
    last = [None]

    def keep(param: nn.Parameter, value: torch.Tensor) -> bool:
        if unit_of[id(param)] != last[0]:  # the first value of the next unit
            earlier.extend(current)
            current.clear()
            alive_at_each_unit.append(sum(r() is not None for r in earlier))
            last[0] = unit_of[id(param)]
        current.append(weakref.ref(value))
        return False

    blockwise.fill(keep)
    assert alive_at_each_unit == [0] * 6
