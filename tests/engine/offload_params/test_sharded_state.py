"""The parameter-offload engine's state in the sharded format, at one rank: views of the live shards and
moments, and the param groups by name. Saved and loaded through files: tests/checkpoints/test_distributed.py."""

from __future__ import annotations

import pytest
import torch
from offload_params_helpers import Blocks, make_engine, sharded_copy

from lightning_zero_offload.engine.offload_params.sharded_state import (
    load_param_groups_by_name,
    param_groups_by_name,
    sharded_state,
)


@pytest.fixture(autouse=True)
def group(mesh):
    """Every test here runs in the module's one-rank group (conftest.py)."""


def test_the_state_is_views_of_the_shards_and_moments_by_parameter_name():
    sharded = sharded_copy(Blocks())
    engine = make_engine(sharded)
    engine.slots[0].step = 3
    state = sharded_state(sharded, engine)
    head = state["optimizer"]["head.weight"]
    slot = next(slot for slot in engine.slots if slot.param is sharded.head.weight)
    assert head["exp_avg"].to_local().data_ptr() == slot.exp_avg.data_ptr() and head["exp_avg"].shape == (1, 16)
    assert state["model"]["head.weight"].to_local().data_ptr() == sharded.head.weight.to_local().data_ptr()
    assert int(state["optimizer"]["embed.weight"]["step"]) == 3 and list(state["optimizer"])[:2] == [
        "embed.weight",
        "blocks.0.fc1.weight",
    ]  # the optimizer's order: two_groups puts the weights first
    assert "optimizer" not in sharded_state(sharded, engine, with_optimizer=False)


def test_param_groups_come_back_by_name_and_other_groups_are_refused():
    sharded = sharded_copy(Blocks())
    engine = make_engine(sharded)
    saved = param_groups_by_name(sharded, engine.optimizer)
    assert saved[0]["params"][:2] == ["embed.weight", "blocks.0.fc1.weight"] and saved[1]["lr"] == 5e-3
    engine.optimizer.param_groups[1]["lr"] = 1.0
    load_param_groups_by_name(sharded, engine.optimizer, saved)
    assert engine.optimizer.param_groups[1]["lr"] == 5e-3
    one_group = torch.optim.AdamW(sharded.parameters())
    with pytest.raises(ValueError, match=r"the checkpoint has 2 param groups, the optimizer 1, and group 0 differs"):
        load_param_groups_by_name(sharded, one_group, saved)
