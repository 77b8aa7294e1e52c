"""Which modules become FSDP2 units, the model wrapped in them, and the users' own fully_shard calls."""

from __future__ import annotations

import copy

import pytest
import torch
from offload_params_helpers import (
    Block,
    Blocks,
    Net,
    assert_same_state,
    batches,
    differences,
    loss_of,
    tokens,
    training_state,
    two_groups,
)
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard

from lightning_zero_offload.engine import OffloadOptions
from lightning_zero_offload.engine.offload_params import ParamOffloadEngine
from lightning_zero_offload.engine.offload_params.placement import (
    device_resident,
    find_units,
    holders,
    shard_model,
)


def test_the_blocks_and_the_modules_as_large_as_one_are_the_units_in_module_order():
    net = Net()
    assert find_units(net) == [net.embed, *net.blocks, net.head]  # the final norm stays with the root


def test_tied_embeddings_stay_with_the_root():
    net = Net(tied=True)
    assert find_units(net) == list(net.blocks)


def test_the_outermost_repeated_container_gives_the_blocks():
    stages = nn.ModuleList([nn.ModuleList([Block(), Block()]) for _ in range(3)])
    assert find_units(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2), stages)) == list(stages)
    chain = nn.Sequential(Block(), Block(), Block())
    assert find_units(chain) == list(chain)


def test_a_model_without_blocks_is_refused_with_the_device_memory_of_one_unit():
    with torch.device("meta"):  # 134M parameters: sizes in GiB, no memory
        mlp = nn.Sequential(nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 8192))
    with pytest.raises(ValueError, match="no repeated blocks") as refused:
        find_units(mlp, param_dtype=torch.bfloat16)
    message = str(refused.value)
    assert "134,234,112 parameters" in message
    assert "0.25 GiB for its" in message and "0.50 GiB of fp32 gradients" in message and "0.75 GiB before" in message
    assert "nn.ModuleList" in message and "call fully_shard yourself" in message


def test_a_weight_tied_across_blocks_is_refused():
    net = Net()
    net.blocks[2].up.weight = net.blocks[0].up.weight
    with pytest.raises(ValueError, match=r"blocks\.0\.up\.weight = blocks\.2\.up\.weight of block Block") as refused:
        find_units(net)
    assert "untie it" in str(refused.value)


def test_shard_model_wraps_the_units_and_the_root_with_cpu_offload(mesh):
    torch.manual_seed(0)
    net = Net()
    eager = Net()
    eager.load_state_dict(net.state_dict())
    shard_model(net, mesh, param_dtype=torch.float32)
    wrapped = [m for m in net.modules() if isinstance(m, FSDPModule)]
    assert wrapped == [net, net.embed, *net.blocks, net.head]
    for unit in wrapped:
        (group,) = unit._get_fsdp_state()._fsdp_param_groups
        assert isinstance(group.offload_policy, CPUOffloadPolicy) and not group.offload_policy.pin_memory
        assert group.mp_policy.param_dtype == torch.float32 and group.mp_policy.reduce_dtype == torch.float32
    assert_same_state(net, eager)
    assert torch.equal(net(tokens()), eager(tokens()))


class Generates(Net):
    def generate(self, tokens: torch.Tensor) -> torch.Tensor:
        """As Hugging Face's generate runs an encoder-decoder's encoder: its layers, never ``forward``."""
        return self.head(self.norm(self.embed(tokens)))


@pytest.mark.parametrize("held", [False, True], ids=["root", "sole-holder"])
def test_generate_gathers_the_parameters_as_forward_does(mesh, held):
    """FSDP2 gathers a unit's own parameters (the final norm here) around ``forward`` only; ``generate``, of the root
    or of the child holding every parameter, is registered as a forward method, so it runs after setup as under auto
    (a T5's or BART's generate failed with "aten.embedding.default got mixed torch.Tensor and DTensor")."""
    torch.manual_seed(0)
    eager = Generates()
    model = copy.deepcopy(eager)
    if held:
        holder = nn.Module()  # a LightningModule's shape
        holder.model = model
        shard_model(holder, mesh, param_dtype=torch.float32)
    else:
        shard_model(model, mesh, param_dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model.generate(tokens()), eager.generate(tokens()))


def test_a_compiled_submodel_is_a_holder_and_runs_when_called_directly(mesh):
    """``self.model = torch.compile(model)``: the compiled module's forward is its instance's, not its class's, so
    it was taken for a container and left to the root (``lit.model(x)`` failed after fit: "got mixed torch.Tensor
    and DTensor")."""
    torch.manual_seed(0)
    eager = Net()
    root = nn.Module()
    root.model = torch.compile(copy.deepcopy(eager), backend="eager")
    shard_model(root, mesh, param_dtype=torch.float32)
    assert isinstance(root.model, FSDPModule)
    with torch.no_grad():
        torch.testing.assert_close(root.model(tokens()), eager(tokens()), rtol=0, atol=1e-6)


def test_the_users_units_are_kept_and_only_the_root_is_wrapped(mesh):
    torch.manual_seed(0)
    eager = Net()
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Net()
    for block in net.blocks:  # as a configure_model would: on the meta device, blocks only
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    shard_model(net, mesh, param_dtype=torch.float32)
    assert [m for m in net.modules() if isinstance(m, FSDPModule)] == [net, *net.blocks]
    assert_same_state(net, eager)


def test_users_units_that_stay_unsharded_after_backward_are_refused(mesh):
    with torch.device("meta"):
        net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    net.blocks[1].set_reshard_after_backward(False)
    with pytest.raises(ValueError, match="blocks.1: .*set_reshard_after_backward"):
        shard_model(net, mesh, param_dtype=torch.float32)


def test_users_units_without_cpu_offload_keep_their_shards_on_the_device(mesh):
    """As the device share's do; a share asked for on top of them is refused unless it is what they hold."""
    with torch.device("meta"):
        net = Net()
    fully_shard(net.blocks[0], mesh=mesh)
    for block in net.blocks[1:]:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    with pytest.raises(ValueError, match="leave the wrapping to the strategy, or set device_share=0"):
        shard_model(net, mesh, param_dtype=torch.float32, device_share=0.9)
    shard_model(net, mesh, param_dtype=torch.float32)
    assert {id(p) for p in device_resident(net)} == {id(p) for p in net.blocks[0].parameters()}


def freeze(net: Net) -> None:
    net.embed.requires_grad_(False)
    net.blocks[0].requires_grad_(False)  # a frozen block
    net.blocks[1].up.requires_grad_(False)  # and part of one


def test_frozen_blocks_train_as_without_fsdp(mesh):
    torch.manual_seed(0)
    eager = Net()
    freeze(eager)
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Net()
    freeze(net)
    shard_model(net, mesh, param_dtype=torch.float32)
    for model in (net, eager):
        model(tokens()).square().mean().backward()
    for (name, p), q in zip(net.named_parameters(), eager.parameters(), strict=True):
        assert p.requires_grad == q.requires_grad, name
        if q.requires_grad:  # one rank: the reduce-scatter is a copy
            assert torch.equal(p.grad.full_tensor(), q.grad), name
        else:
            assert p.grad is None, name


@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
def test_at_one_rank_the_reduce_runs_in_the_compute_dtype_with_the_same_bits(mesh, cpu_state):
    """Nothing is summed at one rank: reducing in bf16 instead of fp32 hands the engine the same gradients
    (bf16 values, exactly representable in fp32), in half the device buffers (planner/offload_params.py)."""
    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=3, micro=2)
    state_dtype = torch.bfloat16 if cpu_state == "bf16" else torch.float32
    runs = {}
    for reduce_dtype in (torch.float32, None):
        copied = copy.deepcopy(model).to(state_dtype)
        shard_model(copied, mesh, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        policy = copied._get_fsdp_state()._fsdp_param_group.mp_policy
        assert policy.reduce_dtype == (reduce_dtype or torch.bfloat16)
        options = OffloadOptions(offload_params=True, cpu_state=cpu_state)
        engine = ParamOffloadEngine(torch.optim.AdamW(two_groups(copied)), torch.device("cpu"), torch.bfloat16, options)
        for window in data:
            for x, y in window:
                engine.begin_backward()
                engine.scale_loss(loss_of(copied, x.to(torch.bfloat16), y, len(window)).float()).backward()
                engine.finish_backward()
            engine.step(clip_norm=0.3)
            engine.zero_grad()
        runs[reduce_dtype] = training_state(copied, engine)
        engine.close()
    assert not differences(runs[None], runs[torch.float32])


def test_the_holders_are_the_sole_child_holding_parameters_and_the_submodels():
    """Wrapped as units of their own so that they gather their parameters when called directly (a LightningModule's
    self.model or self.backbone after fit): the child holding every parameter, and a child holding a unit beside
    others; not a container (never called), nor a child whose parameters are all in units, nor one tied outside."""

    class Holds(nn.Module):
        def __init__(self, child: nn.Module, own: bool = False, other: bool = False) -> None:
            super().__init__()
            self.model = child
            self.scale = nn.Parameter(torch.ones(1)) if own else None
            self.other = nn.Linear(2, 2) if other else nn.Identity()

    net = Net()
    assert holders(Holds(net), []) == [net]
    assert holders(Holds(net), [net]) == []  # a unit already
    assert holders(Holds(nn.ModuleList([nn.Linear(2, 2)])), []) == []
    assert holders(Holds(net, own=True), []) == []  # a root with parameters: only submodels
    assert holders(Holds(net, own=True, other=True), list(net.blocks)) == [net]  # beside the root's and a head's
    tied = Holds(net)
    tied.other = nn.Linear(net.head.in_features, net.head.out_features, bias=False)
    tied.other.weight = net.head.weight  # tied across children: the root keeps both
    assert holders(tied, list(net.blocks)) == []
    everything = [net.embed, *net.blocks, net.norm, net.head]
    assert holders(Holds(net, other=True), everything) == []  # nothing of its own to gather
