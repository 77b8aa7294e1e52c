"""The device share of the parameter-offload mode: which units keep their state on the device, and that training
with a share equals training without one (FSDP2 on the CPU device, gloo: the device side runs the code a GPU runs)."""

from __future__ import annotations

import copy

import pytest
import torch
from offload_params_helpers import (
    Blocks,
    MlpBlock,
    assert_same_state,
    batches,
    full_state,
    relative_error,
    train,
    two_groups,
)
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from lightning_zero_offload.engine import OffloadOptions
from lightning_zero_offload.engine.offload_params import ParamOffloadEngine, materialize
from lightning_zero_offload.engine.offload_params.materialize import keeps_shards_on_host
from lightning_zero_offload.engine.offload_params.placement import (
    device_resident,
    device_units,
    find_units,
    holds_share,
    shard_model,
)

FP32_ROUNDING = 1e-6  # normwise; observed 0 (torch's fused AdamW and the native kernel agree bitwise here)


def share_run(model, mesh, share, cpu_state="fp32", clip_norm=None, **options):
    sharded = copy.deepcopy(model)
    dtype = torch.bfloat16 if cpu_state == "bf16" else torch.float32
    shard_model(sharded.to(dtype), mesh, param_dtype=dtype, device_share=share, pin_memory=False)
    engine = ParamOffloadEngine(
        torch.optim.AdamW(two_groups(sharded)),
        torch.device("cpu"),
        dtype,
        OffloadOptions(offload_params=True, cpu_state=cpu_state, device_share=share, **options),
        on_device=device_resident(sharded),
    )
    train(sharded, engine, batches(steps=4, micro=2), clip_norm=clip_norm)
    engine.close()
    return full_state(sharded), engine, sharded


def test_the_share_takes_the_root_then_the_first_blocks_never_more_than_asked():
    model = Blocks()
    units = find_units(model)
    total = sum(p.numel() for p in model.parameters())
    root = total - sum(p.numel() for unit in units for p in unit.parameters())
    block = sum(p.numel() for p in units[0].parameters())
    assert device_units(model, units, 0.0) == []
    assert device_units(model, units, (root + block - 1) / total) == [model]
    assert device_units(model, units, (root + 2 * block) / total) == [model, *units[:2]]
    assert device_units(model, units, 1.0) == [model, *units]
    assert device_units(model, units, (root - 1) / total) == []  # the root does not fit: nothing goes


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_the_shares_units_keep_their_shards_and_state_on_the_device(mesh, share):
    torch.manual_seed(0)
    model = Blocks()
    _, engine, sharded = share_run(model, mesh, share)
    units = find_units(model)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    picked = device_units(model, units, share)
    chosen = {id(p) for unit in picked for p in unit.parameters() if unit is not model or id(p) not in in_units}
    want = {name for name, p in model.named_parameters() if id(p) in chosen}
    assert want
    names = {id(p): name for name, p in sharded.named_parameters()}
    assert {names[id(slot.param)] for slot in engine.slots if slot.on_device} == want
    report = engine.memory_report()
    assert report["device_share_params"] == sum(p.numel() for p in model.parameters() if id(p) in chosen)
    assert report["device_share_params"] <= share * report["params"]
    assert report["device_shard_bytes"] == 4 * report["device_share_params"]  # fp32 master on the device
    assert report["host_shard_bytes"] == 4 * (report["params"] - report["device_share_params"])
    assert report["device_state_bytes"] == 8 * report["device_share_params"]


@pytest.mark.parametrize("cpu_step", ["sync", "speculative"])
@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
@pytest.mark.parametrize("clip_norm", [None, 0.4])
def test_training_with_a_share_equals_training_without(mesh, cpu_step, cpu_state, clip_norm):
    """bf16 state bitwise (the device step is the native arithmetic, hash and rounding); fp32 within rounding.
    Gradient accumulation (two micro-batches a step) and a clip that fires at 0.4."""
    torch.manual_seed(0)
    model = Blocks()
    options = {"cpu_step": cpu_step, "cpu_state": cpu_state, "clip_norm": clip_norm}
    without, _, _ = share_run(model, mesh, 0.0, **options)
    for share in (0.5, 1.0):
        got, engine, _ = share_run(model, mesh, share, **options)
        assert any(slot.on_device for slot in engine.slots)
        if cpu_state == "bf16":
            assert all(torch.equal(got[k], v) for k, v in without.items())
        else:
            assert relative_error(got, without) < FP32_ROUNDING
        if clip_norm is not None:
            assert engine.last.grad_norm > clip_norm  # the clip fired


def test_speculation_leaves_the_device_share_to_the_step(mesh):
    """Only host shards are stepped during backward; the device share's steps run after it, on the device."""
    torch.manual_seed(0)
    _, engine, _ = share_run(Blocks(), mesh, 0.5, cpu_step="speculative")
    on_device = sum(slot.master.numel() for slot in engine.slots if slot.on_device)
    total = sum(slot.master.numel() for slot in engine.slots)
    assert engine.last.speculated_fraction == pytest.approx((total - on_device) / total)


def test_a_share_is_refused_where_it_cannot_apply(mesh):
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        OffloadOptions(offload_params=True, device_share=1.5)
    model = Blocks()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    with pytest.raises(ValueError, match="leave the wrapping to the strategy, or set device_share=0"):
        shard_model(model, mesh, param_dtype=torch.float32, device_share=0.5, pin_memory=False)


@pytest.mark.parametrize(("first", "second"), [(0.5, 0.0), (0.5, 0.75), (0.0, 0.5)])
def test_another_share_at_a_second_setup_is_refused_naming_the_first(mesh, first, second):
    """FSDP2 keeps a unit's shards where it first put them: a second fit asking for another share was told it had
    called fully_shard itself, or (a share of 0) silently kept the first one's units on the device."""
    model = nn.Sequential(*(MlpBlock(8) for _ in range(4)))
    shard_model(model, mesh, param_dtype=torch.float32, device_share=first, pin_memory=False)
    shard_model(model, mesh, param_dtype=torch.float32, device_share=first, pin_memory=False)  # the same: kept
    with pytest.raises(ValueError, match=f"an earlier setup sharded this model with device_share={first:g}.*"):
        shard_model(model, mesh, param_dtype=torch.float32, device_share=second, pin_memory=False)


def test_a_root_without_parameters_of_its_own_is_passed_over(mesh):
    """Every parameter in a block: the share starts at the first block, and the model so wrapped holds the share
    it was given (a second fit finds the wrapping its own)."""
    model = nn.Sequential(*(MlpBlock(8) for _ in range(4)))
    units = find_units(model)
    assert device_units(model, units, 0.5) == units[:2]
    shard_model(model, mesh, param_dtype=torch.float32, device_share=0.5, pin_memory=False)
    assert holds_share(model, 0.5) and not holds_share(model, 0.25)


def test_a_model_built_on_the_meta_device_gets_each_shard_on_its_own_side(mesh, monkeypatch):
    """The device share's units on the device, the others on the host, one module at a time: nothing of a host
    unit is ever allocated on the device (the "device" is recorded while the memory is the CPU's)."""
    allocated: dict[int, str] = {}
    real = nn.Module.to_empty

    def recording(self, *, device, recurse=True):
        assert not recurse, "a recursive to_empty allocates other units' shards on this one's side"
        for p in self.parameters(recurse=False):
            allocated[id(p)] = str(device)
        return real(self, device="cpu", recurse=False)

    monkeypatch.setattr(nn.Module, "to_empty", recording)
    monkeypatch.setattr(
        materialize, "_shard_side", lambda unit, device: "cpu" if keeps_shards_on_host(unit) else "cuda"
    )
    torch.manual_seed(0)
    eager = Blocks()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Blocks()
    shard_model(model, mesh, param_dtype=torch.float32, device_share=0.5, pin_memory=False)
    on_device = {id(p) for p in device_resident(model)}
    params = list(model.parameters())
    assert on_device and len(on_device) < len(params)
    assert all(allocated[id(p)] == ("cuda" if id(p) in on_device else "cpu") for p in params)
    assert_same_state(model, eager)  # the values are the eager build's: FSDP2's shard storage followed
