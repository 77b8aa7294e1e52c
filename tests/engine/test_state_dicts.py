"""The optimizer state in torch's format out of the engine and back in, where some parameters are frozen.

torch's AdamW keeps the state of a parameter that trained and was then frozen, saves it in its state dict, loads
it into a frozen parameter, and takes it up again when the parameter is unfrozen. The engine lays out only the
trainable parameters, so it parks a frozen one's state (engine/state_dicts.py): these runs hold it to torch's
behaviour through a save and a load (a resume), against torch's AdamW doing the same, at one and two ranks.
Tolerance: the engine's fp32 step is torch's to within rounding (observed <= 1e-7 here); a lost state restarts
the moments and bias correction of the layer, 1e-2 off.
"""

from functools import partial

import pytest
import torch
from engine_helpers import (
    CPU,
    FROZEN_STATE_SCENARIOS,
    batches,
    frozen_resume_training,
    loss_fn,
    make_net,
    options,
    two_groups,
)
from workers.replan import frozen_state_two_ranks

from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.testing.ranks import run_ranks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATOL = 1e-6


@pytest.mark.parametrize(
    "engine_options",
    [
        pytest.param({}, id="offload-sync"),
        pytest.param({"cpu_step": "speculative"}, id="offload-speculative"),
        pytest.param({"in_place_on_cpu": True}, id="in-place"),
    ],
)
@pytest.mark.parametrize("scenario", FROZEN_STATE_SCENARIOS)
def test_a_frozen_parameters_state_is_saved_loaded_and_taken_up_again_as_torch_does(scenario, engine_options):
    assert_resumes_as_torch(frozen_resume_training(0, 1, scenario, engine_options), scenario)


def assert_resumes_as_torch(ours: dict, scenario: str) -> None:
    reference = frozen_resume_training(0, 1, scenario, None)
    assert sorted(ours["saved"]) == sorted(reference["saved"])  # the frozen layer's state is in the state dict
    for key in ("saved", "state"):
        for index, theirs in reference[key].items():
            assert float(ours[key][index]["step"]) == float(theirs["step"])
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours[key][index][name], theirs[name], rtol=0, atol=ATOL)
    for mine, theirs in zip(ours["weights"], reference["weights"]):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=ATOL)


@pytest.mark.parametrize("cpu_step", ["sync", "speculative"])
@pytest.mark.parametrize("scenario", FROZEN_STATE_SCENARIOS)
def test_a_bf16_state_resumed_with_other_layers_frozen_rounds_as_the_uninterrupted_run(scenario, cpu_step):
    """The bf16 state's stochastic rounding numbers an element by its parameter's place among all of the optimizer's,
    frozen ones too, so a run resumed with another set of trainable layers draws the uninterrupted run's bits."""
    engine_options = {"cpu_state": "bf16", "cpu_step": cpu_step}
    resumed = frozen_resume_training(0, 1, scenario, engine_options)
    uninterrupted = frozen_resume_training(0, 1, scenario, engine_options, resume=False)
    for mine, theirs in zip(resumed["weights"], uninterrupted["weights"], strict=True):
        assert torch.equal(mine, theirs)
    assert resumed["state"].keys() == uninterrupted["state"].keys()
    for index, theirs in uninterrupted["state"].items():
        for name, value in theirs.items():
            assert torch.equal(torch.as_tensor(resumed["state"][index][name]), torch.as_tensor(value)), (index, name)


@pytest.mark.slow  # two ranks in processes
@pytest.mark.parametrize("scenario", FROZEN_STATE_SCENARIOS)
def test_at_two_ranks_every_rank_saves_and_loads_the_frozen_state_alike(tmp_path, scenario):
    for result in run_ranks(partial(frozen_state_two_ranks, scenario=scenario), 2, tmp_path):
        assert_resumes_as_torch(result, scenario)


def test_a_load_replaces_what_was_parked():
    """torch's ``load_state_dict`` replaces the whole state: a frozen parameter the loaded state has none for has
    none after it (and an unfreeze starts it afresh)."""
    net = make_net()
    engine = OffloadEngine(two_groups(net), CPU, torch.float32, options())
    empty = engine.optimizer_state_dict()
    for batch in batches(2):
        loss_fn(net, batch).backward()
        engine.step()
        engine.zero_grad()
    net[0].requires_grad_(False)
    net[2].requires_grad_(False)
    engine.replan_if_changed()
    net[2].requires_grad_(True)
    engine.replan_if_changed()  # net[0] parked
    assert sorted(engine.optimizer_state_dict()["state"]) == [0, 1, 2, 3, 4, 5]
    engine.load_optimizer_state_dict(empty)
    assert engine.optimizer_state_dict()["state"] == {}
