"""A model built on the meta device given its memory and values: those of an eager build, shard by shard."""

from __future__ import annotations

import pytest
import torch
from offload_params_helpers import Net, Rotary, assert_same_state
from torch import nn

from lightning_zero_offload.engine.meta_init.blockwise import BlockwiseInit
from lightning_zero_offload.engine.offload_params.materialize import materialize
from lightning_zero_offload.engine.offload_params.placement import shard_model
from lightning_zero_offload.testing.ranks import run_ranks


@pytest.mark.parametrize("tied", [False, True])
def test_a_sharded_meta_build_equals_the_eager_build_bitwise_and_draws_as_many_numbers(mesh, tied):
    torch.manual_seed(0)
    eager = Net(tied)
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Net(tied)
    shard_model(net, mesh, param_dtype=torch.float32)
    assert_same_state(net, eager)
    assert (net.head.weight is net.embed.weight) == tied
    assert torch.equal(torch.get_rng_state(), after_eager)  # the tied head's own init drew too, thrown away


def test_a_plain_meta_build_equals_the_eager_build_with_its_ties():
    torch.manual_seed(0)
    eager = Net(tied=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Net(tied=True)
    materialize(net, "cpu")
    assert net.head.weight is net.embed.weight  # to_empty alone gives each holder its own copy
    assert_same_state(net, eager)


@pytest.mark.parametrize("initialize", [True, False])
def test_buffers_are_recomputed_by_reset_parameters_or_kept_when_real(mesh, initialize):
    torch.manual_seed(0)
    eager = nn.Sequential(Rotary(), Net())
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(Rotary(), Net())
    shard_model(model, mesh, param_dtype=torch.float32, initialize=initialize)
    for name in ("inv_freq", "positions"):
        assert torch.equal(getattr(model[0], name), getattr(eager[0], name)), name
    if initialize:
        assert_same_state(model, eager)


class Mask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("causal", torch.ones(3, 3).tril(), persistent=False)


class Forgets(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)
        self.gate = nn.Parameter(torch.zeros(4))  # nn.Linear.reset_parameters does not know it


@pytest.mark.parametrize("initialize", [True, False])
def test_a_module_that_nothing_can_initialize_is_refused_before_anything_is_allocated(initialize):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Mask())
    with pytest.raises(ValueError, match="cannot initialize the .* of Mask, .* no reset_parameters"):
        materialize(model, "cpu", initialize=initialize)
    assert model[0].weight.is_meta and model[1].causal.is_meta


def test_an_init_that_forgets_a_parameter_is_refused():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), Forgets())
    with pytest.raises(ValueError, match=r"left Forgets\.gate unset \(still NaN"):
        materialize(model, "cpu")


def test_init_fn_initializes_every_module_instead_of_reset_parameters(mesh):
    def halves(module: nn.Module) -> None:
        for p in module.parameters(recurse=False):
            p.fill_(0.5)

    with torch.device("meta"):
        net = Net()
    shard_model(net, mesh, param_dtype=torch.float32, init_fn=halves)
    assert all(bool((p.full_tensor() == 0.5).all()) for p in net.parameters())


def test_a_plain_model_half_on_the_meta_device_gets_that_half_initialized_in_place():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with torch.device("meta"):
        first = nn.Linear(2, 2)
    second = nn.Linear(2, 2)
    kept = second.weight.detach().clone()
    model = nn.Sequential(first, second)
    meta_weight = model[0].weight
    torch.manual_seed(0)
    materialize(model, "cpu")
    assert model[0].weight is meta_weight and torch.equal(model[0].weight, eager[0].weight)  # in place
    assert torch.equal(model[1].weight, kept)  # built outside the meta device: as it was


@pytest.mark.slow  # two processes
def test_at_two_ranks_every_rank_holds_rank_0s_eager_values(tmp_path):
    from workers.offload_params import materialized_like_rank0

    run_ranks(materialized_like_rank0, 2, tmp_path, timeout=240)  # every rank checks its own


@pytest.mark.slow  # two processes
def test_frozen_blocks_at_two_ranks_get_the_gradients_of_one_model(tmp_path):
    from workers.offload_params import frozen_gradients

    # Each rank's half-batch gradients are averaged by the reduce-scatter: fp32 rounding, seen 2.2e-7.
    assert max(run_ranks(frozen_gradients, 2, tmp_path, timeout=240)) < 1e-6


class ReplacesItsBuffer(nn.Module):
    """litgpt's GPT recomputes its rope cache in reset_parameters by assigning new tensors to its buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))
        self.register_buffer("cache", torch.empty(3), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        self.cache = torch.arange(3.0, device=self.cache.device) * 2


def test_an_init_that_replaces_a_buffer_instead_of_filling_it_is_accepted():
    with torch.device("meta"):
        plain, blockwise = ReplacesItsBuffer(), ReplacesItsBuffer()
    materialize(plain, "cpu")
    BlockwiseInit(blockwise, "cpu").fill(lambda param, value: False)
    for model in (plain, blockwise):
        assert torch.equal(model.cache, torch.tensor([0.0, 2.0, 4.0])) and torch.equal(model.weight, torch.ones(3))


def test_placeholders_and_materialized_parameters_keep_their_class_and_attributes():
    class Tagged(nn.Parameter):
        pass

    class Mixer(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.decay = Tagged(torch.empty(4))
            self.decay._no_weight_decay = True  # read by configure_optimizers to build its groups (mamba_ssm)

        def reset_parameters(self) -> None:
            super().reset_parameters()
            if hasattr(self, "decay"):
                nn.init.ones_(self.decay)

    with torch.device("meta"):
        plain, blockwise = Mixer(), Mixer()
    materialize(plain, "cpu")
    BlockwiseInit(blockwise, "cpu")
    for model in (plain, blockwise):
        assert type(model.decay) is Tagged and model.decay._no_weight_decay


class Order(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("order", torch.empty(4, dtype=torch.long))  # reset_parameters forgets it

    def reset_parameters(self) -> None:
        pass


def test_an_integer_buffer_the_init_forgets_is_refused_too():
    with torch.device("meta"):
        plain, blockwise = Order(), Order()
    with pytest.raises(ValueError, match=r"left Order\.order unset"):
        materialize(plain, "cpu")
    with pytest.raises(ValueError, match=r"left Order\.order unset"):
        BlockwiseInit(blockwise, "cpu").fill(lambda param, value: False)


class Stats(nn.Module):
    """A loaded statistic and a cache left on the meta device by load_state_dict(assign=True); its
    reset_parameters resets both."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running", torch.zeros(4))
        self.register_buffer("cache", torch.empty(4), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.running.zero_()
        self.cache = torch.arange(4.0, device=self.cache.device)


def test_computing_a_buffer_left_on_meta_keeps_the_loaded_ones():
    with torch.device("meta"):
        plain, blockwise = nn.Sequential(nn.Linear(4, 4), Stats()), nn.Sequential(nn.Linear(4, 4), Stats())
    for model in (plain, blockwise):
        model.load_state_dict(
            {**nn.Sequential(nn.Linear(4, 4), Stats()).state_dict(), "1.running": torch.full((4,), 7.0)}, assign=True
        )
    materialize(plain, "cpu")  # the buffers alone: the weights are real
    with torch.device("meta"):
        blockwise.append(nn.Linear(4, 4))  # partly on the meta device: BlockwiseInit
    BlockwiseInit(blockwise, "cpu").fill(lambda param, value: False)
    for model in (plain, blockwise):
        assert torch.equal(model[1].running, torch.full((4,), 7.0)) and torch.equal(model[1].cache, torch.arange(4.0))
